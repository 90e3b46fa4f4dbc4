"""Allowances and payment credentials: the API side (spec 001 sections 3, 7 and 8; the contract of the
allowance endpoints is the platform's, written in the OpenAPI description).

Each function here runs in one transaction of the API (``fn(session, ...)``), records the jobs the
workers run (:mod:`domain.agentic.allowance_work`, ``tasks/agentic.py``) and never calls a provider.
Every writer locks the allowance row first, so the operations on one allowance are serialised; an
operation that calls providers holds the allowance's operation lease (``domain/agentic/leases.py``)
until its job ends, which answers the ``409 ALLOWANCE_..._IN_PROGRESS`` problems.

Money: the four amounts are exact decimals in the allowance's currency (``NUMERIC(19, 4)``; the
database enforces ``available + reserved + spent = amount``). A mint moves its amount available ->
reserved under the five-minute ``mint`` lease (one mint at a time) before any provider call; the
worker then moves it reserved -> spent with the credential, or back to available on a conclusive
failure, or to spent on an unknown outcome. A reservation whose lease went stale (its worker died)
becomes spent on the next mint, update, cancellation or verification (:func:`settle_stale`) and in
the beat sweep (:func:`settle_stale_reservations`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import uuid
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urlsplit

from babel.numbers import get_currency_precision, list_currencies
from sqlalchemy import delete, update
from sqlmodel import Session, col, select

from config.settings import Settings
from domain.agentic import idempotency, leases
from domain.agentic import payment_methods as pm_service
from domain.agentic.errors import agentic_error, validation_error
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.webhooks import events
from infra import jobs
from infra.addresses import is_public_address, validate_destination_url
from infra.errors import Problem
from providers.agentic import CREDENTIAL_FORMATS, provider_for
from storage.crypto import get_keyring
from storage.keyset import keyset_page
from storage.models import Job
from storage.models_agentic import PaymentMethod, ProviderError
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from storage.states import (
    ALLOWANCE_LIVE,
    JOB_UNSUCCESSFUL,
    AllowanceRailStatus,
    AllowanceStatus,
    CredentialState,
    JobStatus,
    PaymentMethodStatus,
    RailStatus,
)
from storage.types import utcnow

ENTITY_TYPE = "allowance"
ALLOWANCE_EVENT = "agentic.allowance.updated"
CREDENTIAL_EVENT = "agentic.credential.created"

SETUP_TASK = "agentic.set_up_allowance_rail"
UPDATE_TASK = "agentic.update_allowance"
VERIFY_TASK = "agentic.verify_allowance_rail"
CANCEL_TASK = "agentic.cancel_allowance"
MINT_TASK = "agentic.mint_credential"
PROVIDER_MAX_ATTEMPTS = 4
#: A mint is asked again (same key) on transient failures this many times in all.
MINT_MAX_ATTEMPTS = 3

DEFAULT_LIFETIME = dt.timedelta(days=30)
MAX_LIFETIME = dt.timedelta(days=365)
MAX_DESCRIPTION = 1000
MAX_SCALE = 4
MAX_INTEGER_DIGITS = 15
#: A minted credential's value waits (encrypted) this long for its request to take it, then is purged.
UNDELIVERED_SECONDS = 600
SEALED_PURPOSE = "agentic-payment-credential"
OTP_PURPOSE = "agentic-allowance-otp"
LIVE = ALLOWANCE_LIVE
CURRENCIES = frozenset(c for c in list_currencies() if c.isalpha() and len(c) == 3)


# ---- money ---------------------------------------------------------------------------------------


def currency_errors(currency: Any) -> list[str]:
    """Messages when ``currency`` is not an ISO 4217 code (upper case)."""
    if not isinstance(currency, str) or currency not in CURRENCIES:
        return ["must be an ISO 4217 currency code, like USD"]
    return []


def parse_money(value: Any, currency: str) -> tuple[Decimal | None, list[str]]:
    """``(Decimal, [])`` for a positive exact amount in ``currency`` (a decimal string, or a JSON
    number read as its shortest decimal), else ``(None, messages)``: at most the currency's minor
    unit digits (USD 2, JPY 0, BHD 3; never more than 4) and 15 integer digits."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None, ['must be a decimal string, like "25.00"']
    text = value.strip() if isinstance(value, str) else repr(value)
    try:
        amount = Decimal(text)
    except InvalidOperation:
        return None, ['must be a decimal string, like "25.00"']
    if not amount.is_finite() or "e" in text.lower():
        return None, ['must be a plain decimal string, like "25.00"']
    if amount <= 0:
        return None, ["must be greater than 0"]
    scale = min(MAX_SCALE, get_currency_precision(currency)) if currency in CURRENCIES else MAX_SCALE
    if -amount.as_tuple().exponent > scale:
        return None, [f"{currency} takes at most {scale} decimals"]
    if amount.adjusted() >= MAX_INTEGER_DIGITS:
        return None, [f"must have at most {MAX_INTEGER_DIGITS} integer digits"]
    return amount, []


