"""Jobs: recorded slow work, run by Celery tasks (``ARCHITECTURE.md``, the spine).

The life of a job::

    queued --lease--> running --settle--> succeeded
       ^                 |  \\--settle---> failed      (a permanent error: recorded, not retried)
       |                 |   \\--retry----> dead        (transient errors past max_attempts: a dead letter)
       +--retry (due_at)-+
       +-- release_stale_leases (worker died holding the lease)

One verb per step, each taking one job or many and choosing its own fast path:

* :func:`record` writes the job in the caller's transaction (into the caller's rows, the group's
  staged rows, or the session) and sends its task after the commit;
* :func:`lease` is an atomic update that one worker wins, reading what the work needs in the same
  statement; the lease expires after ``lease_seconds`` so a job whose worker died goes back to
  ``queued`` (``sweeps.release_stale_leases``) and the outbox relay sends it again; :func:`lock`
  locks a leased job's row first in the transaction that writes its outcome;
* :func:`settle` closes it (``succeeded``, ``failed``, ``dead``), :func:`retry` queues it for a later
  attempt (or makes it a dead letter), :func:`requeue` replays it, :func:`cancel_if_queued` drops it,
  :func:`hand_back` gives back a job leased but not started (fairness between tenants,
  :mod:`infra.fairness`).

The job id is the provider-side idempotency key: a job run twice asks the provider twice with the same
key and gets the same answer, so nothing is done twice. A request waits for one job's outcome with
:mod:`infra.wait`: settling a job publishes it after the commit. Work that comes in many small jobs run
together (webhook deliveries: a message carries about a hundred ids, ``infra.dispatch.BATCH_ARGUMENT``)
passes lists of ids: one statement per step for the whole batch, and nothing waits on those outcomes.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from sqlalchemy import (
    ARRAY,
    CTE,
    ColumnElement,
    Date,
    FromClause,
    String,
    Update,
    any_,
    bindparam,
    cast,
    exists,
    literal,
    or_,
    select,
    update,
)
from sqlmodel import Session, col

from infra import wait
from infra.dispatch import enqueue_jobs_after_commit
from storage.db import (
    Rows,
    execute_durable,
    execute_durable_together,
    execute_once_more_on_disconnect,
    gate_wait,
    get_autocommit_engine,
    is_staging,
    one_statement_transactions,
    row_instance,
    rowcount,
    server_prepared,
    session_scope,
    stage_rows,
    stage_write,
)
from storage.models import Job
from storage.states import JOB_TAKEABLE, JOB_TERMINAL, JobStatus
from storage.types import table_of, utcnow

log = logging.getLogger("tessera.jobs")

TERMINAL = JOB_TERMINAL
_JOBS = table_of(Job)


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
    subject_id: str | uuid.UUID | int,
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


@overload
def record(
    session: Session,
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    subject_id: str | uuid.UUID | int,
    trace_id: str | None,
    subject_number: int | None = None,
    operation_id: str | None = None,
    max_attempts: int = 5,
    rows: Rows | None = None,
    together: bool = False,
    gated: bool = False,
) -> Job: ...


@overload
def record(
    session: Session,
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    subjects: Sequence[tuple[uuid.UUID, str]],
    trace_id: str | None,
    max_attempts: int = 5,
    rows: Rows,
    now: dt.datetime | None = None,
    together: bool = False,
    gated: bool = False,
) -> list[uuid.UUID]: ...


def record(
    session: Session,
    *,
    kind: str,
    tenant_id: uuid.UUID | None,
    subject_type: str,
    trace_id: str | None,
    subject_id: str | uuid.UUID | int | None = None,
    subjects: Sequence[tuple[uuid.UUID, str]] | None = None,
    subject_number: int | None = None,
    operation_id: str | None = None,
    max_attempts: int = 5,
    rows: Rows | None = None,
    now: dt.datetime | None = None,
    together: bool = False,
    gated: bool = False,
) -> Job | list[uuid.UUID]:
    """Record work in the caller's transaction: one ``queued`` job per subject, its task ``kind`` sent
    with the job's id once the transaction commits (batch messages for a batched kind,
    :data:`infra.dispatch.BATCH_ARGUMENT`; ``together``: one message for every job of ``kind`` the
    transaction records together, run side by side, ``infra.task.JobTask.run``; ``gated``: sent just
    before the commit, for a task that leases its job with :func:`lease` or :func:`lease_together`,
    whose statement waits for the commit, see ``infra.dispatch.enqueue_jobs_after_commit``: a request
    that waits for the job's outcome).

    One job (``subject_id``; the fields are those of :func:`new_row`) returns the :class:`Job`. Many
    (``subjects``: ``[(job id, subject id)]``, all due ``now``) return their ids. Where the row goes is
    chosen from what the caller's unit of work carries:

    * ``rows`` given: queued there without an ORM object, for a caller that writes its rows in one
      statement (:func:`storage.db.stage_rows` / :func:`storage.db.insert_rows`) before the commit, the
      job rows before the rows that reference them (a message for a job never written is skipped: the
      worker leases nothing); the returned job is a description, not in ``session``;
    * ``session`` runs a group of units of work (:class:`storage.db.GroupCommit`): staged with the
      group's rows, written in one statement before its commit (invisible to reads until then);
    * otherwise added to ``session`` as an ORM object (written at its next flush).

    Raises ValueError when neither or both of ``subject_id`` and ``subjects`` are given, or ``subjects``
    without ``rows``.
    """
    if (subject_id is None) == (subjects is None):
        raise ValueError("record takes one subject_id or a list of subjects")
    common: dict[str, Any] = {
        "kind": kind,
        "tenant_id": tenant_id,
        "subject_type": subject_type,
        "trace_id": trace_id,
        "max_attempts": max_attempts,
    }
    if subjects is not None:
        if rows is None:
            raise ValueError("many jobs are recorded into the caller's rows")
        now = now or utcnow()
        ids = []
        for job_id, subject in subjects:
            row = new_row(subject_id=subject, **common)
            row.update(id=job_id, due_at=now, created_at=now, updated_at=now)
            rows.add(_JOBS, row)
            ids.append(job_id)
        enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id in ids], together=together, gated=gated)
        return ids
    assert subject_id is not None  # checked above: exactly one of subject_id and subjects
    row = new_row(subject_id=subject_id, subject_number=subject_number, operation_id=operation_id, **common)
    if rows is None and not is_staging(session):
        job = Job(**row)
        session.add(job)
    else:
        if rows is not None:
            rows.add(_JOBS, row)
        else:  # with the group's rows, in one statement before its commit
            staged = Rows()
            staged.add(_JOBS, row)
            stage_rows(session, staged)
        job = row_instance(Job, row)
    enqueue_jobs_after_commit(session, kind, [str(job.id)], together=together, gated=gated)
    return job


#: The takeable statuses as the lease's own bound values, never literals (:func:`_takeable_update`).
_TAKEABLE_BOUND = [
    bindparam(f"takeable_status_{index}", status, type_=_JOBS.c.status.type)
    for index, status in enumerate(JOB_TAKEABLE)
]


def _takeable_update(which: ColumnElement, now, due_by, owner, expires):
    """``UPDATE jobs`` taking the rows ``which`` selects (always by id) that are takeable at ``now``
    (queued or running, due by ``due_by``, no live lease) for ``owner`` until ``expires``; counts an
    attempt. The values may be literals or bind parameters.

    The takeable statuses are bound, not written as literals (:func:`storage.db.in_constants`): with
    literals the planner can prove the predicate of the partial index ``ix_jobs_takeable``, and a
    generic plan made while few jobs waited (the statistics of the last ``ANALYZE``) reads the job
    through that index, walking every takeable job due by now to find the one id: 3.4 ms a lease
    behind 20,000 queued webhook deliveries instead of 0.06 ms through the primary key, and so slower
    with every job of a backlog. Bound, the primary key is the only index the lookup can use. The
    probes of other tenants' waiting jobs (:func:`infra.fairness.others_wait`) keep their literals:
    they look for takeable jobs, which is what that index holds."""
    return (
        update(Job)
        .where(
            which,
            col(Job.status).in_(_TAKEABLE_BOUND),
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


#: The time of a lease, a bind parameter its statement's reads may use (:func:`lease` binds it).
LEASE_NOW = bindparam("lease_now", type_=_JOBS.c.updated_at.type)
#: The calendar month (UTC) of that time, as its first day: a bind parameter reads may use as well.
LEASE_MONTH = bindparam("lease_month", type_=Date())


def _moment(now: dt.datetime) -> dict[str, Any]:
    """The values of :data:`LEASE_NOW` and :data:`LEASE_MONTH` for a lease taken at ``now`` (UTC)."""
    return {LEASE_NOW.key: now, LEASE_MONTH.key: dt.date(now.year, now.month, 1)}


@dataclass(frozen=True, eq=False)
class LeaseReads:
    """What a lease statement (:func:`lease`) reads beside the job row, from tables joined to it.

    ``columns``: name -> SQL expression over the job row (``jobs``) and the tables of ``joins`` (a
    scalar subquery correlated to the job row does as well); ``perform`` gets their values under these
    names. ``joins``: ``(table, ON clause)`` pairs, each outer-joined in turn to the job row and the
    tables before it, so that a row a join does not find reads as NULLs (the job is leased all the
    same: its work decides what a missing row means). A joined table is looked up once per job,
    where a scalar subquery per name looks the same row up again for each name it reads (a rail's
    lease read its rail five times and its payment method eight). Kept by identity
    (:func:`_kept`): build it once per process."""

    columns: Mapping[str, ColumnElement[Any]]
    joins: tuple[tuple[FromClause, ColumnElement[bool]], ...] = ()

    def with_columns(self, **more: ColumnElement[Any]) -> LeaseReads:
        """These reads and ``more`` (the same joins)."""
        return LeaseReads({**self.columns, **more}, self.joins)

    def source(self, job: FromClause) -> FromClause:
        """``job`` (the job row's table, or what holds it) with every table of :attr:`joins` outer-joined."""
        joined = job
        for table, on in self.joins:
            joined = joined.outerjoin(table, on)
        return joined


#: What a lease reads: the names' SQL expressions (scalar, over the job row), or :class:`LeaseReads`.
Reads = Mapping[str, ColumnElement[Any]] | LeaseReads


def lease_reads_of(reads: Reads | None) -> LeaseReads:
    """``reads`` as :class:`LeaseReads` (a mapping: its columns, no join)."""
    if isinstance(reads, LeaseReads):
        return reads
    return LeaseReads(dict(reads or {}))


class _PreparedLease:
    """The lease-and-read statement of one set of ``reads``, built once with bind parameters: neither
    the SQL tree nor its cache key is computed again per job. ``many``: the statement takes a list of
    jobs (``id = ANY(...)``, PostgreSQL only), not one.

    Without joins, one ``UPDATE jobs ... RETURNING`` the job's columns and the reads. With joins
    (:class:`LeaseReads`), the same ``UPDATE`` in a CTE returning the taken rows, and a ``SELECT`` of
    those rows, each joined by its id to its ``jobs`` row (the snapshot's: only its unchanged columns
    are used, as join keys) and from there to the joined tables: still one statement and one round
    trip. Either way a row's values are found under the job columns' names and :attr:`labels`."""

    __slots__ = ("labels", "reads", "statement")

    def __init__(self, reads: Reads, *, many: bool = False):
        self.reads = lease_reads_of(reads)
        # never a job column's name
        self.labels = {name: f"read_{index}" for index, name in enumerate(self.reads.columns)}
        labelled = [expression.label(self.labels[name]) for name, expression in self.reads.columns.items()]
        which = (
            col(Job.id) == any_(cast(bindparam("lease_job_ids", type_=String()), ARRAY(_JOBS.c.id.type)))
            if many
            else col(Job.id) == bindparam("lease_job_id", type_=_JOBS.c.id.type)
        )
        taking = _takeable_update(
            which,
            LEASE_NOW,
            bindparam("lease_due_by", type_=_JOBS.c.due_at.type),
            bindparam("lease_owner_name", type_=_JOBS.c.lease_owner.type),
            bindparam("lease_expires", type_=_JOBS.c.lease_expires_at.type),
        )
        if not self.reads.joins:
            self.statement: Any = server_prepared(taking.returning(*_JOBS.columns, *labelled))
            return
        taken = taking.returning(*_JOBS.columns).cte("taken")
        self.statement = server_prepared(
            select(*(taken.c[column.name].label(column.name) for column in _JOBS.columns), *labelled).select_from(
                self.reads.source(taken.join(_JOBS, _JOBS.c.id == taken.c.id))
            )
        )

    def taken(self, row: Mapping[str, Any]) -> tuple[Job, dict[str, Any]]:
        """The detached job and ``{name: value}`` of the reads, from a row of :attr:`statement`."""
        job = row_instance(Job, {column.name: row[column.name] for column in _JOBS.columns})
        return job, {name: row[label] for name, label in self.labels.items()}

    def params(self, job_ids: uuid.UUID | Sequence[uuid.UUID], owner: str, lease_seconds: float) -> dict[str, Any]:
        """The bind values taking ``job_ids`` (one id, or a list for a statement built ``many``) for ``owner`` now,
        for ``lease_seconds``; a list travels as one array literal (``{id,id}``), so the statement's
        text is the same whatever its length."""
        now = utcnow()
        taken = (
            {"lease_job_id": job_ids}
            if isinstance(job_ids, uuid.UUID)
            else {"lease_job_ids": "{" + ",".join(str(job_id) for job_id in job_ids) + "}"}
        )
        return {
            **_moment(now),
            **taken,
            "lease_due_by": now + dt.timedelta(seconds=1),
            "lease_owner_name": owner,
            "lease_expires": now + dt.timedelta(seconds=lease_seconds),
        }


_P = TypeVar("_P")


def _kept(cache: dict[int, tuple[object, _P]], source: object, build: Callable[[], _P]) -> _P:
    """What ``build()`` makes of ``source``, kept in ``cache`` per ``source`` object (by identity: a
    task builds its reads and its outcome's write once per process, so a run reuses their
    statements); bounded, and built again when an object is new."""
    kept = cache.get(id(source))
    if kept is None or kept[0] is not source:
        if len(cache) >= 256:
            cache.clear()
        kept = cache[id(source)] = (source, build())
    return kept[1]


#: The prepared lease of each ``reads`` object a caller keeps (:func:`_kept`).
_PREPARED: dict[int, tuple[object, _PreparedLease]] = {}
_NO_READS: Mapping[str, ColumnElement] = {}


#: The same for the statement taking a list of jobs (:func:`lease_together`).
_PREPARED_MANY: dict[int, tuple[object, _PreparedLease]] = {}


def _prepared(reads: Reads, *, many: bool = False) -> _PreparedLease:
    if many:
        return _kept(_PREPARED_MANY, reads, lambda: _PreparedLease(reads, many=True))
    return _kept(_PREPARED, reads, lambda: _PreparedLease(reads))


@overload
def lease(
    job_ids: uuid.UUID,
    owner: str,
    *,
    lease_seconds: float,
    reads: Reads | None = None,
    session: Session | None = None,
) -> tuple[Job, dict[str, Any]] | None: ...


@overload
def lease(
    job_ids: Sequence[uuid.UUID], owner: str, *, lease_seconds: float, now: dt.datetime | None = None
) -> Update: ...


def lease(
    job_ids: uuid.UUID | Sequence[uuid.UUID],
    owner: str,
    *,
    lease_seconds: float,
    reads: Reads | None = None,
    now: dt.datetime | None = None,
    session: Session | None = None,
) -> tuple[Job, dict[str, Any]] | Update | None:
    """Take jobs for ``owner`` when they are takeable now (queued or running, due, no live lease): one
    worker wins, a duplicate message or a second worker gets nothing; counts an attempt each; the
    lease expires after ``lease_seconds`` (then ``sweeps.release_stale_leases`` queues the job again).

    One job (``job_ids`` a UUID): taken and read in its own short transaction; ``reads`` maps names
    to scalar SQL expressions over the job row (correlated subqueries) that the work needs, or is a
    :class:`LeaseReads` (expressions over tables joined to the job row). Returns the detached job
    and ``{name: value}``, or None when the job is not takeable now. On PostgreSQL one prepared
    statement (:class:`_PreparedLease`, built once per ``reads`` object and reused; committed
    without waiting for the WAL flush: a lease lost in a database crash only means the job is taken
    again, with the same idempotency key; it runs behind the job's gate, :func:`storage.db.gate_wait`,
    so a message sent before the commit that recorded the job, ``record(gated=True)``, is leased once
    that commit is done); elsewhere an ``UPDATE`` and a ``SELECT`` in one transaction.
    Given a ``session``, the job is taken in that session's transaction instead (it may be a job that
    transaction recorded) and returned loaded in it.

    Many jobs (a list of ids): returns the one ``UPDATE`` taking every takeable job of the list, for
    the caller to extend with what its work reads (``.where()`` over other tables, an ``UPDATE ...
    FROM`` on PostgreSQL, and ``.returning()``) and run in its session.
    """
    if not isinstance(job_ids, uuid.UUID):
        now = now or utcnow()
        return _takeable_update(
            col(Job.id).in_(list(job_ids)),
            now,
            now + dt.timedelta(seconds=1),
            owner,
            now + dt.timedelta(seconds=lease_seconds),
        )
    job_id = job_ids
    prepared = _prepared(reads if reads is not None else _NO_READS)
    if session is not None:
        return _lease_in(session, job_id, owner, lease_seconds, prepared)
    engine = get_autocommit_engine()
    if engine is not None:
        row = execute_once_more_on_disconnect(
            engine,
            prepared.statement,
            prepared.params(job_id, owner, lease_seconds),
            after=gate_wait(job_id),
            unflushed=True,  # lost in a crash, the job is taken again
        )
        return None if row is None else prepared.taken(row)
    with session_scope() as own:
        leased = _lease_in(own, job_id, owner, lease_seconds, prepared)
        if leased is not None:
            own.expunge(leased[0])
    return leased


def _lease_in(
    session: Session, job_id: uuid.UUID, owner: str, lease_seconds: float, prepared: _PreparedLease
) -> tuple[Job, dict[str, Any]] | None:
    """:func:`lease` of one job in ``session``'s transaction: an ``UPDATE``, then the job and its reads."""
    now = utcnow()
    statement = _takeable_update(
        col(Job.id) == job_id, now, now + dt.timedelta(seconds=1), owner, now + dt.timedelta(seconds=lease_seconds)
    )
    if rowcount(session.execute(statement)) != 1:
        return None
    taken = session.get(Job, job_id, populate_existing=True)
    if taken is None:
        return None
    reads = prepared.reads
    labelled = [expression.label(prepared.labels[name]) for name, expression in reads.columns.items()]
    if not labelled:
        return taken, {}
    values = (
        session.execute(select(*labelled).select_from(reads.source(_JOBS)).where(col(Job.id) == job_id), _moment(now))
        .mappings()
        .one()
    )
    return taken, {name: values[label] for name, label in prepared.labels.items()}


def lease_together(
    job_ids: Sequence[uuid.UUID], owner: str, *, lease_seconds: float, reads: Reads | None = None
) -> dict[uuid.UUID, tuple[Job, dict[str, Any]]]:
    """:func:`lease` of several jobs of one kind at once (the jobs a transaction recorded together,
    e.g. a payment method's rails, which one message names): the takeable ones are taken for
    ``owner`` and each read with ``reads``, as :func:`lease` takes one. Returns job id -> (the
    detached job, ``{name: value}``) for the jobs taken; the others are absent (a duplicate message,
    another worker's lease, not due yet). On PostgreSQL one prepared ``UPDATE ... WHERE id =
    ANY(...) RETURNING`` (one round trip for all, committed as :func:`lease` commits); elsewhere one
    :func:`lease` per job."""
    kept = reads if reads is not None else _NO_READS
    engine = get_autocommit_engine()
    if engine is None:
        taken = ((job_id, lease(job_id, owner, lease_seconds=lease_seconds, reads=kept)) for job_id in job_ids)
        return {job_id: leased for job_id, leased in taken if leased is not None}
    prepared = _prepared(kept, many=True)
    rows = execute_once_more_on_disconnect(
        engine,
        prepared.statement,
        prepared.params(job_ids, owner, lease_seconds),
        every_row=True,
        after=gate_wait(job_ids[0]) if job_ids else None,
        unflushed=True,
    )
    return {row["id"]: prepared.taken(row) for row in rows}


#: Prepared once (bind parameters): a worker neither builds these SQL trees nor their cache keys per job.
_LOCK = select(_JOBS.c.id).where(_JOBS.c.id == bindparam("job_id", type_=_JOBS.c.id.type)).with_for_update()


def lock(session: Session, job_id: uuid.UUID) -> None:
    """Lock job ``job_id``'s row for the rest of ``session``'s transaction (``SELECT ... FOR UPDATE``
    of its id only, no ORM object): the first lock of a transaction writing the outcome of a job
    this worker leased (the lock order: the job row, then what the job works on)."""
    session.execute(_LOCK, {"job_id": job_id})


_SETTLED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DEAD)


