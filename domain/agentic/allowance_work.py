"""The worker side of allowances: rail setup, update, verification, cancellation and minting.

Each pair of functions is one job task (``tasks/agentic.py``, template ``infra/task.py``): ``perform_*``
reads what it needs in a short transaction and calls the provider outside any transaction with a key
the provider answers idempotently (the job id; for a mint the credential id), ``apply_*`` writes the
outcome in the transaction that completes the job, ``*_failed`` records a conclusive failure or a
dead letter. Every writing step locks the allowance row first, and the job's operation releases the
allowance's operation lease when it ends.

Minting (spec 001 sections 7 and 8): the API already moved the amount available -> reserved under
the ``mint`` lease. :func:`perform_mint` fetches the merchant's key set for an ``mpp`` mint through the
one outbound client (``infra/http.py``: its SSRF guard; a refused address is ``VALIDATION_ERROR``, a
failed fetch ``MPP_KEY_UNAVAILABLE``, both before any provider call) and asks the provider with the
credential id as key. :func:`apply_mint` moves reserved -> spent and records the credential (its value
sealed for the waiting request) in one transaction; :func:`mint_failed` clears the reservation on a
conclusive failure, or moves it to spent when the outcome is unknown (a read timeout, transient
failures past their retries) and deletes the credential row (no credential record exists). A job that
finds its reservation already settled as stale (its worker died for longer than the lease) changes
no amount: the sweep counted it as spent.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass
from decimal import Decimal

from sqlmodel import Session, col, select

from config.settings import Settings
from domain.agentic import allowance_state as state
from domain.agentic import idempotency, leases
from domain.agentic.errors import CATALOGUE, failed_rail, name_failed_rail
from domain.agentic.money import money
from domain.agentic.payment_methods import record_provider_error, tenant_type
from domain.webhooks import events
from infra import http
from infra.jobs import PermanentError, TransientError
from providers import ProviderNotConfigured
from providers.agentic import (
    Amount,
    CredentialOutcomeUnknown,
    MintedCredential,
    MppRequest,
    ProviderAllowance,
    ProviderRejection,
    VerificationState,
)
from providers.agentic_http import require_provider
from storage.db import session_scope
from storage.models import Job
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from storage.states import AllowanceRailStatus, AllowanceStatus, CredentialState, IdempotencyState
from storage.types import utcnow

#: How much of a merchant's key set is read (bytes).
MAX_KEY_SET_BYTES = 64 * 1024


@dataclass(frozen=True)
class Stale:
    """The job's work was overtaken (the allowance is gone, cancelled, settled): its outcome is dropped."""

    reason: str


def _provider(name: str, tenant_id: uuid.UUID, session: Session, settings: Settings):
    try:
        return require_provider(name, tenant_type(session, tenant_id), settings)
    except ProviderNotConfigured as exc:
        raise ProviderRejection(exc.code, str(exc)) from None


def _code(error: Exception, fallback: str) -> tuple[str, int]:
    """The catalogue code and status of a failed provider job."""
    if isinstance(error, PermanentError) and error.code in CATALOGUE:
        return error.code, error.status
    return fallback, CATALOGUE[fallback][0]


def _details(error: Exception) -> dict:
    if isinstance(error, ProviderRejection):
        return {"provider_code": error.provider_code, "correlation_id": error.correlation_id}
    return {}


def _money(allowance: Allowance, value: Decimal | None = None) -> Amount:
    wire = money(allowance.amount if value is None else value, allowance.currency)
    return Amount(Decimal(wire["value"]), allowance.currency)


def _locked_rail(session: Session, job: Job) -> tuple[Allowance | None, AllowanceRail | None]:
    rail = session.get(AllowanceRail, uuid.UUID(job.subject_id))
    if rail is None:
        return None, None
    allowance = state.lock(session, rail.allowance_id)
    session.refresh(rail)
    return allowance, rail


def _subject(job: Job) -> str:
    """The id of the job's subject (an allowance's, a credential's: every allowance job has one)."""
    return job.subject_id or ""


def _release(session: Session, allowance_id: str, job: Job) -> None:
    if job.operation_id:
        leases.release(session, allowance_id, job.operation_id)


