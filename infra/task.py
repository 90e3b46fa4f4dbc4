"""The task base classes: the one protocol every Celery task of the platform follows
(``ARCHITECTURE.md``, the spine).

:class:`TesseraTask` is what every task shares: acknowledged late, rejected on worker loss, a time
limit covering its lease, a session scope, a lease owner name, and :meth:`TesseraTask.report`, which
turns an attempt's committed outcome into the state operators see in Flower:

* every unit of work succeeded (or was not due): SUCCESS with the result;
* retries were scheduled (rows back to ``queued``/``pending`` with a ``due_at``, their messages sent
  after the commit as a countdown up to a minute, by the relay beyond): RETRY, without sending anything
  (:class:`celery.exceptions.Retry` raised by hand), so no second message exists for this attempt;
* something failed for good (a permanent error, a dead letter): FAILURE, with :class:`AttemptFailed`
  (an expected exception: logged without a traceback).

The outcome is always committed first, and with ``acks_late`` plus ``task_acks_on_failure_or_timeout``
the message is acknowledged in all three cases: a run is never repeated because it reported a failure.

:class:`JobTask` runs one recorded :class:`storage.models.Job` (``infra/jobs.py``). A subclass fills
in three hooks::

    class Provision(JobTask):
        name = "network_tokens.provision"

        def perform(self, job, inputs):               # outside any transaction: the provider call,
            return adapter.provision(..., idempotency_key=str(job.id))   # may raise Transient/Permanent

        def apply(self, session, job, outcome):       # one transaction with the job's completion:
            ...                                       # write the outcome and emit its events
            return {"network_token_id": ...}          # the job's result

        def on_job_failure(self, session, job, error):    # permanent failure or dead letter
            ...

    celery_app.register_task(Provision())

``inputs`` is always what the lease statement read for the job: the values of :meth:`JobTask.lease_reads`
(none by default, so an empty dict). How long the lease lasts is declared as data: ``lease_seconds``
plus, for a length that follows the settings, ``lease_settings`` (setting name -> factor)::

    class Enroll(JobTask):
        lease_seconds = 10.0           # one provider call's timeouts plus 10 s
        lease_settings = {"provider_connect_timeout_seconds": 1, "agentic_provider_timeout_seconds": 1}

The template leases the job (a duplicate message or a second worker does nothing), runs ``perform``
without holding a transaction, then in one transaction writes the outcome with ``apply`` and
completes the job. A task whose usual outcome is one row's change can also give it as data
(:meth:`JobTask.outcome_write`): that change and the job's completion are then one statement, and
``apply`` runs only when the change finds nothing to change.

Domain code never sends a task nor computes a countdown: it returns an outcome or raises
:class:`~infra.jobs.TransientError` (optionally with ``retry_after`` seconds) or
:class:`~infra.jobs.PermanentError`. A transient error is retried with backoff
(:func:`infra.jobs.retry`); past ``max_attempts`` the job is a dead letter; a permanent error is
recorded and ``on_job_failure`` runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import gc
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Retry
from sqlmodel import Session

from config.settings import Settings, get_settings
from infra import fairness, jobs, wait
from infra.celery import QUIET_TASKS, queue_of
from infra.jobs import PermanentError, TransientError
from storage.db import session_scope
from storage.models import Job
from storage.states import JobStatus
from storage.types import utcnow


@functools.cache
def _host_name() -> str:
    """This machine's host name, asked once per process: ``socket.gethostname`` is a system call that
    lets go of the interpreter lock, and a job's thread asking at the start of every run waited to
    take it back from the consumer's thread, which is busy just then with the message it handed over."""
    return socket.gethostname()


log = logging.getLogger("tessera.jobs")

#: How long a run may go on after its lease expired before the worker kills it (seconds).
LEASE_OVERRUN_SECONDS = 30.0
#: The name of the lease read of a fair job task that says another tenant waits (never a task's own).
_OTHERS_WAIT = "_fairness_others_wait"


