"""Payment credentials, the verbs of the API: mint one on an allowance, read it back without its value
(spec 001 sections 4, 7 and 8; the contract is the platform's, written in the OpenAPI description).

A mint reserves its amount (available -> reserved) under the five-minute ``mint`` lease and records
the credential row (``minting``) and its job in one transaction of its own
(:mod:`domain.agentic.units`); the worker (:func:`domain.agentic.allowance_work.perform_mint`) asks the
provider with the credential id as its key and seals the value for the waiting request, which takes
it once (:func:`finish_mint`).
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from dataclasses import dataclass
from decimal import Decimal
from urllib.parse import urlsplit

from sqlmodel import Session

from config.settings import Settings
from domain.agentic import idempotency, leases
from domain.agentic.allowance_state import (
    MINT_MAX_ATTEMPTS,
    MINT_TASK,
    SEALED_PURPOSE,
    Recorded,
    check_payment_method_alive,
    check_usable,
    failure_problem,
    find,
    find_rail,
    job_state,
    not_busy,
    record_job,
    touch,
)
from domain.agentic.allowances import read_allowance
from domain.agentic.errors import agentic_error, validation_error
from domain.agentic.money import money
from domain.agentic.payment_methods import new_id
from domain.agentic.units import commit_unit
from domain.agentic.views import credential_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra.addresses import is_public_address, validate_destination_url
from infra.errors import Problem
from providers.agentic import CREDENTIAL_FORMATS
from storage.crypto import get_keyring
from storage.models_allowances import PaymentCredential
from storage.states import JOB_UNSUCCESSFUL, AllowanceRailStatus, CredentialState, JobStatus
from storage.types import utcnow


@dataclass(frozen=True)
class MintRequest:
    """A validated mint body (the pair, format and mpp presence already checked)."""

    rail: str
    provider: str
    format: str
    amount: Decimal
    currency: str
    mpp: dict | None = None


def format_errors(provider: str, credential_format: str, mpp: dict | None) -> dict[str, list[str]]:
    """The validation errors of a mint's format and ``mpp`` (spec 001 section 4's format table)."""
    formats = CREDENTIAL_FORMATS.get(provider, ())
    if credential_format not in formats:
        return {"format": [f"{provider} mints {', '.join(formats)}"]}
    if credential_format == "mpp" and mpp is None:
        return {"mpp": ["is required for the mpp format"]}
    if credential_format != "mpp" and mpp is not None:
        return {"mpp": ["is only for the mpp format"]}
    return {}


def key_set_url_errors(url: str, *, allow_private: bool) -> list[str]:
    """Messages when ``key_set_url`` is not a safe address for the outbound client: the form rules of
    ``infra/http.py`` and, for an address written as an IP, a public one (host names are vetted by
    the client's resolver when the key set is fetched)."""
    error = validate_destination_url(url)
    if error:
        return [error]
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host == "localhost" and not allow_private:
            return ["must be a public address"]
        return []
    if not allow_private and not is_public_address(address):
        return ["must be a public address"]
    return []


def start_mint(
    session: Session,
    caller: Caller,
    allowance_id: str,
    request: MintRequest,
    *,
    settings: Settings,
    claim: idempotency.Claim | None = None,
) -> Recorded:
    """``POST /agentic/allowances/{id}/credentials``, the recording part: the reservation.

    Raises, in this order, 404 ``ALLOWANCE_NOT_FOUND``, 409 ``ALLOWANCE_CREDENTIAL_IN_PROGRESS`` (a
    mint holds the allowance; other operations' codes likewise), 400 ``ALLOWANCE_CANCELLED`` /
    ``ALLOWANCE_EXPIRED``, ``PAYMENT_METHOD_DELETED``, ``RAIL_NOT_FOUND``, ``RAIL_NOT_ACTIVE``,
    ``VALIDATION_ERROR`` (another currency), ``ALLOWANCE_AMOUNT_EXCEEDED``. Then takes the
    five-minute ``mint`` lease (owner: the credential id), moves the amount available -> reserved,
    writes the credential row (``minting``) and its job, in one transaction.
    """
    allowance = find(session, caller.tenant_id, allowance_id)
    not_busy(session, allowance)
    check_usable(allowance)
    check_payment_method_alive(session, allowance)
    target = find_rail(session, allowance, request.rail, request.provider)
    if target.status != AllowanceRailStatus.ACTIVE:
        raise agentic_error("RAIL_NOT_ACTIVE")
    if request.currency != allowance.currency:
        raise validation_error({"amount.currency": [f"must be the allowance's currency, {allowance.currency}"]})
    if request.amount > allowance.amount_available:
        available = money(allowance.amount_available, allowance.currency)
        raise agentic_error(
            "ALLOWANCE_AMOUNT_EXCEEDED",
            f"At most {available['value']} {allowance.currency} is available.",
            extra={"amount_available": available},
        )
    credential = PaymentCredential(
        id=new_id("pcr_"),
        tenant_id=caller.tenant_id,
        allowance_id=allowance.id,
        rail=target.rail,
        provider=target.provider,
        format=request.format,
        currency=request.currency,
        amount=request.amount,
        mpp=request.mpp,
        created_at=utcnow(),
    )
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=allowance.id,
        operation=leases.MINT,
        owner=credential.id,
        seconds=settings.operation_lease_seconds,
    )
    allowance.amount_available -= request.amount
    allowance.amount_reserved += request.amount
    allowance.reserved_by = credential.id
    touch(session, allowance)
    session.add(credential)
    session.flush()
    job = record_job(
        session, caller, MINT_TASK, "payment_credential", credential.id, credential.id, max_attempts=MINT_MAX_ATTEMPTS
    )
    credential.job_id = job.id
    session.add(credential)
    if claim is not None:
        idempotency.attach(session, claim, credential.id)
    audit.record(session, caller, entity_type="payment_credential", entity_id=credential.id, operation="create")
    return Recorded(credential.id, (job.id,))