def settle(
    session: Session,
    jobs: Job | Sequence[uuid.UUID],
    status: JobStatus,
    *,
    error: str | None = None,
    result: dict | None = None,
    now: dt.datetime | None = None,
) -> None:
    """Close jobs as ``status``: ``succeeded``, ``failed`` (a permanent error, not retried) or ``dead``
    (attempts spent: a dead letter, which :func:`requeue` replays); the lease released, ``error``
    (first 1,000 characters) and ``result`` recorded when given. Raises ValueError for another status.

    One job (a :class:`Job`): its outcome is published to a waiting request once the transaction
    commits (:mod:`infra.wait`). A job in ``session`` (ORM-loaded) is changed in place; a detached job
    (as :func:`lease` returns it, its row locked by :func:`lock`) is settled by one ``UPDATE`` without
    ORM objects, queued to go out with the transaction's other queued writes just before it commits
    (:func:`storage.db.stage_write`: the outcome of a job in one statement), and gets the same values.
    Many jobs (a list of ids): one multi-row ``UPDATE``; nothing waits on them, so nothing is published.
    """
    values = _settled(status, error=error, result=result, now=now or utcnow())
    if not isinstance(jobs, Job):
        if jobs:
            session.execute(
                update(Job)
                .where(col(Job.id).in_(list(jobs)))
                .values(**values)
                .execution_options(synchronize_session=False)
            )
        return
    job = jobs
    if job in session:
        for name, value in values.items():
            setattr(job, name, value)
        session.add(job)
    else:
        stage_write(session, update(_JOBS).where(_JOBS.c.id == job.id).values(values))
        for name, value in values.items():
            setattr(job, name, value)
    wait.announce_on_commit(session, job.id, status, job.result)