class AttemptFailed(Exception):
    """Raised after an attempt's failure is committed, so the worker reports FAILURE.

    ``outcome`` is ``failed`` (permanent) or ``dead`` (a dead letter): the metrics label of the run.
    """

    def __init__(self, message: str, *, outcome: str = "failed"):
        super().__init__(message)
        self.outcome = outcome


class RetryReason(Exception):
    """Why an attempt is retried (its error, the attempt count and when it runs again): carried by the
    :class:`celery.exceptions.Retry` a task raises, so the worker's ``task-retried`` event names it."""


class TesseraTask(Task):
    """Acknowledged late, rejected on worker loss, time-limited; arguments are ids only.

    The lease (when a task leases rows) also bounds the run (:attr:`time_limit`). Its length is data:
    ``lease_seconds`` plus each setting of ``lease_settings`` times its factor (:meth:`lease_length`).
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    throws = (AttemptFailed,)

    @property
    def send_events(self) -> bool:
        """Whether the worker sends this task's events (Flower): not for beat's periodic sweeps
        (:data:`infra.celery.QUIET_TASKS`)."""
        return self.name not in QUIET_TASKS

    #: The fixed part of how long a worker holds what it leased (seconds); None for tasks that lease nothing.
    lease_seconds: float | None = None
    #: The part that follows the settings: setting name (a number of seconds) -> factor.
    lease_settings: ClassVar[Mapping[str, float]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a ``lease_settings`` naming no setting, when the class is made rather than at run time."""
        super().__init_subclass__(**kwargs)
        unknown = set(cls.lease_settings) - set(Settings.model_fields)
        if unknown:
            raise TypeError(f"{cls.__name__}.lease_settings names no setting: {sorted(unknown)}")

    @staticmethod
    def session_scope() -> AbstractContextManager[Session]:
        """A unit of work (:func:`storage.db.session_scope`)."""
        return session_scope()

    def lease_length(self, settings: Settings | None = None) -> float | None:
        """How long a worker holds what it leased (seconds): ``lease_seconds`` plus each of
        ``lease_settings`` times its factor, read from ``settings`` (default: the process's); None
        when the task leases nothing."""
        if self.lease_seconds is None and not self.lease_settings:
            return None
        settings = settings or get_settings()
        return (self.lease_seconds or 0.0) + sum(
            getattr(settings, name) * factor for name, factor in self.lease_settings.items()
        )

    @property
    def time_limit(self) -> float | None:
        """The hard time limit of a run (seconds): the lease plus :data:`LEASE_OVERRUN_SECONDS` when
        the task leases (a run outlives its lease by at most that: a second worker that took the
        expired lease meanwhile repeats an idempotent step), else the app's ``task_time_limit``."""
        lease = self.lease_length()
        return None if lease is None else lease + LEASE_OVERRUN_SECONDS

    @property
    def soft_time_limit(self) -> float | None:
        """Ten seconds before the hard limit, so the run can end cleanly."""
        hard = self.time_limit
        return None if hard is None else hard - 10

    def worker_id(self) -> str:
        """A lease owner name unique to this attempt: ``<host name>:<pid>:<task id>``."""
        return f"{_host_name()}:{os.getpid()}:{self.request.id}"

    def report(
        self,
        result: Any,
        *,
        retrying: int = 0,
        failed: int = 0,
        dead: int = 0,
        error: str = "",
        retry_in: float | None = None,
    ) -> Any:
        """Return ``result``, or end the run as FAILURE (``failed``/``dead`` units) or RETRY
        (``retrying`` units, due again in ``retry_in`` seconds); call after the outcome is committed."""
        if failed or dead:
            what = "dead letter" if dead else "failed"
            raise AttemptFailed(error or f"{failed + dead} {what}", outcome="dead" if dead else "failed")
        if retrying:
            reason = error or f"{retrying} to retry"
            # ``exc`` is what the worker's task-retried event (Flower's "Exception") shows.
            raise Retry(reason, exc=RetryReason(reason), when=retry_in)
        return result


