"""Tasks of enrichments (``enrichments.*``, routed to the ``providers`` queue).

``enrichments.bank_account_verify`` is a :class:`infra.task.JobTask` running one recorded job:
``perform`` asks the bank verification provider (outside any transaction, the job id as idempotency
key), ``apply`` writes ``{status}`` as the job result, read by the waiting request
(:mod:`domain.enrichments.bank_accounts`).
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from domain.enrichments import bank_accounts
from infra.celery import celery_app
from infra.task import JobTask
from storage.db import session_scope
from storage.models import Job


class VerifyBankAccount(JobTask):
    """``enrichments.bank_account_verify``: one verification; the lease follows
    ``TESSERA_JOB_LEASE_SECONDS`` (longer than the provider's connect + read timeouts)."""

    name = bank_accounts.VERIFY_TASK
    lease_seconds = 0.0
    lease_settings = {"job_lease_seconds": 1.0}
    backoff_base = 1.0

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The provider's status (None: the token is gone)."""
        with session_scope() as session:
            found = bank_accounts.verify_input(session, job)
        if found is None:
            return None
        verifier, routing_number, account_number = found
        return verifier.verify(routing_number, account_number, idempotency_key=str(job.id))

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.enrichments.bank_accounts.apply_verification`."""
        return bank_accounts.apply_verification(outcome)


celery_app.register_task(VerifyBankAccount())