def _settled(status: JobStatus, *, error: str | None, result: dict | None, now: dt.datetime) -> dict[str, Any]:
    """The column values of a job settled as ``status`` (ValueError for a status that does not settle)."""
    if status not in _SETTLED:
        raise ValueError(f"a job is not settled as {status}")
    values: dict[str, Any] = {"status": status, "lease_owner": None, "lease_expires_at": None, "updated_at": now}
    if error is not None:
        values["last_error"] = error[:1000]
    if result is not None:
        values["result"] = result
    return values


@dataclass(frozen=True)
class OutcomeWrite:
    """The whole outcome of a leased job as one write (:func:`settle_with`): ``statement`` (None for a
    write whose :attr:`joint` makes its statement), an ``UPDATE`` without ``RETURNING`` that changes a
    row when the outcome applies, built once per process with bind parameters (the same object every
    time: its one-statement form is built and compiled once), ``params`` the values of those parameters,
    and ``result``, the job's result then. ``answer`` (optional): what the waiting request answers from,
    published with the outcome but not stored (:mod:`infra.wait`; JSON values: ids, states, the
    provider's non-secret details, values sealed with the tenant's key; never a plain card number, a key
    or a secret). ``answer_from`` (optional, instead of ``answer``) builds it from what the write wrote:
    ``returning`` names what ``statement`` returns (labelled columns of the row it changes, the same
    tuple every time for the same statement), and ``answer_from`` gets those values by label
    (``{label: value}``); None from it publishes no answer. (``statement`` itself has no ``RETURNING``: one added
    here would be lost, as a copy of an ``Update`` keeps the columns its original had computed.) The
    parameter names ``outcome_job_id``, ``outcome_status``, ``outcome_result`` and ``outcome_at`` are
    :func:`settle_with`'s own (:data:`OUTCOME_JOB_ID` is the first).

    An outcome that changes several rows gives the others as CTEs of ``statement`` (``Update.add_cte``,
    or referenced from its ``WHERE``): they are hoisted into the one statement's ``WITH``, so a
    data-modifying one runs, once, even when nothing reads it. The rows such a CTE locks before
    ``statement``'s own are locked behind ``EXISTS`` of :data:`LOCKED_JOB`."""

    statement: Update | None
    params: Mapping[str, Any]
    result: dict
    answer: dict | None = None
    returning: tuple[ColumnElement, ...] = ()
    answer_from: Callable[[Mapping[str, Any]], dict | None] | None = None
    #: Instead of ``statement`` (None): the one statement of this write and of the writes of the
    #: jobs leased with it that have the same ``joint`` (:func:`settle_together`), made from them.
    joint: Callable[[Sequence[tuple[Job, OutcomeWrite]]], JointWrite] | None = None