class JobTask(TesseraTask):
    """Base class of tasks that run a recorded :class:`storage.models.Job`."""

    abstract = True
    lease_seconds: float | None = 120.0
    #: The first retry delay (seconds) of the exponential backoff, when the error names no delay.
    backoff_base: float = 2.0
    #: True: ``apply`` gets the job as leased, not loaded into its session (it reads the job's
    #: fields and never adds, refreshes or changes the job itself): the row is locked and completed
    #: by one statement each, no ORM object (:func:`infra.jobs.lock`, :func:`infra.jobs.settle` of the
    #: detached job). False (the default): a locked ORM load of the job.
    apply_to_leased_job: bool = False
    #: True: ``perform`` and ``apply`` run with the cyclic garbage collector paused (a bulk step that
    #: makes hundreds of thousands of short-lived, acyclic objects, such as an account updater chunk:
    #: the collector's passes, each triggered by allocations and walking the young heap, cost about
    #: a third of its CPU). Its garbage is freed by reference counting as usual; the collector runs
    #: again once the step ends. False (the default): nothing changes.
    pause_gc: bool = False
    #: True (the default): fair between tenants on its queue (:mod:`infra.fairness`, in place): the
    #: lease statement also reads whether another tenant's job of :attr:`fair_group` waits, and only
    #: then a tenant holding at least two more runs of the group than a waiting tenant gives way: the
    #: run leases the waiting tenant's job instead and hands its own back. False: plain FIFO (a task
    #: with a rule of its own, such as ``reactors.run``).
    fair_between_tenants: bool = True

    @functools.cached_property
    def fair_group(self) -> tuple[str, ...]:
        """The kinds this task shares fairness with, computed on first use in a process: the registered
        job tasks of its queue that are fair between tenants and whose lease is no longer than its own
        (a run in place of this one must end within this run's time limit)."""
        own, queue = self._job_lease(), queue_of(self.name)
        return tuple(
            sorted(
                name
                for name, task in self.app.tasks.items()
                if isinstance(task, JobTask)
                and task.fair_between_tenants
                and queue_of(name) == queue
                and (task.lease_length() or own + 1) <= own
            )
        )

    def lease_reads(self) -> jobs.Reads:
        """What ``perform`` needs, read by the lease statement itself (:func:`infra.jobs.lease`):
        name -> scalar SQL expression over the job row, or :class:`infra.jobs.LeaseReads` (over
        tables joined to it); ``perform(job, inputs)`` gets their values by name."""
        return {}

    @functools.cached_property
    def _lease_reads(self) -> jobs.LeaseReads:
        """:meth:`lease_reads`, built on a process's first run and kept (the same object each run, so
        :func:`infra.jobs.lease` reuses its prepared statement)."""
        reads = jobs.lease_reads_of(self.lease_reads())
        if self.fair_between_tenants:
            reads = reads.with_columns(**{_OTHERS_WAIT: fairness.others_wait(self.fair_group, jobs.LEASE_NOW)})
        return reads

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """Do the slow part (provider calls) outside any transaction; return what ``apply`` needs.

        ``inputs``: what the lease statement read (:meth:`lease_reads`; empty when it reads nothing)."""
        raise NotImplementedError

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """Write the outcome and its events in the completing transaction (the job row is locked
        already); return the job result."""
        raise NotImplementedError

    def outcome_write(self, job: Job, outcome: Any) -> jobs.OutcomeWrite | None:
        """The outcome as one write, when ``apply`` would write nothing but it: written with the job's
        completion in one statement (:func:`infra.jobs.settle_with`), and ``apply`` runs only when
        that changed nothing. Only for tasks that :attr:`apply_to_leased_job`; None (the default):
        ``apply`` in a transaction."""
        return None

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        """Record a permanent failure or a dead letter on the domain object (default: nothing)."""

    def run(self, job_id: str, sibling_ids: Sequence[str] = ()) -> str:
        """Lease, perform, apply: returns ``succeeded`` or ``skipped`` (not takeable: a duplicate
        message, another worker's lease, not due yet); raises Retry or :class:`AttemptFailed` after
        recording a retry or a failure.

        ``sibling_ids``: the jobs recorded together with this one (``infra.dispatch.SIBLINGS_ARGUMENT``,
        a payment method's rails): all are leased by one statement (:func:`infra.jobs.lease_together`),
        then each runs side by side with this one on a thread of its own, performed and settled on
        its own as if it had come alone (giving way to a waiting tenant on its own, too), under this
        run's lease owner, except that the outcomes given as one write each (:meth:`outcome_write`)
        are written together, by one transaction, when every job's perform ended within
        :data:`JOINT_SETTLE_SECONDS` of the first (:class:`_JointSettle`). The run ends when all
        have: FAILURE when one failed, RETRY when one is retried (each has its own row and its own
        retry message), else this job's result; an unexpected error of one is raised after the
        others ended. Outcomes are published where the message's ``reply_to`` asks
        (``infra.wait.answering``: the api process that waits for them)."""
        with wait.answering(getattr(self.request, "reply_to", None)):
            return self._run(job_id, sibling_ids)

    def _run(self, job_id: str, sibling_ids: Sequence[str]) -> str:
        owner = self.worker_id()
        if not sibling_ids:
            return self._run_taken(
                jobs.lease(uuid.UUID(job_id), owner, lease_seconds=self._job_lease(), reads=self._lease_reads)
            )
        ids = [uuid.UUID(job_id), *(uuid.UUID(sibling) for sibling in sibling_ids)]
        leased = jobs.lease_together(ids, owner, lease_seconds=self._job_lease(), reads=self._lease_reads)
        joint = _JointSettle(len(leased))
        runs = [
            _sibling_runner().submit(contextvars.copy_context().run, self._run_taken, leased.get(sibling), joint)
            for sibling in ids[1:]
        ]
        own: concurrent.futures.Future[str] = concurrent.futures.Future()
        try:
            own.set_result(self._run_taken(leased.get(ids[0]), joint))
        except BaseException as exc:  # noqa: BLE001 - raised below, once the siblings ended
            own.set_exception(exc)
        concurrent.futures.wait(runs)
        errors = [error for error in (run.exception() for run in (own, *runs)) if error is not None]
        if errors:
            raise min(errors, key=_severity)
        return own.result()

    def _run_taken(self, leased: tuple[Job, dict[str, Any]] | None, joint: _JointSettle | None = None) -> str:
        """:meth:`run` of one job once its lease statement ran: ``leased`` is what it took (the job
        and its lease reads), None when the job was not takeable (``skipped``); ``joint``: the
        joint settle of the siblings it was leased with (it takes part exactly once, whatever
        happens)."""
        if leased is None:
            return "skipped"
        part = _Part(joint)
        try:
            job, inputs = leased
            if inputs.pop(_OTHERS_WAIT, False) and job.tenant_id is not None:
                task, job, inputs = self._give_way(job, inputs)
                return task.run_leased(job, inputs, part)
            return self.run_leased(job, inputs, part)
        finally:
            part.leave()

    def _give_way(self, job: Job, inputs: dict[str, Any]) -> tuple[JobTask, Job, dict[str, Any]]:
        """Another tenant waits on this task's group (:mod:`infra.fairness`): when the leased job's
        tenant holds at least two more runs of the group than a waiting tenant (those holding nothing
        first), lease a job of that tenant's instead and hand the leased one back; returns the
        task, job and inputs to run (the leased job's own when nobody is owed a turn, or the other job
        was taken meanwhile). A grouped count of the running jobs and a few index range probes."""
        assert job.tenant_id is not None and job.lease_owner is not None  # checked by run; set by its lease
        owner, group, now = job.lease_owner, self.fair_group, utcnow()
        with self.session_scope() as session:
            held = fairness.held_by_tenant(session, group, now=now)
            mine = held.get(job.tenant_id, 1)
            picked = (
                fairness.pick_for_others(
                    session, group, tenant=job.tenant_id, held=held, below=mine - 1, limit=2, now=now
                )
                if mine >= 2
                else []
            )
        for other_id, kind in picked:
            task = self.app.tasks.get(kind)
            if not isinstance(task, JobTask):
                continue
            other = jobs.lease(other_id, owner, lease_seconds=task._job_lease(), reads=task._lease_reads)
            if other is None:
                continue
            with self.session_scope() as session:
                jobs.hand_back(session, job, owner)
            other_job, other_inputs = other
            other_inputs.pop(_OTHERS_WAIT, None)
            log.info(
                "job %s (%s) of a tenant holding %s runs handed back; job %s (%s) of a waiting tenant runs instead",
                job.id,
                job.kind,
                mine,
                other_job.id,
                other_job.kind,
            )
            return task, other_job, other_inputs
        return self, job, inputs

    def run_leased(self, job: Job, inputs: dict[str, Any], part: _Part | None = None) -> str:
        """Perform and apply a job this run leased (see :meth:`run`); ``part``: its part in the joint
        settle of its siblings (none: settled alone)."""
        part = part or _Part(None)
        with _gc_paused(self.pause_gc):
            try:
                outcome = self.perform(job, inputs)
            except TransientError as exc:
                part.leave()
                return self._retry(job, exc)
            except PermanentError as exc:
                part.leave()
                return self._fail(job, exc)
            if self.apply_to_leased_job:
                write = self.outcome_write(job, outcome)
                if write is not None and part.settle(job, write):
                    return "succeeded"
            part.leave()
            with self.session_scope() as session:
                if self.apply_to_leased_job:
                    jobs.lock(session, job.id)  # locked first: the lock order of ``apply``
                    jobs.settle(session, job, JobStatus.SUCCEEDED, result=self.apply(session, job, outcome))
                else:
                    current = _held(session, job.id, lock=True)  # locked first, as above
                    jobs.settle(session, current, JobStatus.SUCCEEDED, result=self.apply(session, current, outcome))
        return "succeeded"

    def _job_lease(self) -> float:
        lease = self.lease_length()
        if lease is None:
            raise TypeError(f"{self.name} is a job task without a lease length")
        return lease

    def _retry(self, job: Job, exc: TransientError) -> str:
        with self.session_scope() as session:
            current = _held(session, job.id)
            delay = jobs.retry(session, current, error=str(exc), delay=exc.retry_after, backoff_base=self.backoff_base)
            if delay is None:
                log.warning("job %s (%s) is a dead letter after %s attempts", job.id, job.kind, current.attempts)
                self.on_job_failure(session, current, exc)
        if delay is None:
            return self.report("dead", dead=1, error=f"dead letter after {job.attempts} attempts: {exc}")
        return self.report(
            "retrying",
            retrying=1,
            retry_in=delay,
            error=f"attempt {job.attempts} of {job.max_attempts} failed: {exc}; again in {delay:.0f} s",
        )

    def _fail(self, job: Job, exc: PermanentError) -> str:
        with self.session_scope() as session:
            current = _held(session, job.id)
            jobs.settle(
                session,
                current,
                JobStatus.FAILED,
                error=f"{exc.code}: {exc}",
                result={"code": exc.code, "status": exc.status},
            )
            self.on_job_failure(session, current, exc)
        return self.report("failed", failed=1, error=f"{exc.code}: {exc}")


