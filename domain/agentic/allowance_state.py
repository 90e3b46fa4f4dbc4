"""The state of allowances shared by the API verbs (:mod:`domain.agentic.allowances`,
:mod:`domain.agentic.credentials`), the workers (:mod:`domain.agentic.allowance_work`) and the beat
sweeps: finding and locking rows, status changes and their event, the checks every operation makes,
the sealed values (OTP codes, minted credentials) and the sweeps (spec 001 sections 3, 7 and 8).

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
import json
import uuid
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import delete, update
from sqlmodel import Session, col, select

from domain.agentic import leases
from domain.agentic.errors import agentic_error
from domain.tenancy.caller import Caller
from domain.webhooks import events
from infra import jobs
from infra.errors import Problem
from storage.crypto import get_keyring
from storage.models import Job
from storage.models_agentic import PaymentMethod
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from storage.states import (
    ALLOWANCE_LIVE,
    AllowanceRailStatus,
    AllowanceStatus,
    CredentialState,
    PaymentMethodStatus,
)
from storage.types import utcnow

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

#: A minted credential's value waits (encrypted) this long for its request to take it, then is purged.
UNDELIVERED_SECONDS = 600
SEALED_PURPOSE = "agentic-payment-credential"
OTP_PURPOSE = "agentic-allowance-otp"
LIVE = ALLOWANCE_LIVE


def effective_status(allowance: Allowance, now: dt.datetime | None = None) -> AllowanceStatus:
    """The status a client sees: a live allowance past ``expires_at`` is ``expired`` even before the
    expiry sweep writes it."""
    if allowance.status in LIVE and allowance.expires_at <= (now or utcnow()):
        return AllowanceStatus.EXPIRED
    return allowance.status


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


def mark_cancelled(session: Session, allowance: Allowance, *, trace_id: str | None = None) -> None:
    """The cancellation is complete: ``cancelled`` (its event emitted; the amounts stay as they are)."""
    allowance.delete_requested_at = allowance.delete_requested_at or utcnow()
    set_status(session, allowance, AllowanceStatus.CANCELLED, trace_id=trace_id)


# ---- the checks of the operations --------------------------------------------------------------


def not_busy(session: Session, allowance: Allowance) -> None:
    """Settle a stale reservation, then 409 with the in-progress code of an operation in flight
    (``ALLOWANCE_CREDENTIAL_IN_PROGRESS``, ``..._UPDATE_...``, ``..._VERIFICATION_...``,
    ``..._DELETE_IN_PROGRESS``)."""
    settle_stale(session, allowance)
    lease = leases.held(session, allowance.id)
    if lease is not None:
        raise leases.in_progress(lease)


def check_usable(allowance: Allowance) -> None:
    """400 ``ALLOWANCE_CANCELLED`` (also while a cancellation runs or stopped half-way) or
    ``ALLOWANCE_EXPIRED``."""
    if allowance.status == AllowanceStatus.CANCELLED or allowance.delete_requested_at is not None:
        raise agentic_error("ALLOWANCE_CANCELLED")
    if effective_status(allowance) == AllowanceStatus.EXPIRED:
        raise agentic_error("ALLOWANCE_EXPIRED")


def find_rail(session: Session, allowance: Allowance, rail: str, provider: str) -> AllowanceRail:
    """The allowance's rail of the pair ``(rail, provider)``, else 400 ``RAIL_NOT_FOUND``."""
    target = next((r for r in rails_of(session, allowance.id) if r.rail == rail and r.provider == provider), None)
    if target is None:
        raise agentic_error("RAIL_NOT_FOUND", f"The allowance has no {rail} rail with {provider}.")
    return target


def check_payment_method_alive(session: Session, allowance: Allowance) -> None:
    """400 ``PAYMENT_METHOD_DELETED`` when the payment method behind the allowance is deleted or its
    delete runs (or stopped half-way)."""
    pm = session.get(PaymentMethod, allowance.payment_method_id, populate_existing=True)
    if pm is None or pm.status == PaymentMethodStatus.DELETED or pm.delete_requested_at is not None:
        raise agentic_error("PAYMENT_METHOD_DELETED", "The payment method behind this allowance is deleted.")


def record_job(
    session: Session,
    caller: Caller,
    kind: str,
    subject_type: str,
    subject_id: str,
    owner: str,
    max_attempts: int = PROVIDER_MAX_ATTEMPTS,
) -> Job:
    """Record (sent after commit) an allowance job of ``kind`` on its subject for the caller's tenant,
    belonging to operation ``owner`` (the lease owner its end releases)."""
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


# ---- sealed values -----------------------------------------------------------------------------


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