@dataclass(frozen=True)
class JointWrite:
    """The outcome writes of one or several jobs leased together as one statement, made by their
    :attr:`OutcomeWrite.joint`: ``statement``, built once, is :func:`settle_applied` of a CTE that
    writes their outcomes, returning for each job whose outcome applied its id and the values its
    answer is made of (``returned``, their labels, for each write's ``answer_from``); ``params``,
    its values (but ``outcome_job_ids``, ``outcome_status`` and ``outcome_at``,
    :func:`settle_together`'s own)."""

    statement: Update
    returned: tuple[str, ...]
    params: Mapping[str, Any]


#: The lock of the rows of a :class:`JointWrite`'s jobs, in id order (a CTE, ``SELECT ... FOR UPDATE``), that
#: its statement takes first, as :data:`LOCKED_JOB` for one job (an uncorrelated ``EXISTS`` of it in the
#: ``WHERE`` of a CTE's lock puts that lock after it). Its ids are a bound array (``outcome_job_ids``,
#: bound by :func:`settle_together`), not read from the statement's JSON rows: an array is found by
#: the primary key's index on a generic plan, rows from JSON are estimated at a hundred and joined
#: by a scan of the whole table.
LOCKED_JOBS = (
    select(_JOBS.c.id)
    .where(_JOBS.c.id == any_(cast(bindparam("outcome_job_ids", type_=String()), ARRAY(_JOBS.c.id.type))))
    .order_by(_JOBS.c.id)
    .with_for_update()
    .cte("locked_jobs")
)