def money(value: Decimal, currency: str) -> dict[str, str]:
    """``{"value": "25.00", "currency": "USD"}``: exact, with the currency's minor unit digits."""
    scale = min(MAX_SCALE, get_currency_precision(currency))
    quantized = Decimal(value).quantize(Decimal(1).scaleb(-scale))
    return {"value": format(quantized, "f"), "currency": currency}


# ---- views ---------------------------------------------------------------------------------------


def effective_status(allowance: Allowance, now: dt.datetime | None = None) -> AllowanceStatus:
    """The status a client sees: a live allowance past ``expires_at`` is ``expired`` even before the
    expiry sweep writes it."""
    if allowance.status in LIVE and allowance.expires_at <= (now or utcnow()):
        return AllowanceStatus.EXPIRED
    return allowance.status


def rail_view(rail: AllowanceRail) -> dict:
    """``{rail, provider, status: active | inactive | error, error?: {code}, provider_ids}``; a rail
    still being set up shows ``inactive``."""
    view: dict[str, Any] = {
        "rail": rail.rail,
        "provider": rail.provider,
        "status": AllowanceRailStatus.INACTIVE if rail.status == AllowanceRailStatus.SETTING_UP else rail.status,
        "provider_ids": dict(rail.provider_ids or {}),
    }
    if rail.status == AllowanceRailStatus.ERROR:
        view["error"] = {"code": rail.error_code or "PROVIDER_ALLOWANCE_FAILED"}
    return view


def allowance_view(allowance: Allowance, rails: list[AllowanceRail]) -> dict:
    """The allowance object (see the OpenAPI description of ``POST /agentic/allowances``)."""
    currency = allowance.currency
    return {
        "id": allowance.id,
        "payment_method_id": allowance.payment_method_id,
        "status": effective_status(allowance),
        "amount": money(allowance.amount, currency),
        "amount_available": money(allowance.amount_available, currency),
        "amount_reserved": money(allowance.amount_reserved, currency),
        "amount_spent": money(allowance.amount_spent, currency),
        "description": allowance.description,
        "expires_at": allowance.expires_at,
        "rails": [rail_view(r) for r in sorted(rails, key=lambda r: r.position)],
        "created_at": allowance.created_at,
        "updated_at": allowance.updated_at,
    }


def credential_view(row: PaymentCredential, credential: dict | None = None) -> dict:
    """The payment credential object; ``credential`` (the value) only in the mint's own answer."""
    view: dict[str, Any] = {
        "id": row.id,
        "allowance_id": row.allowance_id,
        "rail": row.rail,
        "provider": row.provider,
        "format": row.format,
        "amount": money(row.amount, row.currency),
    }
    if credential is not None:
        view["credential"] = credential
    view["expires_at"] = row.expires_at
    view["created_at"] = row.created_at
    return view


def rails_of(session: Session, allowance_id: str) -> list[AllowanceRail]:
    """The rails of an allowance, in their order (fresh from the database)."""
    return list(
        session.exec(
            select(AllowanceRail)
            .where(AllowanceRail.allowance_id == allowance_id)
            .order_by(col(AllowanceRail.position))
            .execution_options(populate_existing=True)
        ).all()
    )


def view_of(session: Session, allowance: Allowance) -> dict:
    """The allowance object of a loaded row."""
    return allowance_view(allowance, rails_of(session, allowance.id))


# ---- shared pieces (api and workers) -------------------------------------------------------------