# ---- setup ---------------------------------------------------------------------------------------


def perform_setup(job: Job, settings: Settings) -> ProviderAllowance | Stale:
    """Set up the job's rail at its provider, on the payment method rail's enrollment (key: the job
    id). Raises :class:`ProviderRejection` (``PROVIDER_ALLOWANCE_FAILED`` ...) or TransientError."""
    with session_scope() as session:
        rail = session.get(AllowanceRail, uuid.UUID(job.subject_id), populate_existing=True)
        if rail is None or rail.job_id != job.id or rail.status != AllowanceRailStatus.SETTING_UP:
            return Stale("the rail is set up already")
        allowance = session.get(Allowance, rail.allowance_id, populate_existing=True)
        if allowance is None:
            return Stale("the allowance is gone")
        provider = _provider(rail.provider, rail.tenant_id, session, settings)
        args = (rail.enrollment_id or "", _money(allowance), allowance.expires_at, allowance.description)
    return provider.create_allowance(*args, idempotency_key=str(job.id))


def _setup_done(session: Session, allowance: Allowance, job: Job) -> None:
    """The last setup job of an allowance sets its status and releases the ``setup`` lease."""
    if not any(r.status == AllowanceRailStatus.SETTING_UP for r in state.rails_of(session, allowance.id)):
        state.recompute_status(session, allowance, trace_id=job.trace_id)
        _release(session, allowance.id, job)


def apply_setup(session: Session, job: Job, outcome: ProviderAllowance | Stale) -> dict:
    """The rail is ``inactive`` (awaiting verification) or ``active``, with the provider's ids."""
    allowance, rail = _locked_rail(session, job)
    if allowance is None or rail is None:
        return {"stale": "the allowance is gone"}
    if isinstance(outcome, Stale) or rail.job_id != job.id or rail.status != AllowanceRailStatus.SETTING_UP:
        _setup_done(session, allowance, job)
        return {"stale": outcome.reason if isinstance(outcome, Stale) else "overtaken"}
    rail.provider_allowance_id = outcome.id
    rail.provider_ids = dict(outcome.provider_ids)
    rail.status = AllowanceRailStatus.INACTIVE if outcome.status == "inactive" else AllowanceRailStatus.ACTIVE
    rail.updated_at = utcnow()
    session.add(rail)
    state.touch(session, allowance)
    session.flush()
    _setup_done(session, allowance, job)
    return {"rail_status": rail.status}


def setup_failed(session: Session, job: Job, error: Exception) -> None:
    """The rail is in ``error`` with its catalogue code (``PROVIDER_ALLOWANCE_FAILED`` when the
    failure is unclassifiable), and a provider error object is recorded."""
    allowance, rail = _locked_rail(session, job)
    if allowance is None or rail is None:
        return
    if rail.job_id == job.id and rail.status == AllowanceRailStatus.SETTING_UP:
        code, _status = _code(error, "PROVIDER_ALLOWANCE_FAILED")
        record_provider_error(session, rail, code=code, operation="allowance", **_details(error))
        rail.status, rail.error_code, rail.updated_at = AllowanceRailStatus.ERROR, code, utcnow()
        session.add(rail)
        state.touch(session, allowance)
        session.flush()
    _setup_done(session, allowance, job)


# ---- update --------------------------------------------------------------------------------------


def _live_rails(session: Session, allowance_id: str) -> list[AllowanceRail]:
    return [
        r
        for r in state.rails_of(session, allowance_id)
        if r.provider_allowance_id and r.status != AllowanceRailStatus.ERROR and r.cancelled_at is None
    ]