def settle_applied(applied: CTE, *returned: ColumnElement[Any]) -> Update:
    """The main statement of a :class:`JointWrite`: each job named by ``applied`` (a CTE with its
    ``job_id`` and its ``result``, one row per job whose outcome applied) settled ``succeeded``, its
    lease cleared, returning its id and ``returned`` (expressions over ``applied`` and the
    statement's other CTEs, labelled)."""
    return (
        update(_JOBS)
        .where(_JOBS.c.id == applied.c.job_id)
        .values(
            status=bindparam("outcome_status", type_=_JOBS.c.status.type),
            lease_owner=None,
            lease_expires_at=None,
            updated_at=bindparam("outcome_at", type_=_JOBS.c.updated_at.type),
            result=applied.c.result,
        )
        .returning(_JOBS.c.id, *returned)
    )


#: The job id of an outcome's one statement (:func:`settle_with` binds it).
OUTCOME_JOB_ID = bindparam("outcome_job_id", type_=_JOBS.c.id.type)
#: The lock of the job's row that an outcome's one statement takes first (a CTE, ``SELECT ... FOR
#: UPDATE``). A write that locks other rows before its own (a parent row, say) puts ``EXISTS`` of this
#: first in that lock's ``WHERE``: an uncorrelated ``EXISTS`` is a one-time filter, evaluated before
#: the scan, so the job's row is locked first, the lock order of an outcome's transaction (:func:`lock`).
LOCKED_JOB = select(_JOBS.c.id).where(_JOBS.c.id == OUTCOME_JOB_ID).with_for_update().cte("locked_job")


