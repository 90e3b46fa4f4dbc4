"""Celery signals: log context, task metrics and heartbeats, for every worker and producer.

* Producers (the api, the CLI, tasks, beat) put the current trace and tenant ids in each message's
  headers (``before_task_publish``); a worker binds them, the task name and id and the job id to
  every log line of the run (``task_prerun``) and forgets them after (``task_postrun``). A job task
  whose message carries no trace (one re-sent by the relay) takes it from its job row.
* Each run is counted by task name and outcome and timed (``infra/metrics.py``).
* Traces (``infra/tracing``, off unless the ``OTEL_*`` variables ask): set up in each process that
  runs tasks (a prefork pool process, or the worker itself with the thread or solo pool) and in beat.
* Heartbeats (``infra/ops.py``): a worker and beat every ten seconds while they run, each from a
  thread of its own (never as a Celery task: nothing shows up in Flower or the console); the outbox
  relay's from beat's scheduler after each of its passes (``workers/beat.py``) and after each run.

Imported by ``workers/celery_app.py``, so every process using the Celery app has them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from celery import signals

from config.settings import get_settings
from infra import logs, metrics, ops, tracing
from infra.celery import TENANT_HEADER, TRACE_HEADER
from storage.db import session_scope
from storage.models import Job
from workers.beat import record_beat_heartbeat

log = logging.getLogger("tessera.workers")

RELAY_TASK = "sweeps.relay_outbox"

_started: dict[str, float] = {}
_heartbeat_stop = threading.Event()


# ---- heartbeats ----------------------------------------------------------------------------------


def _heartbeat(name: str) -> None:
    try:
        ops.record_heartbeat(get_settings(), name)
    except Exception:
        log.warning("could not record the %s heartbeat", name, exc_info=True)


def start_heartbeat(name: str, record: Callable[[], None] | None = None) -> threading.Thread:
    """Record the heartbeat ``name`` (or call ``record``, which records its own) now and every
    :data:`infra.ops.HEARTBEAT_SECONDS` from a daemon thread, until :data:`_heartbeat_stop` is set;
    independent of what the process publishes or runs."""
    _heartbeat_stop.clear()

    def beat() -> None:
        while True:
            if record is not None:
                record()
            else:
                _heartbeat(name)
            if _heartbeat_stop.wait(ops.HEARTBEAT_SECONDS):
                return

    thread = threading.Thread(target=beat, name="tessera-heartbeat", daemon=True)
    thread.start()
    return thread


@signals.beat_init.connect
def _beat_started(sender=None, **_kwargs) -> None:
    """Beat is alive while its process runs, whether or not a scheduled task is due. Beat sends only
    the periodic sweeps, whose runs Flower does not list: no task-sent events from here."""
    if sender is not None:
        sender.app.conf.task_send_sent_event = False
    tracing.configure("beat")
    start_heartbeat("beat", record_beat_heartbeat)


# ---- task runs -----------------------------------------------------------------------------------


@signals.task_prerun.connect
def _task_prerun(task_id=None, task=None, kwargs=None, **_kwargs) -> None:
    """Bind the run's context to its log lines; start its clock."""
    logs.clear()
    name = getattr(task, "name", None) or "unknown"
    request = getattr(task, "request", None)
    job_id = (kwargs or {}).get("job_id")
    trace_id = _header(request, TRACE_HEADER)
    tenant_id = _header(request, TENANT_HEADER)
    if job_id and (trace_id is None or tenant_id is None):
        trace_id, tenant_id = _job_context(job_id, trace_id, tenant_id)
    logs.bind(task=name, task_id=task_id, job_id=job_id, trace_id=trace_id, tenant_id=tenant_id)
    if task_id:
        _started[task_id] = time.monotonic()
    metrics.task_started(name)


@signals.task_postrun.connect
def _task_postrun(task_id=None, task=None, retval=None, state=None, **_kwargs) -> None:
    """Count and time the run by its outcome; forget its context."""
    name = getattr(task, "name", None) or "unknown"
    started = _started.pop(task_id, None) if task_id else None
    try:
        metrics.task_finished(name, outcome_of(state, retval), None if started is None else time.monotonic() - started)
        if name == RELAY_TASK and state == "SUCCESS":
            _heartbeat("relay")
    finally:
        logs.clear()


