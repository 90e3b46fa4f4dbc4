"""The task side of jobs: one template every job-running task follows (``infra/jobs.py``).

A job task subclasses :class:`JobTask` and fills in three hooks::

    class Provision(JobTask):
        name = "network_tokens.provision"

        def perform(self, job):                       # outside any transaction: the provider call,
            return adapter.provision(..., idempotency_key=str(job.id))   # may raise Transient/Permanent

        def apply(self, session, job, outcome):       # one transaction with the job's completion:
            ...                                       # write the outcome and emit its events
            return {"network_token_id": ...}          # the job's result

        def on_failure(self, session, job, error):    # permanent failure or dead letter
            ...

    celery_app.register_task(Provision())

The template leases the job (a duplicate message or a second worker does nothing), runs
``perform`` without holding a transaction, then in one transaction writes the outcome with
``apply`` and completes the job. A :class:`TransientError` is retried with backoff (a countdown task
up to a minute, a ``due_at`` for the relay beyond); past ``max_attempts`` the job is a dead letter.
A :class:`PermanentError` is recorded and ``on_failure`` runs.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlmodel import Session

from infra import jobs
from infra.dispatch import send_task
from infra.jobs import PermanentError, TransientError
from infra.task import TesseraTask
from storage.db import session_scope
from storage.models import Job

log = logging.getLogger("tessera.jobs")


class JobTask(TesseraTask):
    """Base class of tasks that run a recorded :class:`storage.models.Job`."""

    abstract = True
    #: How long a worker holds a job; longer than the slowest provider call it makes.
    lease_seconds: float = 120.0

    def lease_reads(self) -> dict[str, Any]:
        """What ``perform`` needs, read by the lease statement itself (:func:`infra.jobs.lease_and_read`):
        name -> scalar SQL expression over the job row. Given any, ``perform(job, read)`` gets their values."""
        return {}

    def perform(self, job: Job) -> Any:
        """Do the slow part (provider calls) outside any transaction; return what ``apply`` needs."""
        raise NotImplementedError

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """Write the outcome and its events in the completing transaction (the job row is locked
        already); return the job result."""
        raise NotImplementedError

    def on_failure(self, session: Session, job: Job, error: Exception) -> None:
        """Record a permanent failure or a dead letter on the domain object (default: nothing)."""

    def run(self, job_id: str) -> str:
        """Lease, perform, apply: returns the job's status after this attempt."""
        reads = self.lease_reads()
        leased = jobs.lease_and_read(uuid.UUID(job_id), self.worker_id(), lease_seconds=self.lease_seconds,
                                     reads=reads)
        if leased is None:
            return "skipped"
        job, read = leased
        try:
            outcome = self.perform(job, read) if reads else self.perform(job)
        except TransientError as exc:
            return self._retry(job, exc)
        except PermanentError as exc:
            return self._fail(job, exc)
        with session_scope() as session:
            current = session.get(Job, job.id, with_for_update=True)  # locked first: the lock order of ``apply``
            result = self.apply(session, current, outcome)
            jobs.complete(session, current, result=result)
        return "succeeded"

    def _retry(self, job: Job, exc: TransientError) -> str:
        with session_scope() as session:
            current = session.get(Job, job.id)
            delay = jobs.schedule_retry(session, current, error=str(exc), delay=exc.retry_after)
            if delay is None:
                log.warning("job %s (%s) is a dead letter after %s attempts", job.id, job.kind, current.attempts)
                self.on_failure(session, current, exc)
        if delay is not None and delay <= jobs.MAX_COUNTDOWN_SECONDS:
            send_task(job.kind, countdown=delay, job_id=str(job.id))
        return "dead" if delay is None else "retrying"

    def _fail(self, job: Job, exc: PermanentError) -> str:
        with session_scope() as session:
            current = session.get(Job, job.id)
            jobs.fail(session, current, error=f"{exc.code}: {exc}", result={"code": exc.code, "status": exc.status})
            self.on_failure(session, current, exc)
        return "failed"
