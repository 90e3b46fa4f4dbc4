"""Sending Celery tasks only after the transaction that recorded their work commits.

Domain code calls :func:`enqueue_after_commit` inside its unit of work; the messages go out when the
session commits and are dropped if it rolls back. A lost message (the process died after the commit,
or the broker was down) is re-sent by the outbox relay (``sweeps.relay_outbox``), so a send failure
here is logged and otherwise ignored.
"""

from __future__ import annotations

import logging

from sqlalchemy import event
from sqlalchemy.orm import Session

from infra.celery import celery_app

log = logging.getLogger("tessera.dispatch")

_PENDING = "tessera_enqueue"
_BATCHES = "tessera_enqueue_batches"
#: At most this many ids ride in one batched message (a task works through them one after another).
BATCH_SIZE = 20
_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


def enqueue_after_commit(session: Session, task_name: str, **kwargs) -> None:
    """Send task ``task_name`` with keyword arguments ``kwargs`` (ids only) once ``session`` commits."""
    session.info.setdefault(_PENDING, []).append((task_name, kwargs))


def enqueue_batch_after_commit(session: Session, task_name: str, key: str, ids: list[str]) -> None:
    """Add ``ids`` to the id list argument ``key`` of task ``task_name``, sent once ``session`` commits
    in messages of at most :data:`BATCH_SIZE` ids: one transaction that records many units of work
    (a batch of events) sends a few messages, not one per unit."""
    session.info.setdefault(_BATCHES, {}).setdefault((task_name, key), []).extend(ids)


def send_task(task_name: str, *, countdown: float | None = None, **kwargs) -> bool:
    """Send one task now (to run after ``countdown`` seconds, at most a minute, when given); False
    (and a log line) when the broker did not take it."""
    try:
        celery_app.send_task(task_name, kwargs=kwargs, countdown=countdown, retry=True, retry_policy=_RETRY_POLICY)
    except Exception:
        log.warning("could not send task %s; the outbox relay will re-send it", task_name, exc_info=True)
        return False
    return True


@event.listens_for(Session, "after_commit")
def _send_after_commit(session: Session) -> None:
    if session.in_nested_transaction():  # a SAVEPOINT ended; the real transaction goes on
        return
    pending = session.info.pop(_PENDING, None)
    for task_name, kwargs in pending or ():
        send_task(task_name, **kwargs)
    for (task_name, key), ids in session.info.pop(_BATCHES, {}).items():
        for start in range(0, len(ids), BATCH_SIZE):
            send_task(task_name, **{key: ids[start : start + BATCH_SIZE]})


@event.listens_for(Session, "after_rollback")
def _drop_after_rollback(session: Session) -> None:
    if session.in_nested_transaction():
        return
    session.info.pop(_PENDING, None)
    session.info.pop(_BATCHES, None)