def find(session: Session, tenant_id: uuid.UUID, allowance_id: str) -> Allowance:
    """The tenant's allowance locked for update, else 404 ``ALLOWANCE_NOT_FOUND``."""
    row = session.exec(
        select(Allowance)
        .where(Allowance.id == allowance_id, Allowance.tenant_id == tenant_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if row is None:
        raise agentic_error("ALLOWANCE_NOT_FOUND")
    return row


def lock(session: Session, allowance_id: str) -> Allowance | None:
    """The allowance locked for update (every writer takes this lock first), or None."""
    return session.exec(
        select(Allowance)
        .where(Allowance.id == allowance_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()


def touch(session: Session, allowance: Allowance) -> None:
    """Something a client sees changed: updated_at moves."""
    allowance.updated_at = utcnow()
    session.add(allowance)


def set_status(session: Session, allowance: Allowance, status: AllowanceStatus, *, trace_id: str | None = None) -> None:
    """Set the status; a change moves updated_at and emits ``agentic.allowance.updated``
    (``{allowance: {id, status}}``)."""
    if allowance.status == status:
        return
    allowance.status = status
    touch(session, allowance)
    events.emit(
        session,
        tenant_id=allowance.tenant_id,
        type=ALLOWANCE_EVENT,
        data={"allowance": {"id": allowance.id, "status": status}},
        trace_id=trace_id,
    )


def recompute_status(session: Session, allowance: Allowance, *, trace_id: str | None = None) -> None:
    """A live allowance is ``pending_verification`` while a rail is being set up or awaits
    verification, else ``active`` (rails in error do not hold it back)."""
    if allowance.status not in LIVE:
        return
    waiting = any(
        r.status in (AllowanceRailStatus.SETTING_UP, AllowanceRailStatus.INACTIVE)
        for r in rails_of(session, allowance.id)
    )
    set_status(
        session,
        allowance,
        AllowanceStatus.PENDING_VERIFICATION if waiting else AllowanceStatus.ACTIVE,
        trace_id=trace_id,
    )


def settle_stale(session: Session, allowance: Allowance) -> bool:
    """A reservation whose mint lease is stale (its worker died) becomes spent, and its mint records
    no credential (spec 001 section 7, Unknown outcome). Called with the allowance locked; True when
    it settled one."""
    if allowance.amount_reserved <= 0:
        return False
    lease = leases.held(session, allowance.id)
    if lease is not None and lease.operation == leases.MINT and lease.owner == allowance.reserved_by:
        return False
    if allowance.reserved_by:
        session.execute(
            delete(PaymentCredential)
            .where(
                col(PaymentCredential.id) == allowance.reserved_by,
                col(PaymentCredential.state) == CredentialState.MINTING,
            )
            .execution_options(synchronize_session=False)
        )
        if lease is not None:
            leases.release(session, allowance.id, lease.owner)
    allowance.amount_spent += allowance.amount_reserved
    allowance.amount_reserved = Decimal(0)
    allowance.reserved_by = None
    touch(session, allowance)
    return True


def _not_busy(session: Session, allowance: Allowance) -> None:
    """Settle a stale reservation, then 409 with the in-progress code of an operation in flight
    (``ALLOWANCE_CREDENTIAL_IN_PROGRESS``, ``..._UPDATE_...``, ``..._VERIFICATION_...``,
    ``..._DELETE_IN_PROGRESS``)."""
    settle_stale(session, allowance)
    lease = leases.held(session, allowance.id)
    if lease is not None:
        raise leases.in_progress(lease)


def _usable(allowance: Allowance) -> None:
    """400 ``ALLOWANCE_CANCELLED`` (also while a cancellation runs or stopped half-way) or
    ``ALLOWANCE_EXPIRED``."""
    if allowance.status == AllowanceStatus.CANCELLED or allowance.delete_requested_at is not None:
        raise agentic_error("ALLOWANCE_CANCELLED")
    if effective_status(allowance) == AllowanceStatus.EXPIRED:
        raise agentic_error("ALLOWANCE_EXPIRED")


def _rail(session: Session, allowance: Allowance, rail: str, provider: str) -> AllowanceRail:
    target = next((r for r in rails_of(session, allowance.id) if r.rail == rail and r.provider == provider), None)
    if target is None:
        raise agentic_error("RAIL_NOT_FOUND", f"The allowance has no {rail} rail with {provider}.")
    return target


def _payment_method_alive(session: Session, allowance: Allowance) -> None:
    pm = session.get(PaymentMethod, allowance.payment_method_id, populate_existing=True)
    if pm is None or pm.status == PaymentMethodStatus.DELETED or pm.delete_requested_at is not None:
        raise agentic_error("PAYMENT_METHOD_DELETED", "The payment method behind this allowance is deleted.")


def _record_job(
    session: Session,
    caller: Caller,
    kind: str,
    subject_type: str,
    subject_id: str,
    owner: str,
    max_attempts: int = PROVIDER_MAX_ATTEMPTS,
) -> Job:
    return jobs.record(
        session,
        kind=kind,
        tenant_id=caller.tenant_id,
        subject_type=subject_type,
        subject_id=subject_id,
        operation_id=owner,
        trace_id=caller.trace_id,
        max_attempts=max_attempts,
    )


@dataclass(frozen=True)
class Recorded:
    """What an operation recorded: the allowance (or credential) and the jobs to wait for."""

    resource_id: str
    job_ids: tuple[uuid.UUID, ...] = ()


def job_state(session: Session, job_id: uuid.UUID) -> tuple[str, dict]:
    """``(status, result)`` of a job (fresh from the database)."""
    job = session.get(Job, job_id, populate_existing=True)
    return (job.status, dict(job.result or {})) if job is not None else ("dead", {})


def failure_problem(result: dict, fallback: str) -> Problem:
    """The problem of a failed job: its catalogue code (``fallback`` when it has none), with
    ``attempts_remaining`` for INVALID_OTP."""
    code = result.get("code") or fallback
    extra = {"attempts_remaining": result["attempts_remaining"]} if "attempts_remaining" in result else None
    try:
        return agentic_error(code, extra=extra)
    except KeyError:
        return agentic_error(fallback)


# ---- create --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateRequest:
    """A validated create body: amounts already parsed, ``expires_at`` None for the default."""

    payment_method_id: str
    amount: Decimal
    currency: str
    description: str | None
    expires_at: dt.datetime | None


def expiry_errors(expires_at: dt.datetime, now: dt.datetime) -> list[str]:
    """Messages when ``expires_at`` is not in the future or more than a year away."""
    if expires_at <= now:
        return ["must be in the future"]
    if expires_at > now + MAX_LIFETIME:
        return ["must be at most a year away"]
    return []


def create_allowance(
    session: Session,
    caller: Caller,
    request: CreateRequest,
    *,
    settings: Settings,
    owner: str,
    claim: idempotency.Claim | None = None,
) -> Recorded:
    """``POST /agentic/allowances``, the recording part (one transaction).

    Raises 404 ``PAYMENT_METHOD_NOT_FOUND``, 400 ``PAYMENT_METHOD_DELETED``, 400 ``NO_ACTIVE_RAILS``
    (no enabled rail), 400 ``VALIDATION_ERROR`` (``expires_at``). Writes the allowance, one rail per
    enabled payment method rail and one setup job per rail under a ``setup`` lease.
    """
    pm = pm_service.find(session, caller.tenant_id, request.payment_method_id, lock=True)
    if pm.status == PaymentMethodStatus.DELETED or pm.delete_requested_at is not None:
        raise agentic_error("PAYMENT_METHOD_DELETED")
    enabled = [r for r in pm_service.rails_of(session, pm.id) if r.status == RailStatus.ENABLED]
    if not enabled:
        raise agentic_error("NO_ACTIVE_RAILS")
    now = utcnow()
    expires_at = request.expires_at or now + DEFAULT_LIFETIME
    errors = expiry_errors(expires_at, now)
    if errors:
        raise validation_error({"expires_at": errors})
    allowance = Allowance(
        id=pm_service.new_id("alw_"),
        tenant_id=caller.tenant_id,
        payment_method_id=pm.id,
        status=AllowanceStatus.PENDING_VERIFICATION,
        currency=request.currency,
        amount=request.amount,
        amount_available=request.amount,
        amount_reserved=Decimal(0),
        amount_spent=Decimal(0),
        description=request.description,
        expires_at=expires_at,
        idempotency_key=claim.key if claim else None,
        created_by=caller.application_id,
        created_at=now,
        updated_at=now,
    )
    session.add(allowance)
    session.flush()
    job_ids = []
    for position, pm_rail in enumerate(enabled):
        rail = AllowanceRail(
            tenant_id=caller.tenant_id,
            allowance_id=allowance.id,
            position=position,
            rail=pm_rail.rail,
            provider=pm_rail.provider,
            enrollment_id=pm_rail.enrollment_id,
            created_at=now,
            updated_at=now,
        )
        if provider_for(pm_rail.provider, caller.tenant_type, settings) is None:
            rail.status, rail.error_code = AllowanceRailStatus.ERROR, "PROVIDER_NOT_CONFIGURED"
            pm_service.record_provider_error(session, rail, code="PROVIDER_NOT_CONFIGURED", operation="allowance")
        else:
            job = _record_job(session, caller, SETUP_TASK, "allowance_rail", str(rail.id), owner)
            rail.job_id = job.id
            job_ids.append(job.id)
        session.add(rail)
    session.flush()
    if job_ids:
        leases.acquire(
            session,
            tenant_id=caller.tenant_id,
            resource_id=allowance.id,
            operation=leases.SETUP,
            owner=owner,
            seconds=settings.operation_lease_seconds,
        )
    else:
        recompute_status(session, allowance, trace_id=caller.trace_id)
    if claim is not None:
        idempotency.attach(session, claim, allowance.id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=allowance.id, operation="create")
    return Recorded(allowance.id, tuple(job_ids))


def create_unit(
    caller: Caller, request: CreateRequest, *, settings: Settings, owner: str, claim: idempotency.Claim | None
) -> Recorded:
    """:func:`create_allowance` in its own transaction (see :func:`payment_methods.commit_unit`)."""
    return pm_service.commit_unit(create_allowance, caller, request, settings=settings, owner=owner, claim=claim)


def finish_create(session: Session, caller: Caller, allowance_id: str, *, claim: idempotency.Claim | None) -> dict:
    """After the bounded wait: settle the idempotency record and answer the allowance."""
    allowance = find(session, caller.tenant_id, allowance_id)
    if claim is not None:
        idempotency.succeed(session, claim)
    return view_of(session, allowance)


# ---- read, list, errors --------------------------------------------------------------------------


def read_allowance(session: Session, caller: Caller, allowance_id: str) -> dict:
    """``GET /agentic/allowances/{id}``: 404 ``ALLOWANCE_NOT_FOUND`` when absent in the tenant."""
    row = session.exec(
        select(Allowance).where(Allowance.id == allowance_id, Allowance.tenant_id == caller.tenant_id)
    ).first()
    if row is None:
        raise agentic_error("ALLOWANCE_NOT_FOUND")
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=row.id, operation="read")
    return view_of(session, row)


def list_allowances(
    session: Session,
    caller: Caller,
    *,
    size: int,
    after: dict | None,
    payment_method_id: str | None,
    status: AllowanceStatus | None,
) -> tuple[list[dict], dict | None]:
    """``GET /agentic/allowances``: newest first (created_at, id), filtered by payment method and
    status (as stored; ``expired`` also matches live allowances past their expiry)."""
    query = select(Allowance).where(Allowance.tenant_id == caller.tenant_id)
    if payment_method_id is not None:
        query = query.where(Allowance.payment_method_id == payment_method_id)
    now = utcnow()
    if status == AllowanceStatus.EXPIRED:
        query = query.where(
            (Allowance.status == AllowanceStatus.EXPIRED)
            | (col(Allowance.status).in_(LIVE) & (col(Allowance.expires_at) <= now))
        )
    elif status in LIVE:
        query = query.where(Allowance.status == status, Allowance.expires_at > now)
    elif status is not None:
        query = query.where(Allowance.status == status)
    rows, next_position = keyset_page(
        session, query, order=(Allowance.created_at, Allowance.id), size=size, after=after
    )
    rails: dict[str, list[AllowanceRail]] = {}
    if rows:
        wanted = [a.id for a in rows]
        for rail in session.exec(select(AllowanceRail).where(col(AllowanceRail.allowance_id).in_(wanted))):
            rails.setdefault(rail.allowance_id, []).append(rail)
    return [allowance_view(a, rails.get(a.id, [])) for a in rows], next_position


def list_provider_errors(
    session: Session, caller: Caller, allowance_id: str, *, size: int, after: dict | None
) -> tuple[list[dict], dict | None]:
    """``GET /agentic/allowances/{id}/errors``: the allowance's provider errors, newest first."""
    row = session.exec(
        select(Allowance.id).where(Allowance.id == allowance_id, Allowance.tenant_id == caller.tenant_id)
    ).first()
    if row is None:
        raise agentic_error("ALLOWANCE_NOT_FOUND")
    return pm_service.provider_error_page(
        session, caller.tenant_id, ProviderError.allowance_id == allowance_id, size=size, after=after
    )


def read_credential(session: Session, caller: Caller, allowance_id: str, credential_id: str) -> dict:
    """``GET /agentic/allowances/{id}/credentials/{credential_id}``: everything but the value; 404
    ``ALLOWANCE_NOT_FOUND`` or ``PAYMENT_CREDENTIAL_NOT_FOUND`` (also for a mint that did not issue)."""
    read_allowance(session, caller, allowance_id)
    row = session.get(PaymentCredential, credential_id)
    if row is None or row.allowance_id != allowance_id or row.state != CredentialState.ISSUED:
        raise agentic_error("PAYMENT_CREDENTIAL_NOT_FOUND")
    return credential_view(row)


# ---- update --------------------------------------------------------------------------------------


def start_update(
    session: Session, caller: Caller, allowance_id: str, changes: dict, *, settings: Settings, owner: str
) -> Recorded:
    """``PATCH /agentic/allowances/{id}``, the recording part. ``changes``: any of ``amount``
    (``(Decimal, currency)``), ``description`` (None clears it), ``expires_at``.

    Raises 404 ``ALLOWANCE_NOT_FOUND``, 409 (the lease of an operation in flight), 400
    ``ALLOWANCE_CANCELLED`` / ``ALLOWANCE_EXPIRED``, 400 ``VALIDATION_ERROR`` (another currency, an amount below
    reserved plus spent, an expiry not in the coming year). The values wait in ``pending_update``
    for the worker: the row changes only when every provider agreed.
    """
    allowance = find(session, caller.tenant_id, allowance_id)
    _not_busy(session, allowance)
    _usable(allowance)
    errors: dict[str, list[str]] = {}
    pending: dict[str, Any] = {}
    if "amount" in changes:
        value, currency = changes["amount"]
        if currency != allowance.currency:
            errors["amount.currency"] = [f"must be the allowance's currency, {allowance.currency}"]
        elif value < allowance.amount_reserved + allowance.amount_spent:
            used = money(allowance.amount_reserved + allowance.amount_spent, allowance.currency)["value"]
            errors["amount.value"] = [f"must be at least what is reserved plus spent, {used}"]
        else:
            pending["amount"] = format(value, "f")
    if "expires_at" in changes:
        messages = expiry_errors(changes["expires_at"], utcnow())
        if messages:
            errors["expires_at"] = messages
        else:
            pending["expires_at"] = changes["expires_at"].isoformat()
    if "description" in changes:
        pending["description"] = changes["description"]
    if errors:
        raise validation_error(errors)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=allowance.id, operation="update")
    if not pending:
        return Recorded(allowance.id)
    allowance.pending_update = pending
    allowance.operation = leases.UPDATE
    session.add(allowance)
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=allowance.id,
        operation=leases.UPDATE,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    job = _record_job(session, caller, UPDATE_TASK, "allowance", allowance.id, owner)
    return Recorded(allowance.id, (job.id,))


def finish_update(session: Session, caller: Caller, allowance_id: str, job_ids: tuple[uuid.UUID, ...]) -> dict:
    """After the bounded wait: the allowance (200), or 422 ``PROVIDER_ALLOWANCE_UPDATE_FAILED``, or
    409 ``ALLOWANCE_UPDATE_IN_PROGRESS`` while the update runs."""
    allowance = find(session, caller.tenant_id, allowance_id)
    for job_id in job_ids:
        status, result = job_state(session, job_id)
        if status in JOB_UNSUCCESSFUL:
            raise failure_problem(result, "PROVIDER_ALLOWANCE_UPDATE_FAILED")
        if status not in jobs.TERMINAL:
            raise agentic_error("ALLOWANCE_UPDATE_IN_PROGRESS")
    return view_of(session, allowance)


# ---- verification --------------------------------------------------------------------------------


def start_verification(
    session: Session,
    caller: Caller,
    allowance_id: str,
    *,
    rail: str,
    provider: str,
    action: str,
    otp: str | None,
    settings: Settings,
    owner: str,
) -> Recorded:
    """``POST /agentic/allowances/{id}/rails/verify``, the recording part (the pair is known valid).

    Raises, in this order, 404 ``ALLOWANCE_NOT_FOUND``, 409 (an operation in flight:
    ``ALLOWANCE_VERIFICATION_IN_PROGRESS`` ...), 400 ``ALLOWANCE_CANCELLED`` / ``ALLOWANCE_EXPIRED``,
    400 ``PAYMENT_METHOD_DELETED``, 400 ``RAIL_NOT_FOUND``, 400 ``VERIFICATION_NOT_REQUIRED`` (an
    spt rail), 400 ``RAIL_NOT_ACTIVE`` (a rail in error), 400 ``VERIFICATION_STATE_INVALID`` (start
    on a verified rail; a code when none is awaited). The code is kept encrypted on the rail until
    the job submits it.
    """
    allowance = find(session, caller.tenant_id, allowance_id)
    _not_busy(session, allowance)
    _usable(allowance)
    _payment_method_alive(session, allowance)
    target = _rail(session, allowance, rail, provider)
    if target.rail == "spt":
        raise agentic_error("VERIFICATION_NOT_REQUIRED")
    if target.status == AllowanceRailStatus.ERROR:
        raise agentic_error("RAIL_NOT_ACTIVE", "The rail's setup failed at its provider; it cannot be verified.")
    if action == "start" and target.status == AllowanceRailStatus.ACTIVE:
        raise agentic_error("VERIFICATION_STATE_INVALID", "The rail is verified already.")
    if action == "submit_otp" and target.verification != "otp_sent":
        raise agentic_error("VERIFICATION_STATE_INVALID", "No code is awaited: start the verification first.")
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=allowance.id,
        operation=leases.VERIFY,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    job = _record_job(
        session,
        caller,
        VERIFY_TASK,
        "allowance_rail",
        str(target.id),
        owner,
        max_attempts=2 if action == "submit_otp" else PROVIDER_MAX_ATTEMPTS,
    )
    target.job_id = job.id
    target.otp_sealed = (
        get_keyring().encrypt(session, caller.tenant_id, OTP_PURPOSE, str(target.id), otp.encode())
        if action == "submit_otp"
        else None
    )
    session.add(target)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=allowance.id, operation="update")
    return Recorded(allowance.id, (job.id,))


def finish_verification(
    session: Session, caller: Caller, allowance_id: str, *, rail: str, provider: str, job_id: uuid.UUID
) -> dict:
    """After the bounded wait: ``{status: otp_sent | verified, rail}``, or the failure's problem
    (``INVALID_OTP`` with ``attempts_remaining``, ``PROVIDER_VERIFICATION_FAILED``,
    ``VERIFICATION_NOT_SUPPORTED`` ...), or 409 ``ALLOWANCE_VERIFICATION_IN_PROGRESS``."""
    allowance = find(session, caller.tenant_id, allowance_id)
    status, result = job_state(session, job_id)
    if status in JOB_UNSUCCESSFUL:
        raise failure_problem(result, "PROVIDER_VERIFICATION_FAILED")
    if status not in jobs.TERMINAL:
        raise agentic_error("ALLOWANCE_VERIFICATION_IN_PROGRESS")
    if "verification" not in result:  # overtaken: the rail is no longer where this step applies
        raise agentic_error("VERIFICATION_STATE_INVALID")
    return {"status": result["verification"], "rail": rail_view(_rail(session, allowance, rail, provider))}


# ---- cancellation --------------------------------------------------------------------------------


def start_cancel(session: Session, caller: Caller, allowance_id: str, *, settings: Settings, owner: str) -> Recorded:
    """``DELETE /agentic/allowances/{id}``, the recording part.

    Already cancelled or expired: nothing to do (no provider call). An operation in flight: its 409
    (``ALLOWANCE_DELETE_IN_PROGRESS`` for a cancellation). Otherwise the cancellation starts (or
    resumes one that stopped half-way): with provider allowances to cancel, a job under a ``cancel``
    lease; without, the allowance is cancelled at once.
    """
    allowance = find(session, caller.tenant_id, allowance_id)
    if allowance.status == AllowanceStatus.CANCELLED or effective_status(allowance) == AllowanceStatus.EXPIRED:
        return Recorded(allowance.id)
    _not_busy(session, allowance)
    allowance.delete_requested_at = allowance.delete_requested_at or utcnow()
    session.add(allowance)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=allowance.id, operation="delete")
    if not any(r.provider_allowance_id and r.cancelled_at is None for r in rails_of(session, allowance.id)):
        mark_cancelled(session, allowance, trace_id=caller.trace_id)
        return Recorded(allowance.id)
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=allowance.id,
        operation=leases.CANCEL,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    job = _record_job(session, caller, CANCEL_TASK, "allowance", allowance.id, owner)
    return Recorded(allowance.id, (job.id,))