def perform_update(job: Job, settings: Settings) -> str | Stale:
    """Ask each provider holding the allowance to take the pending values (key: the job id); a
    refusal raises :class:`ProviderRejection` ``PROVIDER_ALLOWANCE_UPDATE_FAILED`` with ``rail_id``."""
    with session_scope() as session:
        allowance = session.get(Allowance, job.subject_id, populate_existing=True)
        if allowance is None or not allowance.pending_update:
            return Stale("nothing to update")
        pending = dict(allowance.pending_update)
        amount = _money(allowance, Decimal(pending["amount"])) if "amount" in pending else None
        expires_at = dt.datetime.fromisoformat(pending["expires_at"]) if "expires_at" in pending else None
        description = (pending["description"] or "") if "description" in pending else None
        calls = [
            (r.id, _provider(r.provider, r.tenant_id, session, settings), r.provider_allowance_id)
            for r in _live_rails(session, allowance.id)
        ]
    for rail_id, provider, provider_allowance_id in calls:
        try:
            provider.update_allowance(
                provider_allowance_id,
                idempotency_key=str(job.id),
                amount=amount,
                expires_at=expires_at,
                description=description,
            )
        except (PermanentError, TransientError) as exc:
            name_failed_rail(exc, rail_id)
            raise
    return "updated"


def apply_update(session: Session, job: Job, outcome: str | Stale) -> dict:
    """Every provider agreed: the allowance takes the values (``amount_available`` follows the amount)."""
    allowance = state.lock(session, _subject(job))
    if allowance is None:
        return {"stale": "the allowance is gone"}
    pending = dict(allowance.pending_update or {})
    if not isinstance(outcome, Stale) and pending:
        if "amount" in pending:
            amount = Decimal(pending["amount"])
            allowance.amount_available = amount - allowance.amount_reserved - allowance.amount_spent
            allowance.amount = amount
        if "expires_at" in pending:
            allowance.expires_at = dt.datetime.fromisoformat(pending["expires_at"])
        if "description" in pending:
            allowance.description = pending["description"]
        state.touch(session, allowance)
    allowance.pending_update = None
    allowance.operation = None
    session.add(allowance)
    _release(session, allowance.id, job)
    return {"outcome": outcome.reason if isinstance(outcome, Stale) else outcome}


def update_failed(session: Session, job: Job, error: Exception) -> None:
    """A provider refused: the allowance stays unchanged, a provider error object is recorded."""
    allowance = state.lock(session, _subject(job))
    if allowance is None:
        return
    rail_id = failed_rail(error)
    rail = session.get(AllowanceRail, rail_id) if rail_id else None
    if rail is not None:
        code, _status = _code(error, "PROVIDER_ALLOWANCE_UPDATE_FAILED")
        record_provider_error(session, rail, code=code, operation="allowance_update", **_details(error))
    allowance.pending_update = None
    allowance.operation = None
    session.add(allowance)
    _release(session, allowance.id, job)


# ---- verification --------------------------------------------------------------------------------


def perform_verification(job: Job, settings: Settings) -> VerificationState | Stale:
    """Start the rail's verification, or submit the code waiting on the rail (key: the job id)."""
    with session_scope() as session:
        rail = session.get(AllowanceRail, uuid.UUID(job.subject_id), populate_existing=True)
        if rail is None or rail.job_id != job.id or not rail.provider_allowance_id:
            return Stale("the rail moved on")
        provider = _provider(rail.provider, rail.tenant_id, session, settings)
        otp = state.open_otp(session, rail)
        provider_allowance_id = rail.provider_allowance_id
    if otp is None:
        return provider.start_verification(provider_allowance_id, idempotency_key=str(job.id))
    return provider.submit_otp(provider_allowance_id, otp, idempotency_key=str(job.id))


def apply_verification(session: Session, job: Job, outcome: VerificationState | Stale) -> dict:
    """``otp_sent``: a code is awaited; ``verified``: the rail is ``active`` (and the allowance too
    once no rail awaits verification)."""
    allowance, rail = _locked_rail(session, job)
    if allowance is None or rail is None:
        return {"stale": "the allowance is gone"}
    if rail.job_id == job.id:
        rail.otp_sealed = None
        if not isinstance(outcome, Stale):
            rail.verification = outcome.status
            if outcome.status == "verified":
                rail.status = AllowanceRailStatus.ACTIVE
                rail.updated_at = utcnow()
                state.touch(session, allowance)
        session.add(rail)
        session.flush()
        state.recompute_status(session, allowance, trace_id=job.trace_id)
    _release(session, allowance.id, job)
    if isinstance(outcome, Stale):
        return {"stale": outcome.reason}
    return {"verification": outcome.status}


