"""Agentic tasks (``agentic.*``, routed to the ``providers`` queue): rail enrollment, polling of
pending enrollments, the delete cascade, the allowance jobs (rail setup, update, verification,
cancellation, minting) and three beat sweeps (stale operation leases, provider error retention,
allowances: stale reservations, expiry, undelivered credential values). Thin shells: the work is in
:mod:`domain.agentic.enrollment`, :mod:`domain.agentic.allowance_work` and friends.

Beat entries (``beat_schedule.py``)::

    "agentic-operation-leases": {"task": "agentic.release_stale_operation_leases", "schedule": 30.0,
                                 "options": {"expires": 25, "queue": "sweeps"}},
    "agentic-provider-errors": {"task": "agentic.purge_provider_errors", "schedule": 3600.0,
                                "options": {"expires": 3300, "queue": "sweeps"}},
    "agentic-allowances": {"task": "agentic.sweep_allowances", "schedule": 30.0,
                           "options": {"expires": 25, "queue": "sweeps"}},
"""

from __future__ import annotations

import logging

from config.settings import get_settings
from domain.agentic import allowance_state, allowance_work, enrollment, leases
from domain.agentic.payment_methods import DELETE_TASK, ENROLL_TASK, POLL_TASK
from domain.agentic.service import purge_provider_errors
from infra import jobs
from infra.celery import celery_app
from infra.task import JobTask, TesseraTask
from tasks.sweeps import in_batches

log = logging.getLogger("tessera.tasks.agentic")

SWEEP_BATCH = 1000


class _ProviderJob(JobTask):
    """A job that makes one provider call at a time: its lease covers one call's timeouts."""

    abstract = True
    #: Seconds a worker holds the job: one call's connect and read timeouts plus 10 s.
    lease_seconds = 10.0
    lease_settings = {"provider_connect_timeout_seconds": 1.0, "agentic_provider_timeout_seconds": 1.0}