class _PreparedOutcome:
    """The one statement of an :class:`OutcomeWrite`'s ``statement``, built once: the job's row locked
    first, the write, the job settled when the write changed a row; the values the write returns
    (:attr:`returned`, their names) come back beside the job's id."""

    __slots__ = ("returned", "statement")

    def __init__(self, write: Update, returning: tuple[ColumnElement, ...]):
        self.returned = tuple(str(column.key) for column in returning)
        # an uncorrelated EXISTS is a one-time filter, evaluated before the write reads (and locks) its row
        changed = (
            write.where(exists(select(LOCKED_JOB.c.id)))
            .returning(*returning, literal(1).label("changed"))
            .cte("outcome")
        )
        values = (select(changed.c[name]).scalar_subquery().label(name) for name in self.returned)
        self.statement = server_prepared(
            update(_JOBS)
            .where(_JOBS.c.id == OUTCOME_JOB_ID, exists(select(changed.c.changed)))
            .values(
                status=bindparam("outcome_status", type_=_JOBS.c.status.type),
                lease_owner=None,
                lease_expires_at=None,
                updated_at=bindparam("outcome_at", type_=_JOBS.c.updated_at.type),
                result=bindparam("outcome_result", type_=_JOBS.c.result.type),
            )
            .returning(_JOBS.c.id, *values)
        )


#: The one-statement form of each outcome write a task keeps (:func:`_kept`).
_PREPARED_OUTCOMES: dict[int, tuple[object, _PreparedOutcome]] = {}


def _prepared_outcome(write: Update, returning: tuple[ColumnElement, ...]) -> _PreparedOutcome:
    return _kept(_PREPARED_OUTCOMES, write, lambda: _PreparedOutcome(write, returning))


