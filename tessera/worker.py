"""``tessera worker``: two Celery workers, so provider calls never queue behind the prefork pool.

* This process runs the prefork worker on every queue but ``providers`` (CPU-bound and mixed work:
  webhooks, files, mail, sweeps, default), with the options given (``--concurrency N``, ``-n NAME``...).
* A child process runs the ``providers`` queue (card network and agentic provider calls, I/O-bound:
  a thread waits on the network) on a thread pool of ``TESSERA_PROVIDER_CONCURRENCY`` threads
  (default 16), named ``<name>-providers@<host>``. It stays in this process's group (a group kill
  takes both), gets the shutdown signal this process gets (a warm shutdown finishes its running
  calls), and is sent SIGTERM by the kernel if this process dies without one.

With ``-Q``/``--queues`` given, one worker runs exactly as asked (that is how the child is started).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys

from celery import signals

from config.settings import get_settings

log = logging.getLogger("tessera.worker")

PROVIDERS_QUEUE = "providers"
_PR_SET_PDEATHSIG = 1
_QUEUE_OPTIONS = ("-Q", "--queues")
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


def providers_hostname(hostname: str | None) -> str:
    """The node name of the providers worker beside the worker named ``hostname`` (celery's default:
    ``celery@%h``): ``a@%h`` -> ``a-providers@%h``."""
    name, _, host = (hostname or "celery@%h").partition("@")
    return f"{name}-providers@{host or '%h'}"


def providers_command(celery_args: list[str]) -> list[str]:
    """The command line of the providers worker that goes with ``tessera worker <celery_args>``."""
    return [sys.executable, "-m", "tessera.cli", "worker", "-Q", PROVIDERS_QUEUE, "-P", "threads",
            "-c", str(get_settings().provider_concurrency),
            "-n", providers_hostname(_option(celery_args, _HOSTNAME_OPTIONS))]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run_worker(celery_app, queues: tuple[str, ...], celery_args: list[str]) -> int:
    """Run the workers of ``tessera worker``; returns when they stopped."""
    settings = get_settings()
    base = ["worker", "--loglevel", settings.log_level]
    if _option(celery_args, _QUEUE_OPTIONS) is not None or PROVIDERS_QUEUE not in queues:
        celery_app.worker_main([*base, *celery_args])
        return 0
    others = [name for name in queues if name != PROVIDERS_QUEUE]
    child = subprocess.Popen(providers_command(celery_args),  # noqa: S603 - our own interpreter
                             preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def forward(sig=None, **_kwargs) -> None:
        """Stop the providers worker the way this one stops (warm on SIGTERM/SIGINT, cold on SIGQUIT)."""
        if child.poll() is None:
            child.send_signal(getattr(signal, str(sig), signal.SIGTERM))

    signals.worker_shutting_down.connect(forward, weak=False)
    try:
        celery_app.worker_main([*base, "-Q", ",".join(others), *celery_args])
    finally:
        forward("SIGTERM")
        try:
            child.wait(settings.task_time_limit_seconds + 10)
        except subprocess.TimeoutExpired:
            log.warning("the providers worker did not stop in time; killing it")
            child.kill()
            child.wait()
    return 0