class EnrollRail(_ProviderJob):
    """Enroll one rail of a payment method with its provider (job subject: the rail id)."""

    name = ENROLL_TASK
    apply_to_leased_job = True

    def lease_reads(self) -> jobs.LeaseReads:
        """See :func:`domain.agentic.enrollment.enrollment_reads`."""
        return enrollment.enrollment_reads()

    def perform(self, job, inputs):
        """The provider call (see :func:`domain.agentic.enrollment.perform_enrollment_read`)."""
        return enrollment.perform_enrollment_read(job, inputs, get_settings())

    def outcome_write(self, job, outcome):
        """An enabled rail's outcome in one statement (see :func:`domain.agentic.enrollment.enrolled_write`)."""
        return enrollment.enrolled_write(job, outcome)

    def apply(self, session, job, outcome):
        """Write the outcome (see :func:`domain.agentic.enrollment.apply_enrollment`)."""
        return enrollment.apply_enrollment(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record the failure (see :func:`domain.agentic.enrollment.enrollment_failed`)."""
        enrollment.enrollment_failed(session, job, error)


class PollRail(_ProviderJob):
    """Ask the provider about a pending enrollment until it settles (job subject: the rail id)."""

    name = POLL_TASK

    def perform(self, job, inputs):
        """The provider read (see :func:`domain.agentic.enrollment.perform_poll`)."""
        return enrollment.perform_poll(job, get_settings())

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

    #: Seconds a worker holds the job: two calls' timeouts plus 10 s.
    lease_settings = {"provider_connect_timeout_seconds": 2.0, "agentic_provider_timeout_seconds": 2.0}

    def perform(self, job, inputs):
        """The provider removals (see :func:`domain.agentic.enrollment.perform_delete`)."""
        return enrollment.perform_delete(job, get_settings())

    def apply(self, session, job, outcome):
        """Mark the payment method deleted (see :func:`domain.agentic.enrollment.apply_delete`)."""
        return enrollment.apply_delete(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record the stopped cascade (see :func:`domain.agentic.enrollment.delete_failed`)."""
        enrollment.delete_failed(session, job, error)


class _AllowanceJob(_ProviderJob):
    """An allowance job: ``steps`` are its perform, apply and failure functions
    (:mod:`domain.agentic.allowance_work`). Its lease covers two calls (two rails, or a mint's key
    set fetch and provider call)."""

    abstract = True
    steps: tuple = ()

    #: Seconds a worker holds the job: two calls' timeouts plus 10 s.
    lease_settings = {"provider_connect_timeout_seconds": 2.0, "agentic_provider_timeout_seconds": 2.0}

    def perform(self, job, inputs):
        """The provider calls, outside any transaction."""
        return self.steps[0](job, get_settings())

    def apply(self, session, job, outcome):
        """Write the outcome with the job's completion."""
        return self.steps[1](session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Record a conclusive failure or a dead letter."""
        self.steps[2](session, job, error)


class SetUpAllowanceRail(_AllowanceJob):
    """Set up one allowance rail at its provider (job subject: the allowance rail id)."""

    name = allowance_state.SETUP_TASK
    steps = (allowance_work.perform_setup, allowance_work.apply_setup, allowance_work.setup_failed)


class UpdateAllowance(_AllowanceJob):
    """Apply an allowance's pending update at its providers, then locally (subject: the allowance)."""

    name = allowance_state.UPDATE_TASK
    steps = (allowance_work.perform_update, allowance_work.apply_update, allowance_work.update_failed)


class VerifyAllowanceRail(_AllowanceJob):
    """Start a rail's verification or submit its code (subject: the allowance rail id)."""

    name = allowance_state.VERIFY_TASK
    steps = (allowance_work.perform_verification, allowance_work.apply_verification, allowance_work.verification_failed)


class CancelAllowance(_AllowanceJob):
    """Cancel an allowance at every provider, then locally (subject: the allowance)."""

    name = allowance_state.CANCEL_TASK
    steps = (allowance_work.perform_cancel, allowance_work.apply_cancel, allowance_work.cancel_failed)


class MintCredential(_AllowanceJob):
    """Mint one payment credential (subject: the credential id, also the provider's key)."""

    name = allowance_state.MINT_TASK
    steps = (allowance_work.perform_mint, allowance_work.apply_mint, allowance_work.mint_failed)


celery_app.register_task(EnrollRail())
celery_app.register_task(PollRail())
celery_app.register_task(DeletePaymentMethod())
for _task in (SetUpAllowanceRail, UpdateAllowance, VerifyAllowanceRail, CancelAllowance, MintCredential):
    celery_app.register_task(_task())


@celery_app.task(name="agentic.release_stale_operation_leases", base=TesseraTask)
def release_stale_operation_leases() -> int:
    """Free operation leases whose holder died (expired); returns how many."""
    return in_batches(lambda s: leases.release_expired(s, batch=SWEEP_BATCH), SWEEP_BATCH)


@celery_app.task(name="agentic.purge_provider_errors", base=TesseraTask)
def purge_provider_errors_task() -> int:
    """Delete provider errors older than ``provider_error_retention_days`` (90); returns how many."""
    days = get_settings().provider_error_retention_days
    return in_batches(lambda s: purge_provider_errors(s, retention_days=days, batch=SWEEP_BATCH), SWEEP_BATCH)


@celery_app.task(name="agentic.sweep_allowances", base=TesseraTask)
def sweep_allowances() -> int:
    """Settle stale mint reservations (to spent), expire allowances past ``expires_at``, destroy
    credential values their request never took; returns how many rows changed."""
    return (
        in_batches(lambda s: allowance_state.settle_stale_reservations(s, batch=SWEEP_BATCH), SWEEP_BATCH)
        + in_batches(lambda s: allowance_state.expire_allowances(s, batch=SWEEP_BATCH), SWEEP_BATCH)
        + in_batches(lambda s: allowance_state.purge_undelivered(s, batch=SWEEP_BATCH), SWEEP_BATCH)
    )
