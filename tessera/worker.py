"""``tessera worker``: three Celery workers, so provider calls and customer code never queue behind
the prefork pool, nor behind each other.

* This process runs the prefork worker on every queue but ``providers`` and ``reactors`` (CPU-bound
  and mixed work: webhooks, files, mail, sweeps, default), with the options given
  (``--concurrency N``, ``-n NAME``...).
* A child process runs the ``providers`` queue (card network and agentic provider calls, I/O-bound:
  a thread waits on the network) on a thread pool of ``TESSERA_PROVIDER_CONCURRENCY`` threads
  (default 16), named ``<name>-providers@<host>``.
* A child process runs the ``reactors`` queue (customer code's builds and runs: a thread waits on a
  sandboxed Node.js process) on twice ``TESSERA_REACTOR_SLOTS`` threads, named
  ``<name>-reactors@<host>``: a tenant alone may hold the slots, and a tenant arriving during
  another's flood finds a thread at once (``infra/fairness.py``). Its warm processes live in that one
  process, where the broadcast that ends a deleted reactor's processes reaches them.

Each child stays in this process's group (a group kill takes all), gets the shutdown signal this
process gets (a warm shutdown finishes its running calls), and is sent SIGTERM by the kernel if this
process dies without one. At start, a host that cannot confine customer code (bubblewrap missing,
namespaces refused) says so in one line: its reactor runs and code transforms answer 503.

With ``-Q``/``--queues`` given, one worker runs exactly as asked (that is how a child is started);
``-X``/``--exclude-queues`` leaves queues out, their thread-pool node too (``-X reactors`` where
customer code runs in a service of its own, as in ``docker-compose.yml``).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys

from celery import signals

from config.settings import get_settings
from infra.node_runtime.sandbox import availability

log = logging.getLogger("tessera.worker")

PROVIDERS_QUEUE = "providers"
REACTORS_QUEUE = "reactors"
_PR_SET_PDEATHSIG = 1
_QUEUE_OPTIONS = ("-Q", "--queues")
_EXCLUDE_OPTIONS = ("-X", "--exclude-queues")
_HOSTNAME_OPTIONS = ("-n", "--hostname")


def _option(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` in ``argv`` (``-n X``, ``--hostname X``, ``--hostname=X``)."""
    for index, arg in enumerate(argv):
        if arg in names and index + 1 < len(argv):
            return argv[index + 1]
        for name in names:
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def thread_queues() -> dict[str, int]:
    """The queues served by a thread-pool worker of their own, with its thread count."""
    settings = get_settings()
    return {PROVIDERS_QUEUE: settings.provider_concurrency, REACTORS_QUEUE: 2 * settings.reactor_slots}


def child_hostname(hostname: str | None, queue: str = PROVIDERS_QUEUE) -> str:
    """The node name of the ``queue`` worker beside the worker named ``hostname`` (celery's default:
    ``celery@%h``): ``a@%h`` -> ``a-providers@%h``."""
    name, _, host = (hostname or "celery@%h").partition("@")
    return f"{name}-{queue}@{host or '%h'}"


def child_command(celery_args: list[str], queue: str = PROVIDERS_QUEUE) -> list[str]:
    """The command line of the ``queue`` worker that goes with ``tessera worker <celery_args>``."""
    return [
        sys.executable,
        "-m",
        "tessera.cli",
        "worker",
        "-Q",
        queue,
        "-P",
        "threads",
        "-c",
        str(thread_queues()[queue]),
        "-n",
        child_hostname(_option(celery_args, _HOSTNAME_OPTIONS), queue),
    ]


def sandbox_line() -> str | None:
    """The one line said at start when this host cannot confine customer code; None when it can."""
    reason = availability(get_settings().reactor_bwrap)
    if reason is None:
        return None
    return f"customer code cannot run on this worker (reactors and code transforms answer 503): {reason}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run_worker(celery_app, queues: tuple[str, ...], celery_args: list[str]) -> int:
    """Run the workers of ``tessera worker``; returns when they stopped."""
    settings = get_settings()
    base = ["worker", "--loglevel", settings.log_level]
    excluded = (_option(celery_args, _EXCLUDE_OPTIONS) or "").split(",")
    queues = tuple(name for name in queues if name not in excluded)
    asked = _option(celery_args, _QUEUE_OPTIONS)
    serves_code = REACTORS_QUEUE in (asked.split(",") if asked is not None else queues)
    line = sandbox_line() if serves_code else None
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    apart = [name for name in thread_queues() if name in queues]
    if asked is not None or not apart:
        celery_app.worker_main([*base, *celery_args])
        return 0
    others = [name for name in queues if name not in apart]
    children = [
        subprocess.Popen(  # noqa: S603 - our own interpreter
            child_command(celery_args, queue),
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        for queue in apart
    ]

    def forward(sig=None, **_kwargs) -> None:
        """Stop the thread-pool workers the way this one stops (warm on SIGTERM/SIGINT, cold on SIGQUIT)."""
        for child in children:
            if child.poll() is None:
                child.send_signal(getattr(signal, str(sig), signal.SIGTERM))

    signals.worker_shutting_down.connect(forward, weak=False)
    try:
        celery_app.worker_main([*base, "-Q", ",".join(others), *celery_args])
    finally:
        forward("SIGTERM")
        for child in children:
            try:
                child.wait(settings.task_time_limit_seconds + 10)
            except subprocess.TimeoutExpired:
                log.warning("a thread-pool worker did not stop in time; killing it")
                child.kill()
                child.wait()
    return 0
