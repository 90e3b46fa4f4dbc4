"""A job task for the in-process worker whose behaviour a test sets: ``ops_probe.job``.

``MODE["value"]``: ``"transient"`` (always fails for a retry: a dead letter once its attempts are
spent), ``"succeed"`` (returns ``{"ok": True}``). Registered when imported (at collection, before
the session's worker starts).
"""

from __future__ import annotations

from infra import jobs
from infra.celery import celery_app
from infra.jobs import TransientError
from infra.task import JobTask
from storage.db import session_scope
from storage.models import Job

MODE = {"value": "transient"}
KIND = "ops_probe.job"


class ProbeJob(JobTask):
    """Fails or succeeds as :data:`MODE` says."""

    name = KIND
    lease_seconds = 5

    def perform(self, job, inputs):
        if MODE["value"] == "transient":
            raise TransientError("probe provider answered 503", retry_after=0.2)
        return {"ok": True}

    def apply(self, session, job, outcome):
        return outcome


celery_app.register_task(ProbeJob())


def record(*, max_attempts: int = 2, tenant_id=None, trace_id: str | None = None, **fields) -> Job:
    """Record a probe job (its task is sent on commit unless ``fields`` make it not due yet)."""
    with session_scope() as session:
        job = jobs.record(
            session,
            kind=KIND,
            tenant_id=tenant_id,
            subject_type="probe",
            subject_id="probe",
            trace_id=trace_id,
            max_attempts=max_attempts,
        )
        for name, value in fields.items():
            setattr(job, name, value)
        return job


def read(job_id) -> Job:
    """The job as stored now."""
    with session_scope() as session:
        return session.get(Job, job_id)