def verification_failed(session: Session, job: Job, error: Exception) -> None:
    """The provider refused: ``INVALID_OTP`` (the job result keeps ``attempts_remaining``),
    ``PROVIDER_VERIFICATION_FAILED`` (the verification ended: start again), ``VERIFICATION_NOT_SUPPORTED``
    ...; the conclusive ones are recorded as provider errors."""
    allowance, rail = _locked_rail(session, job)
    if allowance is None or rail is None:
        return
    code, _status = _code(error, "PROVIDER_VERIFICATION_FAILED")
    if isinstance(error, ProviderRejection) and code == "INVALID_OTP" and error.attempts_remaining is not None:
        job.result = {**(job.result or {}), "attempts_remaining": error.attempts_remaining}
        session.add(job)
    if rail.job_id == job.id:
        rail.otp_sealed = None
        if code in ("PROVIDER_VERIFICATION_FAILED", "VERIFICATION_STATE_INVALID"):
            rail.verification = "failed"
        session.add(rail)
    if code != "INVALID_OTP":
        record_provider_error(session, rail, code=code, operation="verification", **_details(error))
    _release(session, allowance.id, job)


# ---- cancellation --------------------------------------------------------------------------------


def cancel_rails(settings: Settings, allowance_ids: list[str], *, key: str) -> None:
    """Cancel at its provider each rail of ``allowance_ids`` not cancelled yet, recording each
    cancellation at once (so a cascade stopped half-way resumes where it stopped). A failure raises
    with ``rail_id`` set. ``key``: the operation's key (a new one per attempt)."""
    with session_scope() as session:
        todo = [
            (r.id, _provider(r.provider, r.tenant_id, session, settings), r.provider_allowance_id)
            for r in session.exec(select(AllowanceRail).where(col(AllowanceRail.allowance_id).in_(allowance_ids)))
            if r.provider_allowance_id and r.cancelled_at is None
        ]
    for rail_id, provider, provider_allowance_id in todo:
        try:
            provider.cancel_allowance(provider_allowance_id, idempotency_key=key)
        except (PermanentError, TransientError) as exc:
            name_failed_rail(exc, rail_id)
            raise
        with session_scope() as session:
            rail = session.get(AllowanceRail, rail_id)
            if rail is not None:
                rail.cancelled_at = utcnow()
                session.add(rail)


def perform_cancel(job: Job, settings: Settings) -> str | Stale:
    """The cancellation of one allowance at every provider (see :func:`cancel_rails`)."""
    with session_scope() as session:
        allowance = session.get(Allowance, job.subject_id, populate_existing=True)
        if allowance is None or allowance.status == AllowanceStatus.CANCELLED:
            return Stale("nothing to cancel")
        lease = leases.held(session, allowance.id)
        if lease is not None and lease.owner != job.operation_id:
            return Stale("another operation holds the allowance")
    cancel_rails(settings, [_subject(job)], key=str(job.id))
    return "cancelled"


def apply_cancel(session: Session, job: Job, outcome: str | Stale) -> dict:
    """The allowance is ``cancelled`` and its lease released."""
    allowance = state.lock(session, _subject(job))
    if allowance is not None:
        if not isinstance(outcome, Stale):
            state.mark_cancelled(session, allowance, trace_id=job.trace_id)
        _release(session, allowance.id, job)
    return {"outcome": outcome.reason if isinstance(outcome, Stale) else outcome}


def record_cancel_failure(session: Session, error: Exception) -> None:
    """Record the provider error of a failed cancellation (the rail named on the error)."""
    rail_id = failed_rail(error)
    rail = session.get(AllowanceRail, rail_id) if rail_id else None
    if rail is not None:
        record_provider_error(
            session, rail, code="PROVIDER_ALLOWANCE_CANCEL_FAILED", operation="cancellation", **_details(error)
        )


def cancel_failed(session: Session, job: Job, error: Exception) -> None:
    """The cancellation stopped: the allowance keeps its cancellation requested (the next DELETE
    resumes it); the lease is freed and the failure recorded."""
    allowance = state.lock(session, _subject(job))
    record_cancel_failure(session, error)
    if allowance is not None:
        _release(session, allowance.id, job)


