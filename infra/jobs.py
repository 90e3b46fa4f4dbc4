"""Jobs: recorded slow work, run by Celery tasks (``ARCHITECTURE.md``, the spine).

The life of a job::

    queued --lease--> running --complete--> succeeded
       ^                 |  \\--fail-----> failed      (a permanent error: recorded, not retried)
       |                 |   \\--exhaust--> dead        (transient errors past max_attempts: a dead letter)
       +--retry (due_at)-+
       +-- release_stale_leases (worker died holding the lease)

* :func:`record` writes the job in the caller's transaction and sends its task after the commit.
* :func:`lease` is an atomic update that one worker wins; the lease expires after ``lease_seconds``
  so a job whose worker died goes back to ``queued`` (``sweeps.release_stale_leases``) and the
  outbox relay sends it again.
* The job id is the provider-side idempotency key: a job run twice asks the provider twice with the
  same key and gets the same answer, so nothing is done twice.
* :func:`wait` lets an HTTP handler wait for the outcome up to a bounded time without blocking the
  event loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import uuid
from collections.abc import Awaitable, Callable

from sqlalchemy import or_, update
from sqlmodel import Session

from infra.dispatch import enqueue_after_commit
from storage.models import Job
from storage.types import utcnow

TERMINAL = ("succeeded", "failed", "dead", "cancelled")


class TransientError(Exception):
    """A failure worth retrying (timeouts, 5xx, connection errors): retried with backoff.

    ``retry_after`` (seconds) overrides the backoff when the provider asked for a delay.
    """

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class PermanentError(Exception):
    """A failure that retrying cannot fix (a decline, invalid data): recorded, not retried.

    ``code`` is a stable machine-readable code; ``status`` the HTTP status an API answer maps it to.
    """

    def __init__(self, code: str, message: str, *, status: int = 422, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.details = details or {}


def record(
    session: Session,
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    subject_id: str,
    subject_number: int | None = None,
    operation_id: str | None = None,
    trace_id: str | None,
    max_attempts: int = 5,
) -> Job:
    """Record a job in the caller's transaction; its task ``kind`` is sent with ``job_id`` on commit.

    The subject is typed, never encoded in one string: ``subject_type`` names what the job works on
    (``network_token``, ``rail``, ``payment_method``, ``account_updater_job``, ``invitation_link``,
    ``webhook``, ``network_reference``), ``subject_id`` is that resource's own id (a UUID as text, a
    ``pm_...`` id, the network's token reference), ``subject_number`` a part of it (an account updater
    chunk) and ``operation_id`` the operation lease the job belongs to (a payment method's delete).
    """
    job = Job(
        kind=kind,
        tenant_id=tenant_id,
        subject_type=subject_type,
        subject_id=str(subject_id),
        subject_number=subject_number,
        operation_id=operation_id,
        trace_id=trace_id,
        max_attempts=max_attempts,
    )
    session.add(job)
    enqueue_after_commit(session, kind, job_id=str(job.id))
    return job


def lease(session: Session, job_id: uuid.UUID, owner: str, *, lease_seconds: float) -> Job | None:
    """Take the job for ``owner`` (one worker wins); counts an attempt. None when not takeable now."""
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.status.in_(("queued", "running")),
            Job.due_at <= now + dt.timedelta(seconds=1),
            or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < now),
        )
        .values(
            status="running",
            lease_owner=owner,
            lease_expires_at=now + dt.timedelta(seconds=lease_seconds),
            attempts=Job.attempts + 1,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    return session.get(Job, job_id, populate_existing=True)


def _close(job: Job, status: str, *, error: str | None = None, result: dict | None = None) -> None:
    job.status = status
    job.lease_owner = None
    job.lease_expires_at = None
    job.updated_at = utcnow()
    if error is not None:
        job.last_error = error[:1000]
    if result is not None:
        job.result = result


def complete(session: Session, job: Job, *, result: dict | None = None) -> None:
    """Mark the job succeeded (in the transaction that writes its outcome)."""
    _close(job, "succeeded", result=result)
    session.add(job)


def fail(session: Session, job: Job, *, error: str, result: dict | None = None) -> None:
    """Mark the job failed for good (a permanent error), with its error recorded."""
    _close(job, "failed", error=error, result=result)
    session.add(job)


def backoff_seconds(attempt: int, *, base: float = 2.0, cap: float = 600.0) -> float:
    """The delay before retry number ``attempt`` (1-based): exponential with jitter, capped."""
    delay = min(cap, base * 2 ** (attempt - 1))
    return delay * random.uniform(0.8, 1.2)


def schedule_retry(
    session: Session, job: Job, *, error: str, delay: float | None = None, backoff_base: float = 2.0
) -> float | None:
    """Put the job back to ``queued`` for a later attempt, or to ``dead`` when its attempts are spent.

    Returns the delay in seconds, or None when the job became a dead letter. The job's message is
    sent after the commit as a countdown when the delay is at most a minute
    (:func:`infra.dispatch.enqueue_after_commit`); a longer delay waits as ``due_at`` for the relay.
    """
    if job.attempts >= job.max_attempts:
        _close(job, "dead", error=error)
        session.add(job)
        return None
    delay = backoff_seconds(job.attempts, base=backoff_base) if delay is None else delay
    job.status = "queued"
    job.lease_owner = None
    job.lease_expires_at = None
    job.last_error = error[:1000]
    job.due_at = utcnow() + dt.timedelta(seconds=delay)
    job.enqueued_at = None
    job.updated_at = utcnow()
    session.add(job)
    enqueue_after_commit(session, job.kind, delay=delay, job_id=str(job.id))
    return delay


def requeue(session: Session, job: Job) -> None:
    """Replay a dead or failed job: queued again now with a fresh attempt budget (sent on commit)."""
    job.status = "queued"
    job.attempts = 0
    job.due_at = utcnow()
    job.enqueued_at = None
    job.lease_owner = None
    job.lease_expires_at = None
    job.updated_at = utcnow()
    session.add(job)
    enqueue_after_commit(session, job.kind, job_id=str(job.id))


async def wait(
    read_status: Callable[[uuid.UUID], Awaitable[str | None]], job_id: uuid.UUID, *, timeout: float
) -> str | None:
    """Poll ``read_status(job_id)`` until the job is terminal or ``timeout`` seconds pass.

    Returns the last status seen. Polls start at 5 ms and back off to 250 ms, sleeping with
    ``asyncio.sleep`` so the event loop stays free.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    interval = 0.005
    status = await read_status(job_id)
    while status not in TERMINAL and loop.time() < deadline:
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))
        interval = min(0.25, interval * 1.5)
        status = await read_status(job_id)
    return status


def job_status(session: Session, job_id: uuid.UUID) -> str | None:
    """The status of a job (None when it does not exist)."""
    job = session.get(Job, job_id, populate_existing=True)
    return job.status if job else None
