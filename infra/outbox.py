"""The outbox relay: re-sending recorded work that no worker picked up (``ARCHITECTURE.md`` step 2).

Work is recorded in the database (a pending webhook delivery, a queued job) in the transaction that
needs it, and its task is sent after the commit. If that message is lost (the process died between
commit and send, the broker lost it, a worker died holding it), the row stays due. The relay, run by
beat, finds rows due for longer than ``TESSERA_OUTBOX_RELAY_AFTER_SECONDS`` with no live lease and
sends their tasks again, marking ``enqueued_at`` so a backlog is not re-sent on every pass. Tasks are
idempotent and lease their row, so a duplicate message does nothing twice.

The relay idles without a backlog: beat asks :func:`relay_due` (one ``EXISTS`` query) before it sends
the ``sweeps.relay_outbox`` task and sends nothing when nothing is due (``workers/beat.py``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import exists, or_
from sqlmodel import Session, select

from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_after_commit, enqueue_batch_after_commit
from storage.models import Job, WebhookDelivery
from storage.types import utcnow


def _due_where(model, now: dt.datetime, grace: dt.timedelta, status: str) -> tuple:
    return (
        model.status == status,
        model.due_at <= now - grace,
        or_(model.lease_expires_at.is_(None), model.lease_expires_at < now),
        or_(model.enqueued_at.is_(None), model.enqueued_at < now - grace * 4),
    )


def _due(model, now: dt.datetime, grace: dt.timedelta, status: str):
    return select(model).where(*_due_where(model, now, grace, status)).order_by(model.due_at)


def relay_due(session: Session, *, grace_seconds: float, now: dt.datetime | None = None) -> bool:
    """Whether :func:`relay` has anything to re-send: one cheap ``EXISTS`` query (on the due-time
    indexes), run by beat before it sends the relay task, so the relay idles without a backlog."""
    now = now or utcnow()
    grace = dt.timedelta(seconds=grace_seconds)
    return bool(
        session.scalar(
            select(
                exists().where(*_due_where(WebhookDelivery, now, grace, "pending"))
                | exists().where(*_due_where(Job, now, grace, "queued"))
            )
        )
    )


def stale_leases_exist(session: Session, *, now: dt.datetime | None = None) -> bool:
    """Whether :func:`release_stale_leases` has anything to release (one ``EXISTS`` query)."""
    now = now or utcnow()
    return bool(session.scalar(select(exists().where(Job.status == "running", Job.lease_expires_at < now))))


def relay(session: Session, *, now: dt.datetime | None = None, grace_seconds: float, batch: int = 1000) -> int:
    """Re-send the tasks of up to ``batch`` stranded deliveries and jobs; returns how many rows."""
    now = now or utcnow()
    grace = dt.timedelta(seconds=grace_seconds)
    deliveries = session.exec(
        _due(WebhookDelivery, now, grace, "pending").limit(batch).with_for_update(skip_locked=True)
    ).all()
    ids = []
    for delivery in deliveries:
        delivery.enqueued_at = now
        session.add(delivery)
        ids.append(str(delivery.id))
    enqueue_batch_after_commit(session, DELIVER_TASK, "delivery_ids", ids)
    jobs = session.exec(_due(Job, now, grace, "queued").limit(batch).with_for_update(skip_locked=True)).all()
    for job in jobs:
        job.enqueued_at = now
        session.add(job)
        enqueue_after_commit(session, job.kind, job_id=str(job.id))
    return len(deliveries) + len(jobs)


def release_stale_leases(session: Session, *, now: dt.datetime | None = None, batch: int = 1000) -> int:
    """Put jobs whose worker died holding the lease back to ``queued`` (the relay then re-sends them)."""
    now = now or utcnow()
    jobs = session.exec(
        select(Job)
        .where(Job.status == "running", Job.lease_expires_at < now)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for job in jobs:
        job.status = "queued"
        job.lease_owner = None
        job.lease_expires_at = None
        job.due_at = now
        job.enqueued_at = None
        job.updated_at = now
        session.add(job)
    return len(jobs)
