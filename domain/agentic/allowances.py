"""Allowances, the verbs of the API: create, read, list, the provider errors, update, verify a rail,
cancel (spec 001 sections 3, 7 and 8; the contract of the allowance endpoints is the platform's,
written in the OpenAPI description). Payment credentials are :mod:`domain.agentic.credentials`.

Each function here runs in one transaction of the API (``fn(session, ...)``), records the jobs the
workers run (:mod:`domain.agentic.allowance_work`, ``tasks/agentic.py``) and never calls a provider.
The rules every operation shares (locking, leases, the money invariant) are
:mod:`domain.agentic.allowance_state`'s.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlmodel import Session, and_, col, or_, select

from config.settings import Settings
from domain.agentic import idempotency, leases
from domain.agentic import payment_methods as pm_records
from domain.agentic.allowance_state import (
    CANCEL_TASK,
    LIVE,
    OTP_PURPOSE,
    PROVIDER_MAX_ATTEMPTS,
    SETUP_TASK,
    UPDATE_TASK,
    VERIFY_TASK,
    Recorded,
    check_payment_method_alive,
    check_usable,
    effective_status,
    failure_problem,
    find,
    find_rail,
    job_state,
    mark_cancelled,
    not_busy,
    rails_of,
    recompute_status,
    record_job,
)
from domain.agentic.errors import agentic_error, validation_error
from domain.agentic.money import money
from domain.agentic.service import provider_error_page
from domain.agentic.units import commit_unit
from domain.agentic.views import allowance_view, verification_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra import jobs
from providers.agentic_http import provider_for
from storage.crypto import get_keyring
from storage.db import read_one_snapshot
from storage.keyset import keyset_page
from storage.models_agentic import ProviderError
from storage.models_allowances import Allowance, AllowanceRail
from storage.states import JOB_UNSUCCESSFUL, AllowanceRailStatus, AllowanceStatus, PaymentMethodStatus, RailStatus
from storage.types import utcnow

ENTITY_TYPE = "allowance"

DEFAULT_LIFETIME = dt.timedelta(days=30)
MAX_LIFETIME = dt.timedelta(days=365)
MAX_DESCRIPTION = 1000


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
    pm = pm_records.find(session, caller.tenant_id, request.payment_method_id, lock=True)
    if pm.status == PaymentMethodStatus.DELETED or pm.delete_requested_at is not None:
        raise agentic_error("PAYMENT_METHOD_DELETED")
    enabled = [r for r in pm_records.rails_of(session, pm.id) if r.status == RailStatus.ENABLED]
    if not enabled:
        raise agentic_error("NO_ACTIVE_RAILS")
    now = utcnow()
    expires_at = request.expires_at or now + DEFAULT_LIFETIME
    errors = expiry_errors(expires_at, now)
    if errors:
        raise validation_error({"expires_at": errors})
    allowance = Allowance(
        id=pm_records.new_id("alw_"),
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
            pm_records.record_provider_error(session, rail, code="PROVIDER_NOT_CONFIGURED", operation="allowance")
        else:
            job = record_job(session, caller, SETUP_TASK, "allowance_rail", str(rail.id), owner)
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
    """:func:`create_allowance` in its own transaction (see :func:`domain.agentic.units.commit_unit`)."""
    return commit_unit(create_allowance, caller, request, settings=settings, owner=owner, claim=claim)


def finish_create(session: Session, caller: Caller, allowance_id: str, *, claim: idempotency.Claim | None) -> dict:
    """After the bounded wait: settle the idempotency record and answer the allowance."""
    allowance = find(session, caller.tenant_id, allowance_id)
    if claim is not None:
        idempotency.succeed(session, claim)
    return view_of(session, allowance)


def view_of(session: Session, allowance: Allowance) -> dict:
    """The allowance object of a loaded row."""
    return allowance_view(allowance, rails_of(session, allowance.id))


# ---- read, list, errors --------------------------------------------------------------------------


def read_allowance(session: Session, caller: Caller, allowance_id: str) -> dict:
    """``GET /agentic/allowances/{id}``: 404 ``ALLOWANCE_NOT_FOUND`` when absent in the tenant. The
    allowance and its rails are read from one snapshot (:func:`storage.db.read_one_snapshot`)."""
    read_one_snapshot(session)
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
    status (as stored; ``expired`` also matches live allowances past their expiry); the allowances
    and their rails read from one snapshot (:func:`storage.db.read_one_snapshot`)."""
    read_one_snapshot(session)
    query = select(Allowance).where(Allowance.tenant_id == caller.tenant_id)
    if payment_method_id is not None:
        query = query.where(Allowance.payment_method_id == payment_method_id)
    now = utcnow()
    if status == AllowanceStatus.EXPIRED:
        query = query.where(
            or_(
                col(Allowance.status) == AllowanceStatus.EXPIRED,
                and_(col(Allowance.status).in_(LIVE), col(Allowance.expires_at) <= now),
            )
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
    return provider_error_page(
        session, caller.tenant_id, ProviderError.allowance_id == allowance_id, size=size, after=after
    )


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
    not_busy(session, allowance)
    check_usable(allowance)
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
    job = record_job(session, caller, UPDATE_TASK, "allowance", allowance.id, owner)
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

    ``otp`` is required for ``submit_otp`` (the API answers 400 ``VALIDATION_ERROR`` before calling)
    and ignored for ``start``.
    """
    if action == "submit_otp" and otp is None:
        raise validation_error({"otp": ["is required for submit_otp"]})
    if action != "submit_otp":
        otp = None
    allowance = find(session, caller.tenant_id, allowance_id)
    not_busy(session, allowance)
    check_usable(allowance)
    check_payment_method_alive(session, allowance)
    target = find_rail(session, allowance, rail, provider)
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
    job = record_job(
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
        if otp is not None
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
    return verification_view(result["verification"], find_rail(session, allowance, rail, provider))


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
    not_busy(session, allowance)
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
    job = record_job(session, caller, CANCEL_TASK, "allowance", allowance.id, owner)
    return Recorded(allowance.id, (job.id,))


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