def outcome_of(state: str | None, retval) -> str:
    """The outcome label of a run: a job task's returned status, else from the Celery state (a
    reported failure, :class:`infra.task.AttemptFailed`, says ``failed`` or ``dead``)."""
    if state == "SUCCESS":
        return retval if isinstance(retval, str) and retval in metrics.JOB_OUTCOMES else "succeeded"
    if state == "RETRY":
        return "retrying"
    if state == "FAILURE":
        outcome = getattr(retval, "outcome", None)
        return outcome if outcome in metrics.JOB_OUTCOMES else "error"
    return (state or "unknown").lower()


def _header(request, name: str) -> str | None:
    if request is None:
        return None
    value = request.get(name) if hasattr(request, "get") else getattr(request, name, None)
    return str(value) if value else None


def _job_context(job_id, trace_id, tenant_id) -> tuple[str | None, str | None]:
    try:
        with session_scope() as session:
            job = session.get(Job, uuid.UUID(str(job_id)))
            if job is not None:
                trace_id = trace_id or job.trace_id
                tenant_id = tenant_id or (str(job.tenant_id) if job.tenant_id else None)
    except Exception:
        log.debug("no job context for %s", job_id, exc_info=True)
    return trace_id, tenant_id


# ---- worker processes ----------------------------------------------------------------------------


@signals.worker_init.connect
def _trace_worker(sender=None, **_kwargs) -> None:
    """A worker whose tasks run in its own process (thread or solo pool) sets up tracing here; a
    prefork worker's pool processes each set up their own after the fork (:func:`_trace_pool_process`)."""
    if not _prefork(getattr(sender, "pool_cls", None)):
        tracing.configure("worker")


@signals.worker_process_init.connect
def _trace_pool_process(**_kwargs) -> None:
    """A pool process (prefork, or the solo pool's own) sets up its own tracing: a tracer provider
    and its export thread do not survive a fork."""
    tracing.configure("worker")


def _prefork(pool_cls) -> bool:
    """Whether the worker's pool (a name such as ``threads`` or a pool class) is the prefork pool."""
    from celery import concurrency
    from celery.concurrency.prefork import TaskPool

    if pool_cls is None:
        return True  # Celery's default pool
    pool = concurrency.get_implementation(pool_cls)
    return isinstance(pool, type) and issubclass(pool, TaskPool)


@signals.worker_ready.connect
def _worker_ready(sender=None, **_kwargs) -> None:
    """Start the worker's heartbeat (in the worker's main process)."""
    start_heartbeat(f"worker:{getattr(sender, 'hostname', None) or 'celery'}")


@signals.worker_shutdown.connect
def _worker_shutdown(sender=None, **_kwargs) -> None:
    """Stop the heartbeat and remove it: a worker that stopped cleanly is not "missing"."""
    _heartbeat_stop.set()
    try:
        ops.forget_heartbeat(get_settings(), f"worker:{getattr(sender, 'hostname', None) or 'celery'}")
    except Exception:
        log.warning("could not remove the worker heartbeat", exc_info=True)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _own_loggers_to_root(logger=None, **_kwargs) -> None:
    """Celery gives ``celery.task`` and the pool's ``multiprocessing`` logger handlers and a format of
    their own: in a ``tessera`` process their lines go to the root handler, structured like the rest."""
    if not logs.is_configured():
        return
    from celery.utils.log import get_multiprocessing_logger

    for own in (logging.getLogger("celery.task"), get_multiprocessing_logger()):
        if own is not None and own is not logging.getLogger():
            own.handlers[:] = []
            own.propagate = True


@signals.worker_process_shutdown.connect
def _worker_process_shutdown(**_kwargs) -> None:
    """A pool process exits: its in-progress gauge no longer counts; its buffered spans are sent."""
    metrics.mark_process_dead()
    tracing.flush()