def mint_unit(
    caller: Caller, allowance_id: str, request: MintRequest, *, settings: Settings, claim: idempotency.Claim | None
) -> Recorded:
    """:func:`start_mint` in its own transaction (see :func:`domain.agentic.units.commit_unit`)."""
    return commit_unit(start_mint, caller, allowance_id, request, settings=settings, claim=claim)


def finish_mint(
    session: Session, caller: Caller, credential_id: str, job_id: uuid.UUID, claim: idempotency.Claim | None
) -> dict | Problem:
    """After the bounded wait: the credential with its value (taken out of its sealed copy, which is
    cleared: it is returned this once), or the failure's problem (recorded on the key for replay),
    ``CREDENTIAL_OUTCOME_UNKNOWN`` (the key terminal), or 409 ``ALLOWANCE_CREDENTIAL_IN_PROGRESS``
    while the mint runs. Problems are returned, not raised, so that the key's settling commits."""
    row = session.get(PaymentCredential, credential_id, with_for_update=True, populate_existing=True)
    status, result = job_state(session, job_id)
    if row is not None and row.state == CredentialState.ISSUED:
        value = None
        if row.sealed is not None:
            value = json.loads(get_keyring().decrypt(session, row.tenant_id, SEALED_PURPOSE, row.id, row.sealed))
            row.sealed = None
            session.add(row)
        if claim is not None:
            idempotency.succeed(session, claim)
        if value is None:
            return agentic_error("CREDENTIAL_PAYLOAD_UNAVAILABLE")
        return credential_view(row, value)
    if status in JOB_UNSUCCESSFUL:
        if result.get("code") == "CREDENTIAL_OUTCOME_UNKNOWN" or status == JobStatus.DEAD:
            if claim is not None:
                idempotency.unknown(session, claim)
            return agentic_error("CREDENTIAL_OUTCOME_UNKNOWN")
        problem = failure_problem(result, "PROVIDER_CREDENTIALS_FAILED")
        if claim is not None:
            idempotency.fail(session, claim, problem)
        return problem
    if row is None:  # settled as stale: the outcome cannot be told
        if claim is not None:
            idempotency.unknown(session, claim)
        return agentic_error("CREDENTIAL_OUTCOME_UNKNOWN")
    return agentic_error("ALLOWANCE_CREDENTIAL_IN_PROGRESS")


def read_credential(session: Session, caller: Caller, allowance_id: str, credential_id: str) -> dict:
    """``GET /agentic/allowances/{id}/credentials/{credential_id}``: everything but the value; 404
    ``ALLOWANCE_NOT_FOUND`` or ``PAYMENT_CREDENTIAL_NOT_FOUND`` (also for a mint that did not issue)."""
    read_allowance(session, caller, allowance_id)
    row = session.get(PaymentCredential, credential_id)
    if row is None or row.allowance_id != allowance_id or row.state != CredentialState.ISSUED:
        raise agentic_error("PAYMENT_CREDENTIAL_NOT_FOUND")
    return credential_view(row)
