"""Bank account verification: ``POST /enrichments/bank-account-verify`` (a decision beyond the spec,
for the official client libraries): does the account of a ``bank`` token take debits?

The call to the provider runs in a worker like every provider call: the API records an
``enrichments.bank_account_verify`` job whose subject is the token (the task reads the token's data
itself; its arguments are the job id only), waits for its outcome (``TESSERA_NETWORK_TOKEN_WAIT_SECONDS``,
the bound of every waited provider call) and answers ``{status}``: ``enabled``, ``disabled`` or
``error`` as the provider said. The job result holds only that status. Permission:
:data:`PERMISSION`. Every verification writes a ``use`` log row on the token.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlmodel import Session

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tokens.service import load_token_data
from infra import jobs
from infra.errors import Problem, validation_problem
from providers import ProviderNotConfigured
from providers.bank_verification import PROVIDER_NAME, BankVerifier, bank_verifier_for
from storage.models import Job, Tenant

VERIFY_TASK = "enrichments.bank_account_verify"
#: The hosted service's ``token:use`` for bank tokens, in this permission model.
PERMISSION = "token:bank:use:proxy"
#: Attempts of a verification (its caller waits for it).
MAX_ATTEMPTS = 3
SUBJECT = "token"
ENTITY_TYPE = "token"


@dataclass(frozen=True)
class Started:
    """A verification recorded as a job."""

    job_id: uuid.UUID


def verify_start(session: Session, caller: Caller, token_id: str) -> Started:
    """Record the verification of the ``bank`` token ``token_id``: 404 when it does not exist (or is
    another tenant's, or expired); 400 at ``token_id`` when it is not a ``bank`` token; 422 when the
    tenant's provider is not configured (production)."""
    bank_verifier_for(caller.tenant_type)  # a production tenant without a provider: 422 before any work
    token, _data = load_token_data(session, caller.tenant_id, token_id)
    if token.type != "bank":
        raise validation_problem({"token_id": [f"must be a bank token (this one is of type {token.type})"]})
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="use")
    job = jobs.record(
        session,
        kind=VERIFY_TASK,
        tenant_id=caller.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token.id),
        trace_id=caller.trace_id,
        max_attempts=MAX_ATTEMPTS,
    )
    return Started(job.id)


def verify_input(session: Session, job: Job) -> tuple[BankVerifier, str, str] | None:
    """The adapter and the ``(routing_number, account_number)`` the job verifies; None when the token
    is gone. Raises ``ProviderNotConfigured`` (permanent) for a production tenant."""
    if job.tenant_id is None or job.subject_id is None:  # recorded by verify_start with both: a token never found
        return None
    tenant = session.get(Tenant, job.tenant_id)
    try:
        _token, data = load_token_data(session, job.tenant_id, job.subject_id)
    except Problem:
        return None
    return (
        bank_verifier_for(tenant.type if tenant is not None else None),
        data["routing_number"],
        data["account_number"],
    )


def apply_verification(status: str | None) -> dict:
    """The job result: ``{"status": <the provider's>}``, or ``{"skipped": true}`` when the token was gone."""
    return {"status": status} if status is not None else {"skipped": True}


def verify_outcome(session: Session, started: Started) -> dict:
    """After the bounded wait: ``{status}``, or a problem (404 the token went away meanwhile, 422 the
    provider is not configured, 502 it refused or failed, 504 it did not answer in time; the job is
    then cancelled unless it is running). Raises ``LookupError`` when the job row is gone (never
    within a wait)."""
    job = session.get(Job, started.job_id, populate_existing=True)
    if job is None:  # recorded by this request's verify_start; job rows outlive any wait
        raise LookupError(f"the verification job {started.job_id} is gone")
    result = job.result or {}
    if job.status == "succeeded" and result.get("status"):
        return {"status": result["status"]}
    if job.status == "succeeded":
        raise Problem(404, "The token was deleted while it was being verified.", title="Not Found")
    if job.status in ("failed", "dead"):
        if result.get("code") == "PROVIDER_NOT_CONFIGURED":
            raise ProviderNotConfigured(PROVIDER_NAME)
        raise Problem(
            502,
            "The bank account verification provider did not give an answer.",
            title="Verification unavailable",
            extra={"code": result.get("code") or "provider_unavailable"},
        )
    jobs.cancel_if_queued(session, job.id)
    raise Problem(
        504,
        "The bank account verification provider did not answer in time; retry.",
        title="Verification unavailable",
        extra={"code": "provider_timeout"},
    )
