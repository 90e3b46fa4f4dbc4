"""Beat with a standby: two ``tessera beat`` processes (each with a data dir of its own, as on two
hosts) share the test database and Redis; exactly one schedules, the other stands by, and when the
active one is killed the standby takes over within the lease (60 s; here a few seconds: the killed
process's advisory lock goes with its connection). ``tessera queues --json`` lists both."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from infra.ops import HEARTBEAT_SECONDS
from storage.leader import LeaderLock
from tests.helpers import wait_until

pytestmark = pytest.mark.kill


def _beats(platform) -> list[dict]:
    answer = platform.run("queues", "--json", "--timeout", "0.5")
    return json.loads(answer.stdout)["beats"]


def _by_pid(beats: list[dict]) -> dict[int, str]:
    return {beat["pid"]: beat["state"] for beat in beats}


def test_one_beat_schedules_the_standby_takes_over_when_it_dies(platform, tmp_path):
    first = platform.start("beat-1", "beat", extra_env={"TESSERA_DATA_DIR": str(tmp_path / "host-1")})
    second = platform.start("beat-2", "beat", extra_env={"TESSERA_DATA_DIR": str(tmp_path / "host-2")})
    pids = {first.popen.pid, second.popen.pid}
    # both heartbeat as standby from their start; one turns active at its first tick
    wait_until(lambda: sorted(_by_pid(_beats(platform)).values()) == ["active", "standby"], timeout=60, interval=1)
    states = _by_pid(_beats(platform))
    assert set(states) == pids, states
    active = first if states[first.popen.pid] == "active" else second
    standby = second if active is first else first
    assert "active, holding the scheduler lock" in active.output()

    os.killpg(active.popen.pid, signal.SIGKILL)  # no goodbye: its connection (and lock) just goes
    killed_at = time.monotonic()
    wait_until(lambda: _by_pid(_beats(platform)).get(standby.popen.pid) == "active", timeout=60, interval=0.5)
    took_over_in = time.monotonic() - killed_at
    assert took_over_in < 60
    assert "active, holding the scheduler lock" in standby.output()
    # never two schedulers at once: the survivor holds the lock, so nobody else can take it
    settings = platform.settings()
    other = LeaderLock("beat", database_url=settings.effective_database_url, data_dir=tmp_path / "host-3")
    try:
        assert not other.hold()
    finally:
        other.release()
    print(f"beat failover: the standby scheduled {took_over_in:.1f} s after the active beat was killed")


def test_the_leader_lock_is_held_by_one_at_a_time_and_freed_by_release(database, tmp_path):
    from config.settings import get_settings

    url = get_settings().effective_database_url
    one = LeaderLock("tests-leader", database_url=url, data_dir=tmp_path)
    two = LeaderLock("tests-leader", database_url=url, data_dir=tmp_path)
    try:
        assert one.hold() and one.held
        assert not two.hold() and not two.held
        assert one.hold()  # still ours on the next tick
        one.release()
        assert two.hold()
        assert not one.hold()
    finally:
        one.release()
        two.release()


def test_on_the_embedded_database_the_leader_lock_is_a_file_lock(tmp_path):
    url = f"sqlite:///{tmp_path / 'tessera.db'}"
    one = LeaderLock("beat", database_url=url, data_dir=tmp_path)
    two = LeaderLock("beat", database_url=url, data_dir=tmp_path)
    try:
        assert one.hold() and not two.hold()
        one.release()
        assert two.hold()
    finally:
        one.release()
        two.release()


def test_beat_shows_alive_as_soon_as_it_schedules(platform, tmp_path):
    """``tessera queues`` calls beat alive once the active beat has written its heartbeat: it does at
    its first scheduling tick, not up to a heartbeat interval later (a beat that had just started
    answered ``alive: false`` while it was already relaying)."""
    beat = platform.start("beat", "beat", extra_env={"TESSERA_DATA_DIR": str(tmp_path / "host")})
    wait_until(lambda: "active, holding the scheduler lock" in beat.output(), timeout=60, interval=0.1)
    answer = json.loads(platform.run("queues", "--json", "--timeout", "0.5").stdout)
    assert answer["beat"]["alive"], answer["beat"]
    assert answer["beat"]["heartbeat_age_seconds"] < HEARTBEAT_SECONDS / 2, answer["beat"]
