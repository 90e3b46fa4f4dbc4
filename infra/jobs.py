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
* A request waits for the outcome with :mod:`infra.wait`: settling a job publishes it after the commit.

Work that comes in many small jobs run together (webhook deliveries: a message carries about a
hundred) uses the batch forms: :func:`stage_many` writes the rows and sends their ids in batch
messages (``infra.dispatch.BATCH_ARGUMENT``), :func:`lease_many_statement` takes the due ones in one
statement (which the caller extends to read what the work needs), :func:`settle_many` and
:func:`retry_many` settle each distinct outcome with one multi-row ``UPDATE``, and
:func:`requeue_many` replays them. Nothing waits on these jobs: their outcomes are not published.
"""

from __future__ import annotations

import datetime as dt
import random
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, bindparam, or_, select, update
from sqlmodel import Session, col

from infra import wait
from infra.dispatch import enqueue_after_commit, enqueue_jobs_after_commit
from storage.db import Rows, execute_once_more_on_disconnect, get_lease_engine, rowcount, session_scope
from storage.models import Job
from storage.states import JOB_TAKEABLE, JOB_TERMINAL, JobStatus
from storage.types import table_of, utcnow

TERMINAL = JOB_TERMINAL


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


def new_row(
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    subject_id: str,
    subject_number: int | None = None,
    operation_id: str | None = None,
    trace_id: str | None,
    max_attempts: int = 5,
) -> dict[str, Any]:
    """The complete row of a new ``queued`` job (every column of :class:`storage.models.Job`, a fresh id,
    due now): what :func:`record` and :func:`stage` write.

    The subject is typed, never encoded in one string: ``subject_type`` names what the job works on
    (``network_token``, ``rail``, ``payment_method``, ``account_updater_job``, ``invitation_link``,
    ``webhook``, ``network_reference``, ``document``), ``subject_id`` is that resource's own id (a UUID as text, a
    ``pm_...`` id, the network's token reference), ``subject_number`` a part of it (an account updater
    chunk) and ``operation_id`` the operation lease the job belongs to (a payment method's delete).
    """
    now = utcnow()
    return {
        "id": uuid.uuid4(),
        "tenant_id": tenant_id,
        "kind": kind,
        "subject_type": subject_type,
        "subject_id": str(subject_id),
        "subject_number": subject_number,
        "operation_id": operation_id,
        "status": JobStatus.QUEUED,
        "attempts": 0,
        "max_attempts": max_attempts,
        "due_at": now,
        "enqueued_at": None,
        "lease_owner": None,
        "lease_expires_at": None,
        "last_error": None,
        "result": None,
        "trace_id": trace_id,
        "created_at": now,
        "updated_at": now,
    }


def record(session: Session, **fields: Any) -> Job:
    """Record a job in the caller's transaction; its task ``kind`` is sent with ``job_id`` on commit.

    ``fields``: the keyword arguments of :func:`new_row` (``kind``, ``tenant_id``, the subject,
    ``trace_id``, ``max_attempts``). Returns the job, added to ``session``.
    """
    job = Job(**new_row(**fields))
    session.add(job)
    enqueue_after_commit(session, job.kind, job_id=str(job.id))
    return job


def stage(session: Session, rows: Rows, **fields: Any) -> uuid.UUID:
    """:func:`record` without an ORM object, for hot paths that write their rows in one statement:
    the job row (:func:`new_row` of ``fields``) is queued in ``rows`` for :func:`storage.db.stage_rows`
    / :func:`storage.db.insert_rows` in ``session``'s transaction, and its task is sent with ``job_id``
    when that transaction commits. Returns the job id. The caller must write ``rows`` before the
    commit (a message for a job never written is skipped by the worker: nothing is leased)."""
    row = new_row(**fields)
    rows.add(table_of(Job), row)
    enqueue_after_commit(session, row["kind"], job_id=str(row["id"]))
    return row["id"]


def _lease_statement(job_id: uuid.UUID, owner: str, lease_seconds: float):
    """The UPDATE taking job ``job_id`` for ``owner`` when it is takeable now (counts an attempt)."""
    now = utcnow()
    return _takeable_update(
        col(Job.id) == job_id, now, now + dt.timedelta(seconds=1), owner, now + dt.timedelta(seconds=lease_seconds)
    )


def _takeable_update(which: ColumnElement, now, due_by, owner, expires):
    """``UPDATE jobs`` taking the rows ``which`` selects that are takeable at ``now`` (queued or
    running, due by ``due_by``, no live lease) for ``owner`` until ``expires``; counts an attempt.
    The values may be literals or bind parameters."""
    return (
        update(Job)
        .where(
            which,
            col(Job.status).in_(JOB_TAKEABLE),
            Job.due_at <= due_by,
            or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
        )
        .values(
            status=JobStatus.RUNNING,
            lease_owner=owner,
            lease_expires_at=expires,
            attempts=Job.attempts + 1,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )


def lease(session: Session, job_id: uuid.UUID, owner: str, *, lease_seconds: float) -> Job | None:
    """Take the job for ``owner`` (one worker wins); counts an attempt. None when not takeable now."""
    result = session.execute(_lease_statement(job_id, owner, lease_seconds))
    if rowcount(result) != 1:
        return None
    return session.get(Job, job_id, populate_existing=True)


class PreparedLease:
    """The lease-and-read statement of one set of ``reads`` (see :func:`lease_and_read`), built once
    with bind parameters: a task keeps one per process, so a run neither builds the SQL tree nor
    computes its cache key again."""

    __slots__ = ("labels", "statement")

    def __init__(self, reads: Mapping[str, ColumnElement] | None = None):
        reads = dict(reads or {})
        self.labels = {name: f"read_{index}" for index, name in enumerate(reads)}  # never a job column's name
        labelled = [expression.label(self.labels[name]) for name, expression in reads.items()]
        now = bindparam("lease_now", type_=table_of(Job).c.updated_at.type)
        self.statement = _takeable_update(
            col(Job.id) == bindparam("lease_job_id", type_=table_of(Job).c.id.type),
            now,
            bindparam("lease_due_by", type_=table_of(Job).c.due_at.type),
            bindparam("lease_owner_name", type_=table_of(Job).c.lease_owner.type),
            bindparam("lease_expires", type_=table_of(Job).c.lease_expires_at.type),
        ).returning(*table_of(Job).columns, *labelled)

    def params(self, job_id: uuid.UUID, owner: str, lease_seconds: float) -> dict[str, Any]:
        """The bind values taking ``job_id`` for ``owner`` now, for ``lease_seconds``."""
        now = utcnow()
        return {
            "lease_job_id": job_id,
            "lease_now": now,
            "lease_due_by": now + dt.timedelta(seconds=1),
            "lease_owner_name": owner,
            "lease_expires": now + dt.timedelta(seconds=lease_seconds),
        }


def lease_and_read(
    job_id: uuid.UUID,
    owner: str,
    *,
    lease_seconds: float,
    reads: Mapping[str, ColumnElement] | None = None,
    prepared: PreparedLease | None = None,
) -> tuple[Job, dict[str, Any]] | None:
    """Take the job for ``owner`` like :func:`lease` and read, in the same statement, what its work
    needs: ``reads`` maps names to scalar SQL expressions over the job row (correlated subqueries);
    ``prepared``, when given, is the :class:`PreparedLease` of those reads (built once, reused).

    Returns the detached job and ``{name: value}``; None when the job is not takeable now. On
    PostgreSQL this is one ``UPDATE ... RETURNING`` committed without waiting for the WAL flush (a
    lease lost in a database crash only means the job is taken again, with the same idempotency
    key); elsewhere :func:`lease` and a SELECT in one transaction.
    """
    reads = dict(reads or {})
    engine = get_lease_engine()
    if engine is not None:
        prepared = prepared or PreparedLease(reads)
        row = execute_once_more_on_disconnect(engine, prepared.statement, prepared.params(job_id, owner, lease_seconds))
        if row is None:
            return None
        job = Job.model_validate({column.name: row[column] for column in table_of(Job).columns})
        return job, {name: row[label] for name, label in prepared.labels.items()}
    labels = {name: f"read_{index}" for index, name in enumerate(reads)}
    labelled = [expression.label(labels[name]) for name, expression in reads.items()]
    with session_scope() as session:
        taken = lease(session, job_id, owner, lease_seconds=lease_seconds)
        if taken is None:
            return None
        values = session.execute(select(*labelled).where(col(Job.id) == job_id)).mappings().one() if labelled else {}
        session.expunge(taken)
    return taken, {name: values[labels[name]] for name in reads}


def _close(
    session: Session, job: Job, status: JobStatus, *, error: str | None = None, result: dict | None = None
) -> None:
    """Settle the job; its outcome is published to a waiting request once the transaction commits."""
    job.status = status
    job.lease_owner = None
    job.lease_expires_at = None
    job.updated_at = utcnow()
    if error is not None:
        job.last_error = error[:1000]
    if result is not None:
        job.result = result
    session.add(job)
    wait.announce_on_commit(session, job.id, status, job.result)


def complete(session: Session, job: Job, *, result: dict | None = None) -> None:
    """Mark the job succeeded (in the transaction that writes its outcome)."""
    _close(session, job, JobStatus.SUCCEEDED, result=result)


def fail(session: Session, job: Job, *, error: str, result: dict | None = None) -> None:
    """Mark the job failed for good (a permanent error), with its error recorded."""
    _close(session, job, JobStatus.FAILED, error=error, result=result)


_JOBS = table_of(Job)
#: Prepared once (bind parameters): a worker neither builds these SQL trees nor their cache keys per job.
_LOCK_LEASED = select(_JOBS.c.id).where(_JOBS.c.id == bindparam("job_id", type_=_JOBS.c.id.type)).with_for_update()
_COMPLETE_LEASED = {
    with_result: update(_JOBS)
    .where(_JOBS.c.id == bindparam("job_id", type_=_JOBS.c.id.type))
    .values(
        status=JobStatus.SUCCEEDED,
        lease_owner=None,
        lease_expires_at=None,
        updated_at=bindparam("now", type_=_JOBS.c.updated_at.type),
        **({"result": bindparam("result", type_=_JOBS.c.result.type)} if with_result else {}),
    )
    for with_result in (False, True)
}


def lock_leased(session: Session, job_id: uuid.UUID) -> None:
    """Lock job ``job_id``'s row for the rest of ``session``'s transaction (``SELECT ... FOR UPDATE``
    of its id only, no ORM object): the first lock of a transaction writing the outcome of a job
    this worker leased (the lock order: the job row, then what the job works on)."""
    session.execute(_LOCK_LEASED, {"job_id": job_id})


def complete_leased(session: Session, job: Job, *, result: dict | None = None) -> None:
    """:func:`complete` for a job that is not in ``session`` (the detached job of
    :func:`lease_and_read`, its row locked by :func:`lock_leased`): one ``UPDATE`` without ORM
    objects; ``job`` gets the same values; the outcome is published once the transaction commits."""
    now = utcnow()
    params: dict[str, Any] = {"job_id": job.id, "now": now}
    if result is not None:
        params["result"] = result
    session.execute(_COMPLETE_LEASED[result is not None], params)
    job.status, job.lease_owner, job.lease_expires_at, job.updated_at = JobStatus.SUCCEEDED, None, None, now
    if result is not None:
        job.result = result
    wait.announce_on_commit(session, job.id, job.status, job.result)


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
        _close(session, job, JobStatus.DEAD, error=error)
        return None
    delay = backoff_seconds(job.attempts, base=backoff_base) if delay is None else delay
    job.status = JobStatus.QUEUED
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
    job.status = JobStatus.QUEUED
    job.attempts = 0
    job.due_at = utcnow()
    job.enqueued_at = None
    job.lease_owner = None
    job.lease_expires_at = None
    job.updated_at = utcnow()
    session.add(job)
    enqueue_after_commit(session, job.kind, job_id=str(job.id))


def cancel_if_queued(session: Session, job_id: uuid.UUID) -> None:
    """Cancel a job nobody took yet (its waiting request gave up); a running job runs to its end."""
    session.execute(
        update(Job)
        .where(col(Job.id) == job_id, col(Job.status) == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )


# ---- batch forms ---------------------------------------------------------------------------------


def stage_many(
    session: Session,
    rows: Rows,
    jobs: list[tuple[uuid.UUID, str]],
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    trace_id: str | None,
    max_attempts: int,
    now: dt.datetime | None = None,
) -> None:
    """:func:`stage` for many jobs of one kind and tenant: ``jobs`` is ``[(job id, subject id)]``; one
    ``queued`` row each (as :func:`new_row`, with the given ids, due ``now``) is queued in ``rows``
    (the caller writes them before the commit, before rows that reference them), and their task is
    sent when ``session`` commits (:func:`infra.dispatch.enqueue_jobs_after_commit`: batch messages
    for a batched kind)."""
    if not jobs:
        return
    now = now or utcnow()
    for job_id, subject_id in jobs:
        row = new_row(
            kind=kind,
            tenant_id=tenant_id,
            subject_type=subject_type,
            subject_id=subject_id,
            trace_id=trace_id,
            max_attempts=max_attempts,
        )
        row.update(id=job_id, due_at=now, created_at=now, updated_at=now)
        rows.add(table_of(Job), row)
    enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id, _ in jobs])


def lease_many_statement(job_ids: list[uuid.UUID], owner: str, *, lease_seconds: float, now: dt.datetime | None = None):
    """The ``UPDATE`` taking, for ``owner``, every job of ``job_ids`` that is takeable now (as
    :func:`lease`, one statement: a duplicate message or a second worker gets none of them; counts an
    attempt each). The caller runs it, and may extend it first: ``.where()`` over other tables (an
    ``UPDATE ... FROM`` on PostgreSQL) and ``.returning()`` of what the work needs."""
    now = now or utcnow()
    return _takeable_update(
        col(Job.id).in_(job_ids), now, now + dt.timedelta(seconds=1), owner, now + dt.timedelta(seconds=lease_seconds)
    )


def settle_many(
    session: Session, job_ids: list[uuid.UUID], status: str, *, error: str | None = None, now: dt.datetime | None = None
) -> None:
    """Close the jobs ``job_ids`` as ``status`` (``succeeded``, ``failed`` for a permanent error,
    ``dead`` when their attempts are spent) with one ``UPDATE``, their lease released and ``error``
    (when given) recorded. Raises ValueError for another status."""
    if status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DEAD):
        raise ValueError(f"a job is not settled as {status}")
    if not job_ids:
        return
    now = now or utcnow()
    values: dict[str, Any] = {"status": status, "lease_owner": None, "lease_expires_at": None, "updated_at": now}
    if error is not None:
        values["last_error"] = error[:1000]
    session.execute(
        update(Job).where(col(Job.id).in_(job_ids)).values(**values).execution_options(synchronize_session=False)
    )


def retry_many(
    session: Session, kind: str, job_ids: list[uuid.UUID], *, delay: float, error: str, now: dt.datetime | None = None
) -> None:
    """Put the jobs ``job_ids`` of ``kind`` back to ``queued``, due in ``delay`` seconds, with one
    ``UPDATE`` (lease released, ``error`` recorded); their task is sent after the commit as a
    countdown when the delay is at most a minute, else the relay sends it when it is due
    (:func:`infra.dispatch.enqueue_jobs_after_commit`)."""
    if not job_ids:
        return
    now = now or utcnow()
    session.execute(
        update(Job)
        .where(col(Job.id).in_(job_ids))
        .values(
            status=JobStatus.QUEUED,
            lease_owner=None,
            lease_expires_at=None,
            last_error=error[:1000],
            due_at=now + dt.timedelta(seconds=delay),
            enqueued_at=None,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id in job_ids], delay=delay)


def requeue_many(
    session: Session, kind: str, job_ids: list[uuid.UUID], *, fresh_budget: bool, now: dt.datetime | None = None
) -> int:
    """Queue the jobs ``job_ids`` of ``kind`` again, due now, with one ``UPDATE`` and send their task
    when ``session`` commits: a settled job (a replay: ``fresh_budget`` gives it its attempts again,
    as :func:`requeue`) or a waiting one (due now). A job a worker holds a live lease on is left to
    that worker. Returns how many jobs were queued again."""
    if not job_ids:
        return 0
    now = now or utcnow()
    values: dict[str, Any] = {
        "status": JobStatus.QUEUED,
        "due_at": now,
        "enqueued_at": None,
        "lease_owner": None,
        "lease_expires_at": None,
        "updated_at": now,
    }
    if fresh_budget:
        values["attempts"] = 0
    count = rowcount(
        session.execute(
            update(Job)
            .where(col(Job.id).in_(job_ids), or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now))
            .values(**values)
            .execution_options(synchronize_session=False)
        )
    )
    enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id in job_ids])
    return count