#: How long a job's outcome write waits for its siblings' (seconds) before it is written alone: long
#: enough for providers that answer together (a sandbox's answers come a millisecond apart), short
#: beside a provider that hangs (its sibling's state is not held back behind it).
JOINT_SETTLE_SECONDS = 0.05


class _JointSettle:
    """The outcome writes of jobs leased together (:meth:`JobTask.run` with siblings), written
    together (:func:`infra.jobs.settle_together`) once each of the ``parties`` jobs has either given
    its write (:meth:`settle`) or left (:meth:`leave`: its perform failed, it gives no write, or it
    ended otherwise). The rails of one payment method lock the payment method in their outcome
    statements: written apart, the second waited for the first's lock and its commit; written
    together, they are one statement (``domain.agentic.enrollment.enrolled_together``). The last
    party to arrive writes them. A write that waited
    :data:`JOINT_SETTLE_SECONDS` without it is taken back and written alone
    (:func:`infra.jobs.settle_with`): a rail whose provider answered is not held back behind a
    sibling whose provider takes its time. Thread-safe."""

    def __init__(self, parties: int, patience: float = JOINT_SETTLE_SECONDS) -> None:
        self._condition = threading.Condition()
        self._missing = parties
        self._patience = patience
        self._waiting: list[_Waiting] = []

    def settle(self, job: Job, write: jobs.OutcomeWrite) -> bool:
        """Give ``job``'s outcome write and wait for the transaction (at most the patience, then
        write it alone): what :func:`infra.jobs.settle_with` returns for it; raises what the
        transaction raised."""
        waiting = _Waiting(job, write)
        with self._condition:
            self._waiting.append(waiting)
            self._arrived()
            alone = not self._condition.wait_for(lambda: waiting.ended, timeout=self._patience)
            if alone:  # the transaction has not started: it runs under this lock
                self._waiting.remove(waiting)
        if alone:
            return jobs.settle_with(job, write)
        if waiting.error is not None:
            raise waiting.error
        return waiting.settled

    def leave(self) -> None:
        """Take part without a write (the others need not wait for this job any longer)."""
        with self._condition:
            self._arrived()

    def _arrived(self) -> None:
        """One more party arrived (the condition's lock held): the last one runs the transaction of
        the writes still waiting."""
        self._missing -= 1
        if self._missing or not self._waiting:
            return
        together, self._waiting = self._waiting, []
        try:
            settled = jobs.settle_together([(waiting.job, waiting.write) for waiting in together])
        except BaseException as exc:  # noqa: BLE001 - raised to every party whose write it was
            for waiting in together:
                waiting.error = exc
        else:
            for waiting, done in zip(together, settled, strict=True):
                waiting.settled = done
        for waiting in together:
            waiting.ended = True
        self._condition.notify_all()


