"""Wallet tasks (``wallets.*``, routed to the ``providers`` queue): a domain's verification and
registration, its removal at the provider, and merchant sessions. Thin shells: the work is in
:mod:`domain.wallets.domains`.
"""

from __future__ import annotations

from domain.wallets import domains
from infra.celery import celery_app
from infra.task import JobTask


class _WalletJob(JobTask):
    """A job making at most one fetch and one provider call: its lease covers their timeouts."""

    abstract = True
    #: Seconds a worker holds the job: a fetch and a call plus 10 s.
    lease_seconds = 10.0
    lease_settings = {
        "webhook_timeout_seconds": 2.0,
        "provider_connect_timeout_seconds": 1.0,
        "provider_read_timeout_seconds": 1.0,
    }


class RegisterDomain(_WalletJob):
    """Verify a domain's association file and register it (job subject: the domain row id)."""

    name = domains.REGISTER_TASK

    def perform(self, job, inputs):
        """The fetch and the provider call (:func:`domain.wallets.domains.perform_registration`)."""
        return domains.perform_registration(job)

    def apply(self, session, job, outcome):
        """Mark the domain verified (:func:`domain.wallets.domains.apply_registration`)."""
        return domains.apply_registration(session, job, outcome)

    def on_job_failure(self, session, job, error):
        """Forget the domain (:func:`domain.wallets.domains.registration_failed`)."""
        domains.registration_failed(session, job)


class RemoveDomain(_WalletJob):
    """Tell the provider a domain was removed (job subject: the domain name)."""

    name = domains.REMOVE_TASK

    def perform(self, job, inputs):
        """The provider call (:func:`domain.wallets.domains.perform_removal`)."""
        return domains.perform_removal(job)

    def apply(self, session, job, outcome):
        """Nothing to write."""
        return {}


class MerchantSession(_WalletJob):
    """Ask the gateway for a merchant session (job subject: the session request row id)."""

    name = domains.SESSION_TASK

    def perform(self, job, inputs):
        """The gateway call (:func:`domain.wallets.domains.perform_session`)."""
        return domains.perform_session(job)

    def apply(self, session, job, outcome):
        """Seal the answer for the waiting request (:func:`domain.wallets.domains.apply_session`)."""
        return domains.apply_session(session, job, outcome)


celery_app.register_task(RegisterDomain())
celery_app.register_task(RemoveDomain())
celery_app.register_task(MerchantSession())
