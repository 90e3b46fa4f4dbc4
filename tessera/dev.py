"""``tessera dev``: the whole platform in one command, for a newcomer's machine.

Runs the migrations, then starts api, worker, beat and the sandbox as child processes (plus moto's S3
server when ``TESSERA_S3_ENDPOINT_URL`` is unset), prints the base URL, and stops them all on Ctrl-C
or SIGTERM. Each service falls back to its embedded default on its own: with nothing configured the
database and the broker are SQLite files in ``TESSERA_DATA_DIR``; with ``TESSERA_DATABASE_URL`` /
``TESSERA_BROKER_URL`` set it uses PostgreSQL and Redis. Private webhook destinations are allowed
(a newcomer's receiver is on localhost) unless ``TESSERA_ALLOW_PRIVATE_DESTINATIONS`` says otherwise.

Logs are in the human format (``TESSERA_LOG_FORMAT=console``) unless set. The api and the worker share
their Prometheus series through ``TESSERA_METRICS_DIR`` (``metrics/`` in the data dir), emptied at each
start together with the heartbeats of the previous run, so ``/metrics`` counts this run only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from config.settings import reload_settings

STOP_TIMEOUT_SECONDS = 15


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TESSERA_ALLOW_PRIVATE_DESTINATIONS", "true")
    env.setdefault("TESSERA_LOG_FORMAT", "console")
    if "TESSERA_SANDBOX_URL" not in env:
        env["TESSERA_SANDBOX_URL"] = f"http://127.0.0.1:{_free_port()}"
    if "TESSERA_S3_ENDPOINT_URL" not in env:
        env["TESSERA_S3_ENDPOINT_URL"] = f"http://127.0.0.1:{_free_port()}"
        env.setdefault("AWS_ACCESS_KEY_ID", "tessera-dev")
        env.setdefault("AWS_SECRET_ACCESS_KEY", "tessera-dev")
        env["_TESSERA_DEV_MOTO"] = "1"
    return env


def _commands(env: dict[str, str]) -> dict[str, list[str]]:
    me = [sys.executable, "-m", "tessera.cli"]
    sandbox_port = env["TESSERA_SANDBOX_URL"].rsplit(":", 1)[-1].rstrip("/")
    commands = {
        "api": [*me, "api", *([] if env.get("TESSERA_API_WORKERS") else ["--workers", "1"])],
        "worker": [*me, "worker", "--concurrency", "2"],
        "beat": [*me, "beat"],
        "sandbox": [*me, "sandbox", "--port", sandbox_port],
    }
    if env.pop("_TESSERA_DEV_MOTO", None):
        port = env["TESSERA_S3_ENDPOINT_URL"].rsplit(":", 1)[-1]
        commands["s3"] = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", port]
    return commands


def _fresh_run_state(settings) -> None:
    """Forget the previous run's metrics files and heartbeats (only those files: the folder may be shared)."""
    metrics_dir = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or settings.effective_metrics_dir)
    for folder, pattern in ((metrics_dir, "*.db"), (settings.data_dir / "heartbeats", "*.json")):
        for path in folder.glob(pattern) if folder.is_dir() else ():
            path.unlink(missing_ok=True)
    metrics_dir.mkdir(parents=True, exist_ok=True)


def _wait_for_api(base_url: str, children: dict[str, subprocess.Popen], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children.values()):
            return False
        try:
            with urllib.request.urlopen(base_url + "/status", timeout=2):  # noqa: S310 - our own loopback URL
                return True
        except OSError:
            time.sleep(0.3)
    return False


def _stop(children: dict[str, subprocess.Popen]) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    for child in children.values():
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def run_dev() -> int:
    """Run the platform until interrupted; returns the exit status."""
    from infra.logs import configure_logging
    from storage import migrate

    settings = reload_settings()
    configure_logging(settings.model_copy(update={"log_format": os.environ.get("TESSERA_LOG_FORMAT", "console")}))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    print(f"tessera dev: data in {settings.data_dir}", flush=True)
    _fresh_run_state(settings)
    migrate.upgrade()
    env = _child_environment()
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for name, command in _commands(env).items():
            children[name] = subprocess.Popen(command, env=env)  # noqa: S603 - our own interpreter
        base_url = f"http://{settings.api_host}:{settings.api_port}"
        if not _wait_for_api(base_url, children):
            print("tessera dev: the platform did not start; see the output above", file=sys.stderr, flush=True)
            return 1
        print(
            f"\nTessera is running at {base_url}  (Ctrl-C stops it)\n"
            f"Create a tenant: tessera tenants create --name demo --owner-email you@example.com --json\n",
            flush=True,
        )
        while not stopping:
            for name, child in children.items():
                if child.poll() is not None:
                    print(f"tessera dev: {name} exited with {child.returncode}; stopping", file=sys.stderr, flush=True)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop(children)
