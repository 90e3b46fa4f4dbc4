"""``tessera api --workers N``: N processes on one port (SO_REUSEPORT), stopped together."""

from __future__ import annotations

import signal
import time

import psutil
import urllib3


def _listening_pids(platform, answers: int = 40) -> set[int]:
    """The processes listening on the api's port, once the api has answered ``answers`` requests."""
    port = int(platform.env["TESSERA_API_PORT"])
    for _ in range(answers):
        assert urllib3.request("GET", platform.api_url + "/healthz", timeout=5, retries=False).status == 200
    return {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"}


def _start_two(platform):
    """``tessera api --workers 2`` and its two api processes, once both run."""
    api = platform.start("api", "api", "--workers", "2")
    deadline = time.monotonic() + 60
    children: list[psutil.Process] = []
    while time.monotonic() < deadline and len(children) < 2:
        assert api.alive(), api.output()
        children = psutil.Process(api.popen.pid).children()
        time.sleep(0.2)
    assert len(children) == 2, api.output()
    return api, children


def test_workers_share_the_port_and_stop_together(platform):
    api, children = _start_two(platform)
    listeners: set[int] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            listeners = _listening_pids(platform)
            if len(listeners) == 2:
                break
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.2)
    assert listeners == {child.pid for child in children}  # both listen on the one port
    api.signal(signal.SIGTERM)
    assert api.popen.wait(timeout=60) == 0, api.output()
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)


def test_when_one_worker_dies_the_others_stop_and_the_command_fails(platform):
    api, children = _start_two(platform)
    children[0].kill()
    assert api.popen.wait(timeout=60) == 1, api.output()
    assert not children[1].is_running() or children[1].status() == psutil.STATUS_ZOMBIE


def test_a_signal_before_the_workers_answer_stops_them_all(platform):
    """SIGTERM while the api processes are still starting: the command passes it on and ends with 0,
    leaving no process behind (it used to die of the signal and leave its children running)."""
    api, children = _start_two(platform)
    api.signal(signal.SIGTERM)
    assert api.popen.wait(timeout=60) == 0, api.output()
    for child in children:
        try:
            child.wait(timeout=30)
        except psutil.NoSuchProcess:
            pass
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
