"""Beat's scheduler: periodic tasks that are sent only when they have something to do.

Some sweeps run every few seconds but usually find nothing (the outbox relay, the release of stale
job leases, the account updater's look for uploaded files). A Celery task every few seconds that
does nothing floods Flower's task list and the console, so beat first asks one cheap ``EXISTS``
query in its own process (:data:`GATES`) and sends the task only when the answer is yes. When the
database cannot be asked, the task is sent anyway (the sweep then finds out itself).

``tessera beat`` runs this scheduler (``beat_scheduler`` in ``workers/celery_app.py``); the relay's
heartbeat is written after each of its passes, sent or not, so ``tessera queues`` shows it alive (beat's
own heartbeat comes from a thread of its own, ``workers/signals.py``).

Several beat processes may run (on several hosts, for a standby): exactly one schedules at any time,
the holder of the ``beat`` leader lock (:class:`storage.leader.LeaderLock`: a PostgreSQL advisory lock
on a connection of its own; a file lock on the embedded database). The others stand by, asking for the
lock every :data:`STANDBY_POLL_SECONDS`; when the active one dies its lock is freed at once (its
connection closes; within about 25 s when its whole host vanishes) and a standby takes over.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from celery.beat import PersistentScheduler
from sqlalchemy import exists, select
from sqlmodel import Session, col

from config.settings import get_settings
from infra import ops, outbox
from storage.db import session_scope
from storage.leader import LeaderLock
from storage.models_account_updater import AccountUpdaterJob
from storage.states import AccountUpdaterStatus
from storage.types import utcnow

log = logging.getLogger("tessera.beat")

RELAY_TASK = "sweeps.relay_outbox"


def _uploads_awaited(session: Session) -> bool:
    now = utcnow()
    return bool(
        session.scalar(
            select(
                exists().where(
                    col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING,
                    col(AccountUpdaterJob.expires_at) > now,
                )
            )
        )
    )


#: Task name -> the query that tells whether sending it now would do anything.
GATES: dict[str, Callable[[Session], bool]] = {
    RELAY_TASK: lambda session: outbox.relay_due(session, grace_seconds=get_settings().outbox_relay_after_seconds),
    "sweeps.release_stale_leases": lambda session: outbox.stale_leases_exist(session),
    "account_updater.detect_uploads": _uploads_awaited,
}


def has_work(task_name: str) -> bool:
    """Whether the periodic task ``task_name`` has something to do now (True for ungated tasks and
    when the database cannot be asked)."""
    gate = GATES.get(task_name)
    if gate is None:
        return True
    try:
        with session_scope() as session:
            return gate(session)
    except Exception:
        log.warning("could not ask whether %s has work; sending it", task_name, exc_info=True)
        return True


#: Seconds between two asks for the scheduler lock by a standby beat.
STANDBY_POLL_SECONDS = 5.0
_state = {"value": "standby"}


def beat_state() -> str:
    """``active`` while this process holds the scheduler lock and schedules, else ``standby``."""
    return _state["value"]


def record_beat_heartbeat() -> None:
    """Beat's heartbeats: ``beat:<host>:<pid>`` with its state (``active`` or ``standby``) for every
    beat process, and ``beat`` from the active one (what ``tessera queues`` calls beat alive by).
    Recorded every :data:`infra.ops.HEARTBEAT_SECONDS` by a thread (``workers/signals.py``) and at
    once when this process turns active, so beat shows alive from its first scheduling tick on."""
    state = beat_state()
    try:
        settings = get_settings()
        ops.record_heartbeat(settings, f"beat:{socket.gethostname()}:{os.getpid()}", state=state)
        if state == "active":
            ops.record_heartbeat(settings, "beat", state=state)
    except Exception:
        log.warning("could not record beat's heartbeat", exc_info=True)


class Scheduler(PersistentScheduler):
    """Celery's persistent scheduler, sending a gated entry only when :func:`has_work` says so, and
    only while this process holds the ``beat`` leader lock (a standby ticks without sending)."""

    def __init__(self, *args, **kwargs):
        settings = get_settings()
        self._leader = LeaderLock("beat", database_url=settings.effective_database_url, data_dir=settings.data_dir)
        super().__init__(*args, **kwargs)

    def tick(self, *args, **kwargs):
        """Schedule when holding the lock; else stand by and ask again in :data:`STANDBY_POLL_SECONDS`."""
        if not self._leader.hold():
            if _state["value"] != "standby":
                log.warning("beat: the scheduler lock is lost; standing by")
            _state["value"] = "standby"
            return STANDBY_POLL_SECONDS
        if _state["value"] != "active":
            _state["value"] = "active"
            record_beat_heartbeat()  # alive now, not at the heartbeat thread's next turn
            log.info("beat: active, holding the scheduler lock")
        return super().tick(*args, **kwargs)

    def close(self):
        """Give the lock up as the process stops, so a standby takes over at once."""
        try:
            super().close()
        finally:
            self._leader.release()
            _state["value"] = "standby"

    def apply_entry(self, entry, producer=None):
        if has_work(entry.task):
            super().apply_entry(entry, producer=producer)
        else:
            log.debug("beat: %s has nothing to do; not sent", entry.task)
        if entry.task == RELAY_TASK:
            try:  # the relay looked (here, or in the task it sent); beat's own heartbeat is a thread
                ops.record_heartbeat(get_settings(), "relay")  # of its own (workers/signals.py)
            except Exception:
                log.warning("could not record the relay's heartbeat", exc_info=True)
