"""The outbox relay: re-sending recorded work that no worker picked up (``ARCHITECTURE.md`` step 2).

Work is recorded in the database as a job (``infra/jobs.py``; a webhook delivery's work is a job
too) in the transaction that needs it, and its task is sent after the commit. If that message is lost
(the process died between commit and send, the broker lost it, a worker died holding it), the job
stays due. The relay, run by beat, finds jobs due for longer than ``TESSERA_OUTBOX_RELAY_AFTER_SECONDS``
with no live lease and sends their tasks again, marking ``enqueued_at`` so a backlog is not re-sent
on every pass: jobs of a batched kind (``infra.dispatch.BATCH_ARGUMENT``: webhook deliveries) in
messages of ``infra.dispatch.BATCH_SIZE`` ids, the others one message each. Tasks are idempotent and
lease their job, so a duplicate message does nothing twice. :func:`release_stale_leases` puts jobs
whose worker died holding the lease back to ``queued`` for the relay.

The relay idles without a backlog: beat asks :func:`relay_due` (one ``EXISTS`` query) before it sends
the ``sweeps.relay_outbox`` task and sends nothing when nothing is due (``workers/beat.py``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import exists, or_
from sqlmodel import Session, col, select

from infra.dispatch import enqueue_jobs_after_commit
from storage.models import Job
from storage.states import JobStatus
from storage.types import table_of, utcnow


def _due_where(now: dt.datetime, grace: dt.timedelta) -> tuple:
    return (
        Job.status == JobStatus.QUEUED,
        Job.due_at <= now - grace,
        or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
        or_(col(Job.enqueued_at).is_(None), col(Job.enqueued_at) < now - grace * 4),
    )


def relay_due(session: Session, *, grace_seconds: float, now: dt.datetime | None = None) -> bool:
    """Whether :func:`relay` has anything to re-send: one cheap ``EXISTS`` query over the jobs (on
    their due-time index), run by beat before it sends the relay task, so the relay idles without a
    backlog."""
    now = now or utcnow()
    grace = dt.timedelta(seconds=grace_seconds)
    return bool(session.scalar(select(exists().where(*_due_where(now, grace)))))


def stale_leases_exist(session: Session, *, now: dt.datetime | None = None) -> bool:
    """Whether :func:`release_stale_leases` has anything to release (one ``EXISTS`` query)."""
    now = now or utcnow()
    running_past_lease = exists().where(col(Job.status) == JobStatus.RUNNING, col(Job.lease_expires_at) < now)
    return bool(session.scalar(select(running_past_lease)))


def relay(session: Session, *, now: dt.datetime | None = None, grace_seconds: float, batch: int = 1000) -> int:
    """Re-send the tasks of up to ``batch`` stranded jobs (oldest due first); returns how many jobs."""
    now = now or utcnow()
    grace = dt.timedelta(seconds=grace_seconds)
    table = table_of(Job)
    rows = session.execute(
        select(table.c.id, table.c.kind)
        .where(*_due_where(now, grace))
        .order_by(table.c.due_at)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    if not rows:
        return 0
    session.execute(table.update().where(table.c.id.in_([job_id for job_id, _ in rows])).values(enqueued_at=now))
    by_kind: dict[str, list[str]] = {}
    for job_id, kind in rows:
        by_kind.setdefault(kind, []).append(str(job_id))
    for kind, ids in by_kind.items():
        enqueue_jobs_after_commit(session, kind, ids)
    return len(rows)


def release_stale_leases(session: Session, *, now: dt.datetime | None = None, batch: int = 1000) -> int:
    """Put jobs whose worker died holding the lease back to ``queued`` (the relay then re-sends them)."""
    now = now or utcnow()
    jobs = session.exec(
        select(Job)
        .where(col(Job.status) == JobStatus.RUNNING, col(Job.lease_expires_at) < now)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for job in jobs:
        job.status = JobStatus.QUEUED
        job.lease_owner = None
        job.lease_expires_at = None
        job.due_at = now
        job.enqueued_at = None
        job.updated_at = now
        session.add(job)
    return len(jobs)