def settle_with(job: Job, write: OutcomeWrite) -> bool:
    """Write a leased job's outcome and settle it ``succeeded`` in one durable statement, a
    transaction of its own (:func:`storage.db.execute_durable`: no ``BEGIN``, no ``COMMIT``), then
    publish the outcome to a waiting request (:mod:`infra.wait`). The statement locks the job's row
    first (the lock order of an outcome's transaction, as :func:`lock`), then runs ``write.statement``
    (or its :attr:`OutcomeWrite.joint`'s) and settles the job only when that changed a row. Returns
    True when it did; False when it changed nothing (then nothing was written and the job is still
    leased: write the outcome in a transaction, :func:`lock` then :func:`settle`) and on a database
    without one-statement transactions."""
    return settle_together([(job, write)])[0]


def settle_together(outcomes: Sequence[tuple[Job, OutcomeWrite]]) -> list[bool]:
    """:func:`settle_with` of several leased jobs at once, each outcome published once it committed.
    When every write has the same :attr:`OutcomeWrite.joint` (an enabled rail, or the rails of one
    payment method), it makes their one statement (:class:`JointWrite`): one round trip, one lock of
    the row they share, one commit. Otherwise their statements, in the order given, in one durable
    transaction (:func:`storage.db.execute_durable_together`: one commit, one WAL flush), a later
    statement seeing what an earlier one wrote, as it would have after the earlier one's commit.
    Either way, jobs whose outcomes lock the same row no longer commit one after the other, the
    second waiting for the first's lock and its flush. Their outcomes go out in one message
    (``infra.wait.publish_outcomes``: the request waiting for them all is woken once). One job:
    :func:`settle_with`'s one statement. Returns, per job, what :func:`settle_with` returns. Raises
    the driver's error when a statement fails: then none of the outcomes is written and every job
    is still leased."""
    if not outcomes:
        return []
    if not one_statement_transactions():
        return [False] * len(outcomes)
    joint = outcomes[0][1].joint
    if joint is not None and all(write.joint is joint for _, write in outcomes):
        return _settled_jointly(outcomes, joint(outcomes))
    now = utcnow()
    runs = []
    for job, write in outcomes:
        if write.statement is None:
            raise TypeError("an outcome write without a statement settles with the writes of its joint only")
        values = _settled(JobStatus.SUCCEEDED, error=None, result=write.result, now=now)
        params = {
            **write.params,
            "outcome_job_id": job.id,
            "outcome_status": values["status"],
            "outcome_result": values["result"],
            "outcome_at": values["updated_at"],
        }
        runs.append((job, write, values, _prepared_outcome(write.statement, write.returning), params))
    if len(runs) == 1:
        _, _, _, prepared, params = runs[0]
        rows = [execute_durable(prepared.statement, params)]
    else:
        rows = execute_durable_together([(prepared.statement, params) for _, _, _, prepared, params in runs])
    published: list[wait.SettledJob] = []
    settled = [
        _settled_with(job, write, values, prepared.returned, row, published)
        for (job, write, values, prepared, _), row in zip(runs, rows, strict=True)
    ]
    wait.publish_outcomes(published)
    return settled


def _settled_jointly(outcomes: Sequence[tuple[Job, OutcomeWrite]], together: JointWrite) -> list[bool]:
    """:func:`settle_together` of ``outcomes`` by their one statement ``together``: a job whose id it
    returned is settled (its answer made from what it returned beside the id), the others are not
    (each is then written in a transaction of its own, as after :func:`settle_with`'s False)."""
    now = utcnow()
    params = {
        **together.params,
        "outcome_job_ids": "{" + ",".join(str(job.id) for job, _ in outcomes) + "}",
        "outcome_status": JobStatus.SUCCEEDED,
        "outcome_at": now,
    }
    returned = {row[0]: row for row in execute_durable(together.statement, params, every_row=True)}
    published: list[wait.SettledJob] = []
    settled = []
    for job, write in outcomes:
        values = _settled(JobStatus.SUCCEEDED, error=None, result=write.result, now=now)
        settled.append(_settled_with(job, write, values, together.returned, returned.get(job.id), published))
    wait.publish_outcomes(published)
    return settled


def _settled_with(
    job: Job,
    write: OutcomeWrite,
    values: dict[str, Any],
    returned: tuple[str, ...],
    row: Any,
    published: list[wait.SettledJob],
) -> bool:
    """After the commit of a job's outcome statement: False when it changed nothing (``row`` None),
    else the job's fields set as settled and its outcome added to ``published`` (with the answer,
    when the write gives one), True."""
    if row is None:
        return False
    for name, value in values.items():
        setattr(job, name, value)
    answer = write.answer
    if write.answer_from is not None:
        try:
            answer = write.answer_from({name: row._mapping[name] for name in returned})
        except Exception:  # the outcome is written: its waiter reads it instead
            log.warning("job %s: no answer for its outcome message", job.id, exc_info=True)
            answer = None
    published.append((job.id, JobStatus.SUCCEEDED, wait.safe_result(write.result), answer))
    return True


def backoff_seconds(attempt: int, *, base: float = 2.0, cap: float = 600.0) -> float:
    """The delay before retry number ``attempt`` (1-based): exponential with jitter, capped."""
    delay = min(cap, base * 2 ** (attempt - 1))
    return delay * random.uniform(0.8, 1.2)