class _Waiting:
    """One write given to a :class:`_JointSettle`, and what became of it."""

    __slots__ = ("ended", "error", "job", "settled", "write")

    def __init__(self, job: Job, write: jobs.OutcomeWrite) -> None:
        self.job, self.write = job, write
        self.ended, self.settled = False, False
        self.error: BaseException | None = None


class _Part:
    """One job's part in a :class:`_JointSettle` (or, without one, its own :func:`infra.jobs.settle_with`):
    it settles or leaves once; leaving again does nothing."""

    __slots__ = ("_done", "_joint")

    def __init__(self, joint: _JointSettle | None) -> None:
        self._joint = joint
        self._done = False

    def settle(self, job: Job, write: jobs.OutcomeWrite) -> bool:
        """Write ``job``'s outcome (see :func:`infra.jobs.settle_with`), with the siblings' when joint."""
        self._done = True
        return jobs.settle_with(job, write) if self._joint is None else self._joint.settle(job, write)

    def leave(self) -> None:
        """No write from this job (a no-op once it settled or left)."""
        if not self._done:
            self._done = True
            if self._joint is not None:
                self._joint.leave()


@contextlib.contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    """The block with the cyclic garbage collector paused when ``pause`` (and it was running)."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _severity(error: BaseException) -> int:
    """The rank of how one job's run among siblings ended, most severe first: the worker stopping,
    a recorded failure, an unexpected error, a recorded retry."""
    if not isinstance(error, Exception):
        return 0
    if isinstance(error, AttemptFailed):
        return 1
    return 3 if isinstance(error, Retry) else 2


#: Threads running the siblings of a job (:meth:`JobTask.run`), made on first use in a process.
_SIBLING_THREADS = 32


@functools.cache
def _sibling_runner() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of threads for the siblings of a job (made after a fork, on first use)."""
    return concurrent.futures.ThreadPoolExecutor(_SIBLING_THREADS, thread_name_prefix="tessera-sibling")


def _held(session: Session, job_id: uuid.UUID, *, lock: bool = False) -> Job:
    """The job this worker holds the lease of, re-read in ``session`` (locked ``FOR UPDATE`` when
    ``lock``); a leased job is never deleted, so its absence is a broken invariant."""
    job = session.get(Job, job_id, with_for_update=lock)
    if job is None:
        raise LookupError(f"job {job_id} vanished while leased")
    return job