def payment_method_allowances(session: Session, pm_id: str) -> list[str]:
    """The ids of the payment method's live allowances (the delete cascade's: cancelled and expired
    ones are left as they are)."""
    return list(
        session.exec(
            select(Allowance.id).where(Allowance.payment_method_id == pm_id, col(Allowance.status).in_(state.LIVE))
        ).all()
    )


def busy_allowance(session: Session, pm_id: str) -> leases.OperationLease | None:
    """A live operation lease on one of the payment method's allowances (a child operation in flight)."""
    for allowance_id in payment_method_allowances(session, pm_id):
        lease = leases.held(session, allowance_id)
        if lease is not None:
            return lease
    return None


def cancel_payment_method_allowances(session: Session, pm_id: str, *, trace_id: str | None) -> None:
    """The payment method is deleted: every live allowance it backs is ``cancelled`` (its providers
    were asked by :func:`cancel_rails`), or ``expired`` when its expiry passed."""
    for allowance_id in payment_method_allowances(session, pm_id):
        allowance = state.lock(session, allowance_id)
        if allowance is None:
            continue
        state.settle_stale(session, allowance)
        if state.effective_status(allowance) == AllowanceStatus.EXPIRED:  # expiry is terminal: it stays expired
            state.set_status(session, allowance, AllowanceStatus.EXPIRED, trace_id=trace_id)
        else:
            state.mark_cancelled(session, allowance, trace_id=trace_id)


# ---- minting -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MintTarget:
    credential_id: str
    provider_allowance_id: str
    format: str
    amount: Amount
    mpp: dict | None


def fetch_key_set(url: str, settings: Settings) -> dict:
    """The merchant's JWK set at ``url`` through the one outbound client. Raises PermanentError
    ``VALIDATION_ERROR`` (400: the SSRF guard refused the address) or ``MPP_KEY_UNAVAILABLE`` (502:
    no answer, not 200, not a JSON object with a ``keys`` list)."""
    result = http.fetch(
        url,
        timeout_s=settings.agentic_provider_timeout_seconds,
        allow_private=settings.allow_private_destinations,
        max_response_bytes=MAX_KEY_SET_BYTES,
    )
    if result.outcome == "refused":
        raise PermanentError("VALIDATION_ERROR", f"mpp.key_set_url: {result.error}", status=400)
    if result.status_code != 200:
        raise PermanentError(
            "MPP_KEY_UNAVAILABLE", result.error or f"the key set answered {result.status_code}", status=502
        )
    try:
        key_set = json.loads(result.response_body)
    except ValueError:
        key_set = None
    if not isinstance(key_set, dict) or not isinstance(key_set.get("keys"), list):
        raise PermanentError("MPP_KEY_UNAVAILABLE", "the key set is not a JWK set", status=502)
    return key_set


def perform_mint(job: Job, settings: Settings) -> MintedCredential | Stale:
    """Fetch the key set (mpp), then mint at the provider with the credential id as key. Raises
    :class:`ProviderRejection`, :class:`CredentialOutcomeUnknown`, PermanentError (the key set),
    TransientError (asked again with the same key)."""
    with session_scope() as session:
        row = session.get(PaymentCredential, job.subject_id, populate_existing=True)
        if row is None or row.state != CredentialState.MINTING:
            return Stale("the mint is settled")
        allowance = session.get(Allowance, row.allowance_id)
        if allowance is None:
            return Stale("the allowance is gone")
        rail = session.exec(
            select(AllowanceRail).where(
                AllowanceRail.allowance_id == row.allowance_id,
                AllowanceRail.rail == row.rail,
                AllowanceRail.provider == row.provider,
            )
        ).one()
        provider = _provider(row.provider, row.tenant_id, session, settings)
        target = _MintTarget(
            row.id,
            rail.provider_allowance_id or "",
            row.format,
            _money(allowance, row.amount),
            dict(row.mpp) if row.mpp else None,
        )
    mpp = None
    if target.mpp is not None:
        mpp = MppRequest(fetch_key_set(target.mpp["key_set_url"], settings), target.mpp["challenge"])
    return provider.mint_credential(
        target.provider_allowance_id,
        credential_format=target.format,
        amount=target.amount,
        mpp=mpp,
        idempotency_key=target.credential_id,
    )


