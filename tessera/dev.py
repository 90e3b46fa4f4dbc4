"""``tessera dev``: the whole platform in one command, for a newcomer's machine.

Runs the migrations, then starts api, worker, beat and the sandbox as child processes (plus moto's S3
server when ``TESSERA_S3_ENDPOINT_URL`` is unset), prints the base URL, and stops them all on Ctrl-C
or SIGTERM. Each service falls back to its embedded default on its own: with nothing configured the
database and the broker are SQLite files in ``TESSERA_DATA_DIR``; with ``TESSERA_DATABASE_URL`` /
``TESSERA_BROKER_URL`` set it uses PostgreSQL and Redis. Private webhook destinations are allowed
(a newcomer's receiver is on localhost) unless ``TESSERA_ALLOW_PRIVATE_DESTINATIONS`` says otherwise.

The api's port is bound here, before anything starts, and handed to the api process: when it is taken
``tessera dev`` stops at once naming the port and ``TESSERA_API_PORT``, and its readiness check can
only reach its own api. The banner (base URL, data directory, where mail goes, how to watch the
queues in Flower) is printed last, once the api answers and the worker and beat have sent their
first heartbeats.

Logs are in the human format (``TESSERA_LOG_FORMAT=console``) unless set, one line per unit of work
(``infra/logs.py``); moto's line per S3 request goes to ``s3-server.log`` in the data dir. The api and
the worker share their Prometheus series through ``TESSERA_METRICS_DIR`` (``metrics/`` in the data
dir), emptied at each start together with the heartbeats of the previous run, so ``/metrics`` counts
this run only.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
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


def _commands(env: dict[str, str], api_fd: int) -> dict[str, list[str]]:
    me = [sys.executable, "-m", "tessera.cli"]
    sandbox_port = env["TESSERA_SANDBOX_URL"].rsplit(":", 1)[-1].rstrip("/")
    commands = {
        "api": [*me, "api", "--listen-fd", str(api_fd)],
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


class PortTaken(OSError):
    """The api's port is in use by another program."""


def bind_api_socket(host: str, port: int) -> socket.socket:
    """The api's listening socket, bound here so the api process inherits it. Raises
    :class:`PortTaken` with a one-line message naming the port and ``TESSERA_API_PORT``."""
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            reason = "is in use by another program" if exc.errno == errno.EADDRINUSE else "may not be used by this user"
            raise PortTaken(
                f"port {port} on {host} {reason}; stop that program or pick another port, "
                f"e.g. TESSERA_API_PORT={port + 10} tessera dev"
            ) from None
        raise
    sock.set_inheritable(True)
    return sock


def _ready(base_url: str, settings, since: float) -> bool:
    """The api answers (on the socket bound here, so it is ours) and beat and both worker nodes (the
    prefork pool and the providers pool) have recorded heartbeats since ``since`` (epoch seconds: this
    run's, not a previous run's in Redis)."""
    from infra import ops

    try:
        with urllib.request.urlopen(base_url + "/healthz", timeout=2):  # noqa: S310 - our own loopback URL
            pass
        fresh = {name: beat for name, beat in ops.heartbeats(settings).items() if beat.at >= since}
    except Exception:  # noqa: BLE001 - not ready yet, whatever the reason
        return False
    workers = [name for name, beat in fresh.items() if beat.kind == "worker"]
    # `tessera worker` is three nodes: the prefork pool and the providers and reactors thread pools
    return (
        any(beat.kind == "beat" for beat in fresh.values())
        and any("-providers@" in name for name in workers)
        and any("-reactors@" in name for name in workers)
        and any("-providers@" not in name and "-reactors@" not in name for name in workers)
    )


def _wait_until_ready(
    base_url: str, settings, children: dict[str, subprocess.Popen], since: float, timeout: float = 90
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children.values()):
            return False
        if _ready(base_url, settings, since):
            return True
        time.sleep(0.3)
    return False


