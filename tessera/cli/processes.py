"""The ``tessera`` commands that run a process: ``api``, ``worker``, ``beat``, ``sandbox``, ``flower`` and
``dev`` (every other process as a child). Heavy imports happen inside each command, so the command
line answers quickly and the metrics folder is set before anything imports the metrics."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from config.settings import get_settings


def share_metrics(settings) -> str:
    """Point prometheus-client's multiprocess mode at ``TESSERA_METRICS_DIR`` (unless
    ``PROMETHEUS_MULTIPROC_DIR`` is set already), before anything imports the metrics; returns it."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or str(settings.effective_metrics_dir)
    os.makedirs(folder, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


#: Seconds a process starting while its database does not answer (not up yet, restarting) waits for
#: it before refusing to start.
DATABASE_START_WAIT_SECONDS = 60.0


def keys_open(wait_seconds: float = DATABASE_START_WAIT_SECONDS) -> bool:
    """The key check (``storage.key_check``): True when this process's keys open the database's;
    else one line on stderr naming the setting, and False (the caller exits 1). While the database
    does not answer, the check is made again every second for up to ``wait_seconds`` (one line says
    so): a worker whose thread-pool children start while PostgreSQL restarts, or a stack whose
    processes start before the database, still comes up."""
    from storage.key_check import DatabaseUnavailable, KeyCheckFailed, require

    deadline = time.monotonic() + wait_seconds
    said = False
    while True:
        try:
            require()
        except DatabaseUnavailable as exc:
            if time.monotonic() < deadline:
                if not said:
                    print(f"tessera: waiting for the database: {exc}", file=sys.stderr, flush=True)
                    said = True
                time.sleep(1.0)
                continue
            print(f"tessera: refusing to start: {exc}", file=sys.stderr, flush=True)
            return False
        except KeyCheckFailed as exc:
            print(f"tessera: refusing to start: {exc}", file=sys.stderr, flush=True)
            return False
        return True


def api(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.listen_fd is None and not args.reuse_port and not keys_open():
        return 1
    share_metrics(settings)
    host = args.host or settings.api_host
    port = args.port or settings.api_port
    workers = args.workers or settings.api_workers or os.cpu_count() or 1
    if args.reuse_port or args.listen_fd is not None or workers == 1:
        return _serve_api(settings, host, port, reuse_port=args.reuse_port, listen_fd=args.listen_fd)
    argv = [sys.executable, "-m", "tessera.cli", "api", "--host", host, "--port", str(port), "--reuse-port"]
    supervisor = _Supervisor()  # signals are handled from before the first child starts
    for _ in range(workers):
        supervisor.start(argv)
    if _answers(host, port, supervisor.children, supervisor.stopping):
        print(f"tessera api listening on http://{host}:{port} ({workers} processes)", flush=True)
    return supervisor.wait()


def _answers(
    host: str, port: int, children: list[subprocess.Popen], stopping: threading.Event, timeout: float = 60.0
) -> bool:
    """Wait until the api answers ``GET /healthz`` on ``host:port`` (False when a child ended first,
    ``stopping`` was set or ``timeout`` seconds passed)."""
    import urllib.error
    import urllib.request

    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a wildcard's loopback
    url = f"http://{f'[{local}]' if ':' in local else local}:{port}/healthz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping.is_set() and all(child.poll() is None for child in children):
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def _serve_api(settings, host: str, port: int, *, reuse_port: bool, listen_fd: int | None = None) -> int:
    """One api process on ``host:port`` (``reuse_port``: beside its siblings on the same port;
    ``listen_fd``: on the listening socket its parent bound)."""
    import asyncio

    from app.main import init_app
    from infra.logs import configure_logging

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on the platforms it supports
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    configure_logging(settings)
    listening: dict = {"host": host, "port": port}
    if listen_fd is not None:  # a socket bound by the parent (tessera dev): the port is surely ours
        listening = {"sock": socket.socket(fileno=listen_fd)}

    app = init_app(settings)
    app.on_startup.append(_freeze_heap)
    asyncio.run(
        _serve_until_signalled(
            app,
            listening,
            reuse_port=reuse_port,
            drain_seconds=settings.api_drain_seconds,
            shutdown_timeout=settings.api_shutdown_timeout_seconds,
            announce=None if reuse_port else f"tessera api listening on http://{host}:{port}",
        )
    )
    return 0


async def _serve_until_signalled(
    app, listening: dict, *, reuse_port: bool, drain_seconds: float, shutdown_timeout: float, announce: str | None
) -> None:
    """Serve ``app`` on ``listening`` (``host`` and ``port``, or ``sock``), printing ``announce`` once it
    listens, until SIGTERM or SIGINT; then stop in three steps, so that no request that reached this
    process is dropped:

    1. the listening socket closes: new connections go to the sibling processes (``SO_REUSEPORT``) or,
       refused, to the other hosts behind the load balancer;
    2. ``drain_seconds`` pass (``TESSERA_API_DRAIN_SECONDS``): connections accepted just before send
       their requests, which are then in flight (aiohttp closes a connection whose request it has not
       read yet as idle);
    3. idle keep-alive connections close and requests in flight finish, for at most ``shutdown_timeout``
       seconds (``TESSERA_API_SHUTDOWN_TIMEOUT_SECONDS``).
    """
    import asyncio

    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    if "sock" in listening:
        site: web.BaseSite = web.SockSite(runner, listening["sock"])
    else:
        site = web.TCPSite(runner, listening["host"], listening["port"], reuse_port=reuse_port or None)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await site.start()
        if announce:
            print(announce, flush=True)
        await stopping.wait()
        await site.stop()
        await asyncio.sleep(drain_seconds)
    finally:
        await runner.cleanup()


async def _freeze_heap(_app) -> None:
    """Once started, move every object made so far (modules, models, routes: most of the heap) out
    of the garbage collector's sight: a full collection then walks what requests make, not the
    whole platform, so it no longer stalls the event loop for tens of milliseconds. Then collect
    the youngest generation every :data:`YOUNG_COLLECTION_THRESHOLD` allocations instead of 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


#: Net allocations between two collections of the youngest generation in an api process. A request
#: leaves a few dozen container objects to the collector; at the interpreter's 700, ``POST /tokenize``
#: under load (64 clients, 2 cores) spent 10 us a request in about 60 collections a second, each
#: about 0.3 ms; at 7,000, 4 us a request in collections of about 2 ms.
YOUNG_COLLECTION_THRESHOLD = 7_000


class _Supervisor:
    """The api processes of ``tessera api --workers N``. SIGTERM and SIGINT are handled from the moment
    it is made, before the first child starts, and passed on to each child (each then finishes the
    requests in flight, ``TESSERA_API_SHUTDOWN_TIMEOUT_SECONDS``); a child started after the signal is
    stopped at once. When one process ends on its own the others are stopped too and the exit status
    is 1 (the orchestrator restarts the service)."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []
        self.stopping = threading.Event()
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def start(self, argv: list[str]) -> None:
        """Start one api process running ``argv``."""
        child = subprocess.Popen(argv)  # noqa: S603 - our own command
        self.children.append(child)
        if self.stopping.is_set():
            child.send_signal(signal.SIGTERM)

    def _stop(self, signum: int, _frame: object = None) -> None:
        self.stopping.set()
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def wait(self) -> int:
        """Wait until every child has ended: 0 when a signal stopped them and each ended on it, 1 when
        one ended on its own first."""
        ended_on_its_own = False
        while True:
            ended = [child for child in self.children if child.poll() is not None]
            if ended and not self.stopping.is_set():
                ended_on_its_own = True
                self._stop(signal.SIGTERM)
            if len(ended) == len(self.children):
                break
            time.sleep(0.2)
        stopped = (0, -signal.SIGTERM, -signal.SIGINT)
        return 0 if not ended_on_its_own and all(c.returncode in stopped for c in self.children) else 1


def worker(args: argparse.Namespace) -> int:
    if not keys_open():
        return 1
    share_metrics(get_settings())
    from infra.logs import configure_logging
    from tessera.worker import run_worker
    from workers.celery_app import QUEUES, celery_app

    configure_logging(get_settings())
    return run_worker(celery_app, QUEUES, args.celery_args)


def beat(args: argparse.Namespace) -> int:
    from infra.logs import configure_logging
    from workers.celery_app import celery_app

    if not keys_open():
        return 1
    settings = get_settings()
    configure_logging(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    schedule = str(settings.data_dir / "celerybeat-schedule")
    celery_app.start(["beat", "--loglevel", settings.log_level, "--schedule", schedule, *args.celery_args])
    return 0


def sandbox(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from sandbox.app import run

    default = urlsplit(get_settings().sandbox_url)
    run(args.host or default.hostname or "127.0.0.1", args.port or default.port or 8081)
    return 0


def flower(args: argparse.Namespace) -> int:
    settings = get_settings()
    password = settings.flower_password.get_secret_value() if settings.flower_password else ""
    if not password:
        print("error: set TESSERA_FLOWER_PASSWORD (Flower answers its API only behind basic auth)", file=sys.stderr)
        return 2
    if ":" in settings.flower_user or "," in settings.flower_user + password:
        print("error: TESSERA_FLOWER_USER may not hold ':' or ',', nor TESSERA_FLOWER_PASSWORD ','", file=sys.stderr)
        return 2
    if settings.effective_broker_url.startswith("sqla+"):
        print(
            "error: the embedded SQLite broker carries no task events, so Flower would show none; set "
            "TESSERA_BROKER_URL=redis://... (in the environment or ./.env) for tessera dev, worker and flower alike",
            file=sys.stderr,
            flush=True,
        )
        return 2
    # Flower reads FLOWER_* options from the environment: the password stays out of the process list.
    os.environ["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # Flower serves its own /metrics from memory
    from workers.celery_app import celery_app

    argv = ["flower", f"--address={args.address}", f"--port={args.port}", *args.celery_args]
    celery_app.start(argv)
    return 0


def dev(_args: argparse.Namespace) -> int:
    from tessera.dev import run_dev

    return run_dev()
