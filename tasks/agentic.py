"""Agentic tasks (``agentic.*``, routed to the ``providers`` queue): rail enrollment, polling of
pending enrollments, the delete cascade, and two beat sweeps (stale operation leases, provider error
retention). Thin shells: the work is in :mod:`domain.agentic.enrollment` and friends.

Beat entries (``beat_schedule.py``)::

    "agentic-operation-leases": {"task": "agentic.release_stale_operation_leases", "schedule": 30.0,
                                 "options": {"expires": 25, "queue": "sweeps"}},
    "agentic-provider-errors": {"task": "agentic.purge_provider_errors", "schedule": 3600.0,
                                "options": {"expires": 3300, "queue": "sweeps"}},
"""

from __future__ import annotations

import logging

from config.settings import get_settings
from domain.agentic import enrollment, leases
from domain.agentic.payment_methods import DELETE_TASK, ENROLL_TASK, POLL_TASK, purge_provider_errors
from infra.celery import celery_app
from infra.task import JobTask, TesseraTask
from storage.db import session_scope
from tasks.sweeps import in_batches

log = logging.getLogger("tessera.tasks.agentic")

SWEEP_BATCH = 1000


class _ProviderJob(JobTask):
    """A job that makes one provider call at a time: its lease covers one call's timeouts."""

    abstract = True

    @property
    def lease_seconds(self) -> float:  # type: ignore[override]
        """Seconds a worker holds the job: one call's connect and read timeouts plus 10 s."""
        settings = get_settings()
        return settings.provider_connect_timeout_seconds + settings.agentic_provider_timeout_seconds + 10.0


class EnrollRail(_ProviderJob):
    """Enroll one rail of a payment method with its provider (job subject: the rail id)."""

    name = ENROLL_TASK
    apply_to_leased_job = True

    def lease_reads(self):
        """See :func:`domain.agentic.enrollment.enrollment_reads`."""
        return enrollment.enrollment_reads()

    def perform(self, job, read):
        """The provider call (see :func:`domain.agentic.enrollment.perform_enrollment_read`)."""
        return enrollment.perform_enrollment_read(job, read, get_settings(), session_scope)

    def apply(self, session, job, outcome):
        """Write the outcome (see :func:`domain.agentic.enrollment.apply_enrollment`)."""
        return enrollment.apply_enrollment(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record the failure (see :func:`domain.agentic.enrollment.enrollment_failed`)."""
        enrollment.enrollment_failed(session, job, error)


class PollRail(_ProviderJob):
    """Ask the provider about a pending enrollment until it settles (job subject: the rail id)."""

    name = POLL_TASK

    def perform(self, job):
        """The provider read (see :func:`domain.agentic.enrollment.perform_poll`)."""
        return enrollment.perform_poll(job, get_settings(), session_scope)

    def apply(self, session, job, outcome):
        """Write the outcome (see :func:`domain.agentic.enrollment.apply_enrollment`)."""
        return enrollment.apply_enrollment(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record the failure (see :func:`domain.agentic.enrollment.enrollment_failed`)."""
        enrollment.enrollment_failed(session, job, error)


class DeletePaymentMethod(_ProviderJob):
    """The delete cascade of a payment method (job subject: ``<payment method id>/<lease owner>``).

    Its lease is per job, not per call: it makes one call per rail (at most two).
    """

    name = DELETE_TASK

    @property
    def lease_seconds(self) -> float:  # type: ignore[override]
        """Seconds a worker holds the job: two calls' timeouts plus 10 s."""
        settings = get_settings()
        return 2 * (settings.provider_connect_timeout_seconds + settings.agentic_provider_timeout_seconds) + 10.0

    def perform(self, job):
        """The provider removals (see :func:`domain.agentic.enrollment.perform_delete`)."""
        return enrollment.perform_delete(job, get_settings(), session_scope)

    def apply(self, session, job, outcome):
        """Mark the payment method deleted (see :func:`domain.agentic.enrollment.apply_delete`)."""
        return enrollment.apply_delete(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record the stopped cascade (see :func:`domain.agentic.enrollment.delete_failed`)."""
        enrollment.delete_failed(session, job, error)


celery_app.register_task(EnrollRail())
celery_app.register_task(PollRail())
celery_app.register_task(DeletePaymentMethod())


@celery_app.task(name="agentic.release_stale_operation_leases", base=TesseraTask)
def release_stale_operation_leases() -> int:
    """Free operation leases whose holder died (expired); returns how many."""
    return in_batches(lambda s: leases.release_expired(s, batch=SWEEP_BATCH), SWEEP_BATCH)


@celery_app.task(name="agentic.purge_provider_errors", base=TesseraTask)
def purge_provider_errors_task() -> int:
    """Delete provider errors older than ``provider_error_retention_days`` (90); returns how many."""
    days = get_settings().provider_error_retention_days
    return in_batches(lambda s: purge_provider_errors(s, retention_days=days, batch=SWEEP_BATCH), SWEEP_BATCH)