@overload
def retry(
    session: Session, jobs: Job, *, error: str, delay: float | None = None, backoff_base: float = 2.0
) -> float | None: ...


@overload
def retry(
    session: Session, jobs: Sequence[uuid.UUID], *, error: str, delay: float, kind: str, now: dt.datetime | None = None
) -> float: ...


def retry(
    session: Session,
    jobs: Job | Sequence[uuid.UUID],
    *,
    error: str,
    delay: float | None = None,
    backoff_base: float = 2.0,
    kind: str | None = None,
    now: dt.datetime | None = None,
) -> float | None:
    """Put jobs back to ``queued`` for a later attempt (lease released, ``error`` recorded); their task
    is sent after the commit as a countdown when the delay is at most a minute
    (:func:`infra.dispatch.enqueue_after_commit`), else the relay sends it when ``due_at`` comes.

    One job (a :class:`Job` in ``session``): due after ``delay`` seconds, or the exponential backoff
    from ``backoff_base`` when ``delay`` is None; a job whose attempts are spent becomes ``dead`` (a
    dead letter, published to a waiting request). Returns the delay, or None for a dead letter.
    Many jobs (a list of ids of ``kind``): one ``UPDATE``, all due in ``delay``; returns ``delay``.
    Raises ValueError for many jobs without ``kind`` or ``delay``.
    """
    now = now or utcnow()
    if not isinstance(jobs, Job):
        if kind is None or delay is None:
            raise ValueError("many jobs are retried with their kind and one delay")
        if jobs:
            session.execute(
                update(Job)
                .where(col(Job.id).in_(list(jobs)))
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
            enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id in jobs], delay=delay)
        return delay
    job = jobs
    if job.attempts >= job.max_attempts:
        settle(session, job, JobStatus.DEAD, error=error, now=now)
        return None
    delay = backoff_seconds(job.attempts, base=backoff_base) if delay is None else delay
    job.status = JobStatus.QUEUED
    job.lease_owner = None
    job.lease_expires_at = None
    job.last_error = error[:1000]
    job.due_at = now + dt.timedelta(seconds=delay)
    job.enqueued_at = None
    job.updated_at = now
    session.add(job)
    enqueue_jobs_after_commit(session, job.kind, [str(job.id)], delay=delay)
    return delay


def requeue(
    session: Session,
    jobs: Job | Sequence[uuid.UUID],
    *,
    kind: str | None = None,
    fresh_budget: bool = True,
    waiting_only: bool = False,
    now: dt.datetime | None = None,
) -> int:
    """Queue jobs again, due now, and send their task when ``session`` commits: a settled job (a
    replay of a dead letter or a failure: ``fresh_budget`` gives it its attempts again) or a waiting
    one (due now). One job (a :class:`Job` in ``session``) or many (a list of ids of ``kind``, one
    ``UPDATE``). A job a worker holds a live lease on is left to that worker; with ``waiting_only``, a
    settled one too (work handed back unstarted: one that another worker finished meanwhile must not
    run again). Returns how many jobs were queued again. Raises ValueError for many jobs without
    ``kind``."""
    now = now or utcnow()
    if isinstance(jobs, Job):
        kind, ids = jobs.kind, [jobs.id]
    elif kind is None:
        raise ValueError("many jobs are queued again with their kind")
    else:
        ids = list(jobs)
    if not ids:
        return 0
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
    unleased = or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now)
    which = (col(Job.id).in_(ids), unleased, *((col(Job.status).in_(JOB_TAKEABLE),) if waiting_only else ()))
    count = rowcount(
        session.execute(update(Job).where(*which).values(**values).execution_options(synchronize_session=False))
    )
    if isinstance(jobs, Job) and count:
        session.refresh(jobs)
    enqueue_jobs_after_commit(session, kind, [str(job_id) for job_id in ids])
    return count


def hand_back(session: Session, job: Job, owner: str) -> bool:
    """Give back a job ``owner`` leased but did not start (:mod:`infra.fairness`: another tenant's job
    runs in its place): queued again with its due time, the attempt its lease counted undone, its task
    sent again once ``session`` commits (behind the messages already queued). One ``UPDATE`` of the
    row, only while ``owner`` holds its lease; returns whether it was given back."""
    now = utcnow()
    given = rowcount(
        session.execute(
            update(Job)
            .where(col(Job.id) == job.id, col(Job.lease_owner) == owner, col(Job.status) == JobStatus.RUNNING)
            .values(
                status=JobStatus.QUEUED,
                lease_owner=None,
                lease_expires_at=None,
                attempts=Job.attempts - 1,
                enqueued_at=None,
                updated_at=now,
            )
            .execution_options(synchronize_session=False)
        )
    )
    if given:
        enqueue_jobs_after_commit(session, job.kind, [str(job.id)])
    return given == 1


def cancel_if_queued(session: Session, job_id: uuid.UUID) -> None:
    """Cancel a job nobody took yet (its waiting request gave up); a running job runs to its end."""
    session.execute(
        update(Job)
        .where(col(Job.id) == job_id, col(Job.status) == JobStatus.QUEUED)
        .values(status=JobStatus.CANCELLED, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