def _locked_mint(session: Session, job: Job) -> tuple[Allowance | None, PaymentCredential | None]:
    row = session.get(PaymentCredential, job.subject_id)
    if row is None:
        return None, None
    allowance = state.lock(session, row.allowance_id)
    row = session.get(PaymentCredential, job.subject_id, populate_existing=True)
    return allowance, row


def apply_mint(session: Session, job: Job, outcome: MintedCredential | Stale) -> dict:
    """reserved -> spent and the credential recorded (``issued``, its value sealed for the request),
    its event emitted, the mint lease released: one transaction."""
    allowance, row = _locked_mint(session, job)
    if isinstance(outcome, Stale) or allowance is None or row is None or row.state != CredentialState.MINTING:
        return {"stale": outcome.reason if isinstance(outcome, Stale) else "settled"}
    minted = outcome
    if allowance.reserved_by == row.id:
        allowance.amount_reserved -= row.amount
        allowance.amount_spent += row.amount
        allowance.reserved_by = None
        state.touch(session, allowance)
    row.state = CredentialState.ISSUED
    row.provider_credential_id = minted.id
    row.expires_at = minted.expires_at
    state.seal_credential(session, row, minted.credential)
    session.add(row)
    leases.release(session, allowance.id, row.id)
    idempotency.settle_resource(
        session,
        tenant_id=row.tenant_id,
        scope=idempotency.MINT_CREDENTIAL,
        resource_id=row.id,
        state=IdempotencyState.SUCCEEDED,
    )
    events.emit(
        session,
        tenant_id=row.tenant_id,
        type=state.CREDENTIAL_EVENT,
        data={
            "credential": {"id": row.id},
            "allowance": {"id": allowance.id, "status": state.effective_status(allowance)},
        },
        trace_id=job.trace_id,
    )
    return {"credential_id": row.id}


def mint_failed(session: Session, job: Job, error: Exception) -> None:
    """A conclusive failure clears the reservation (reserved -> available); an unknown outcome
    (:class:`CredentialOutcomeUnknown`, or transient failures past the retries) moves it to spent.
    Either way no credential record remains, a provider error object is recorded (with the
    credential id) and the mint lease is released."""
    allowance, row = _locked_mint(session, job)
    if allowance is None or row is None or row.state != CredentialState.MINTING:
        return
    unknown = isinstance(error, CredentialOutcomeUnknown) or isinstance(error, TransientError)
    if allowance.reserved_by == row.id:
        allowance.amount_reserved -= row.amount
        if unknown:
            allowance.amount_spent += row.amount
        else:
            allowance.amount_available += row.amount
        allowance.reserved_by = None
        state.touch(session, allowance)
    if unknown:
        job.result = {**(job.result or {}), "code": "CREDENTIAL_OUTCOME_UNKNOWN", "status": 409}
        session.add(job)
    code, _status = _code(error, "PROVIDER_CREDENTIALS_FAILED")
    if unknown:
        code = "CREDENTIAL_OUTCOME_UNKNOWN"
    problem = None if unknown else state.failure_problem({"code": code}, "PROVIDER_CREDENTIALS_FAILED")
    idempotency.settle_resource(
        session,
        tenant_id=row.tenant_id,
        scope=idempotency.MINT_CREDENTIAL,
        resource_id=row.id,
        state=IdempotencyState.UNKNOWN if unknown else IdempotencyState.FAILED,
        problem=problem,
    )
    if code in CATALOGUE and code != "VALIDATION_ERROR":
        rail = session.exec(
            select(AllowanceRail).where(
                AllowanceRail.allowance_id == row.allowance_id,
                AllowanceRail.rail == row.rail,
                AllowanceRail.provider == row.provider,
            )
        ).first()
        if rail is not None:
            record_provider_error(
                session, rail, code=code, operation="credentials", payment_credential_id=row.id, **_details(error)
            )
    session.delete(row)
    leases.release(session, allowance.id, _subject(job))