def mark_cancelled(session: Session, allowance: Allowance, *, trace_id: str | None = None) -> None:
    """The cancellation is complete: ``cancelled`` (its event emitted; the amounts stay as they are)."""
    allowance.delete_requested_at = allowance.delete_requested_at or utcnow()
    set_status(session, allowance, AllowanceStatus.CANCELLED, trace_id=trace_id)


def finish_cancel(session: Session, caller: Caller, allowance_id: str, job_ids: tuple[uuid.UUID, ...]) -> None:
    """After the bounded wait: None (204) when cancelled; 500 ``PROVIDER_ALLOWANCE_CANCEL_FAILED``
    when it stopped; 409 ``ALLOWANCE_DELETE_IN_PROGRESS`` while it runs."""
    allowance = find(session, caller.tenant_id, allowance_id)
    if allowance.status == AllowanceStatus.CANCELLED:
        return None
    if any(job_state(session, j)[0] in JOB_UNSUCCESSFUL for j in job_ids):
        raise agentic_error(
            "PROVIDER_ALLOWANCE_CANCEL_FAILED",
            "The cancellation stopped at a provider; repeat the same DELETE to resume it.",
        )
    raise agentic_error("ALLOWANCE_DELETE_IN_PROGRESS")


# ---- minting -------------------------------------------------------------------------------------


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
    _not_busy(session, allowance)
    _usable(allowance)
    _payment_method_alive(session, allowance)
    target = _rail(session, allowance, request.rail, request.provider)
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
        id=pm_service.new_id("pcr_"),
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
    job = _record_job(
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
    """:func:`start_mint` in its own transaction (see :func:`payment_methods.commit_unit`)."""
    return pm_service.commit_unit(start_mint, caller, allowance_id, request, settings=settings, claim=claim)


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


def seal_credential(session: Session, row: PaymentCredential, credential: dict) -> None:
    """Keep ``credential`` encrypted on ``row`` until its request takes it (never readable at rest)."""
    row.sealed = get_keyring().encrypt(
        session, row.tenant_id, SEALED_PURPOSE, row.id, json.dumps(credential, separators=(",", ":")).encode()
    )


def open_otp(session: Session, rail: AllowanceRail) -> str | None:
    """The code waiting on ``rail`` (None when there is none)."""
    if rail.otp_sealed is None:
        return None
    return get_keyring().decrypt(session, rail.tenant_id, OTP_PURPOSE, str(rail.id), rail.otp_sealed).decode()


# ---- sweeps --------------------------------------------------------------------------------------


def settle_stale_reservations(session: Session, *, batch: int = 1000) -> int:
    """The beat sweep: reservations whose mint lease is stale become spent; returns how many."""
    rows = session.exec(
        select(Allowance).where(Allowance.amount_reserved > 0).limit(batch).with_for_update(skip_locked=True)
    ).all()
    return sum(1 for row in rows if settle_stale(session, row))


def expire_allowances(session: Session, *, batch: int = 1000, now: dt.datetime | None = None) -> int:
    """The beat sweep: live allowances past ``expires_at`` become ``expired`` (terminal; the event is
    emitted); returns how many."""
    now = now or utcnow()
    rows = session.exec(
        select(Allowance)
        .where(col(Allowance.status).in_(LIVE), col(Allowance.expires_at) <= now)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for row in rows:
        set_status(session, row, AllowanceStatus.EXPIRED)
    return len(rows)


def purge_undelivered(session: Session, *, batch: int = 1000, now: dt.datetime | None = None) -> int:
    """The beat sweep: sealed credential values their request never took (it timed out or died) are
    destroyed after :data:`UNDELIVERED_SECONDS`; returns how many."""
    cutoff = (now or utcnow()) - dt.timedelta(seconds=UNDELIVERED_SECONDS)
    ids = session.exec(
        select(PaymentCredential.id)
        .where(col(PaymentCredential.sealed).is_not(None), col(PaymentCredential.created_at) < cutoff)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    if ids:
        session.execute(
            update(PaymentCredential)
            .where(col(PaymentCredential.id).in_(ids))
            .values(sealed=None)
            .execution_options(synchronize_session=False)
        )
    return len(ids)