def typed_command(cwd: Path | None = None) -> str:
    """How to type this installation's ``tessera`` command in a shell opened in ``cwd`` (default: the
    working folder): ``tessera`` when the shell finds this one, else its script's path (relative to
    ``cwd`` when inside it, e.g. ``.venv/bin/tessera``), else ``<python> -m tessera.cli``."""
    script = Path(sys.executable).parent / "tessera"  # the environment's bin folder (not resolved)
    found = shutil.which("tessera")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "tessera"
    if script.exists():
        try:
            return str(script.relative_to(cwd or Path.cwd()))
        except ValueError:
            return str(script)
    return f"{sys.executable} -m tessera.cli"


def banner(settings, base_url: str) -> str:
    """What ``tessera dev`` prints once everything runs: the base URL, the data directory, where
    mail goes and how to watch the queues, its commands as they are typed from the working folder
    (:func:`typed_command`); the names of the ``TESSERA_*`` settings this run got from its
    environment, which another shell needs too (names only: values may hold passwords)."""
    tessera = typed_command()
    inherited = sorted(name for name in os.environ if name.startswith("TESSERA_"))
    mail = (
        f"sent through {settings.smtp_url.split('@')[-1]}"
        if settings.smtp_url
        else f"written as .eml files to {settings.data_dir / 'mail'}"
    )
    if settings.effective_broker_url.startswith("sqla+"):
        flower = f"Flower needs a Redis broker: set TESSERA_BROKER_URL=redis://... and run {tessera} flower"
    else:
        flower = f"TESSERA_FLOWER_PASSWORD=choose-one {tessera} flower   (then http://127.0.0.1:5555)"
    settings_line = (
        f"  another shell needs the same settings: {', '.join(inherited)}\n"
        "  (or put them in ./.env, which every command run from this folder reads)\n"
        if inherited
        else ""
    )
    rule = "-" * 78
    return (
        f"\n{rule}\n"
        f"  Tessera is running at {base_url}   (Ctrl-C stops it)\n"
        f"  data:    {settings.data_dir}\n"
        f"  mail:    {mail}\n"
        f"  queues:  {tessera} queues; in a browser: {flower}\n"
        f"  start:   {tessera} tenants create --name demo --owner-email you@example.com --json\n"
        f"{settings_line}"
        f"{rule}\n"
    )


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
    try:
        api_socket = bind_api_socket(settings.api_host, settings.api_port)
    except PortTaken as exc:
        print(f"tessera dev: {exc}", file=sys.stderr, flush=True)
        return 1
    if not settings.s3_endpoint_url and importlib.util.find_spec("moto") is None:
        print(
            "tessera dev: moto's S3 server stands in for S3 when TESSERA_S3_ENDPOINT_URL is unset, and moto is not "
            "installed: pip install -e '.[dev]' (make dev does), or set TESSERA_S3_ENDPOINT_URL",
            file=sys.stderr,
            flush=True,
        )
        return 1
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
        fd = api_socket.fileno()
        started = time.time()
        s3_log = (settings.data_dir / "s3-server.log").open("ab")  # moto's line per S3 request: not the console
        for name, command in _commands(env, fd).items():
            s3 = name == "s3"
            children[name] = subprocess.Popen(  # noqa: S603 - our own interpreter
                command,
                env=env,
                pass_fds=(fd,) if name == "api" else (),
                stdout=s3_log if s3 else None,
                stderr=subprocess.STDOUT if s3 else None,
            )
        s3_log.close()
        api_socket.close()  # the api process holds it now
        base_url = f"http://{settings.api_host}:{settings.api_port}"
        if not _wait_until_ready(base_url, settings, children, started):
            print("tessera dev: the platform did not start; see the output above", file=sys.stderr, flush=True)
            return 1
        print(banner(settings, base_url), flush=True)
        while not stopping:
            for name, child in children.items():
                if child.poll() is not None:
                    print(f"tessera dev: {name} exited with {child.returncode}; stopping", file=sys.stderr, flush=True)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        api_socket.close()
        _stop(children)
