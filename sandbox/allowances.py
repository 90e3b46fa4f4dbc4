"""The simulated agentic providers' allowances: setup, update, cancellation and OTP verification; the
minting of payment credentials is :mod:`sandbox.credentials`, the records :mod:`sandbox.allowance_state`.

Outcomes follow ``SANDBOX.md`` (Agentic providers: allowances, verification, credentials) and depend on
the provider and on the card behind the allowance's enrollment only: see
:data:`sandbox.allowance_state.BEHAVIOURS` and ``sandbox/README.md``. An allowance is set up on an
enrollment the provider holds (:mod:`sandbox.agentic`), so no card number travels again.
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass
from decimal import Decimal
from functools import partial

from aiohttp import web

from sandbox import credentials
from sandbox.agentic import AGENTIC, Enrollment, endpoint_name, provider_in_path, rejection
from sandbox.allowance_state import (
    ALLOWANCES,
    CORRECT_OTP,
    MAX_OTP_ATTEMPTS,
    PROVIDER_IDS,
    VERIFYING_PROVIDERS,
    Allowances,
    Amount,
    Behaviour,
    ProviderAllowance,
    Verification,
    allowance_in_path,
    description_errors,
    parse_amount,
    parse_expiry,
    special_behaviour,
)
from sandbox.cards import CardFilter
from sandbox.replies import Reply, SandboxError, read_json_object, require_valid
from sandbox.state import SANDBOX, respond_idempotently, sandbox_of

routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the allowance state and routes (API and admin, credentials included) to ``app``; needs
    :mod:`sandbox.agentic`'s."""
    app[ALLOWANCES] = app[SANDBOX].register(Allowances())
    app.add_routes(routes)
    app.add_routes(credentials.routes)


@dataclass(frozen=True)
class SetupRequest:
    """A validated allowance setup: the enrollment (None when the provider holds no such one), the
    amount, the expiry and the description."""

    enrollment: Enrollment | None
    amount: Amount
    expires_at: datetime.datetime
    description: str | None


@routes.post("/agentic/{provider}/allowances")
async def create_allowance(request: web.Request) -> web.Response:
    """Set up an allowance on an enrollment; 201 with the allowance or 422 ``{code, message,
    provider_correlation_id}``. See ``sandbox/README.md`` for the body and every outcome."""
    provider = provider_in_path(request)
    body = await read_json_object(request)
    enrollment_id = body.get("enrollment_id")
    enrollment = request.app[AGENTIC].find(provider, enrollment_id) if isinstance(enrollment_id, str) else None
    sandbox_of(request).requests.count(
        endpoint_name(provider, "allowances", "create"), enrollment.card.ref if enrollment else None
    )
    errors = description_errors(body)
    if not (isinstance(enrollment_id, str) and enrollment_id):
        errors["enrollment_id"] = "must be a non-empty string"
    amount = parse_amount(body.get("amount"), "amount", errors)
    expires_at = parse_expiry(body.get("expires_at"), errors)
    require_valid(errors)
    assert amount is not None and expires_at is not None, "a malformed amount or expiry is in errors"
    ask = SetupRequest(enrollment, amount, expires_at, body.get("description"))
    operation = partial(_set_up, request.app, provider, ask)
    return await respond_idempotently(request, ("allowance.create", provider), operation)


async def _set_up(app: web.Application, provider: str, ask: SetupRequest) -> Reply:
    """The provider's answer to ``ask``; stores the allowance when it succeeds."""
    enrollment = ask.enrollment
    if enrollment is None:
        raise rejection("ENROLLMENT_NOT_FOUND", f"{provider} holds no such enrollment")
    if enrollment.status != "enabled":
        raise rejection("ENROLLMENT_NOT_ENABLED", "the enrollment is not enabled yet")
    if special_behaviour(provider, enrollment) is Behaviour.REJECT_SETUP:
        raise rejection("PROVIDER_ALLOWANCE_FAILED", "the provider rejected the allowance")
    allowance = ProviderAllowance(
        id=f"pal_{secrets.token_hex(12)}",
        provider=provider,
        enrollment=enrollment,
        amount=ask.amount,
        spent=Decimal(0),
        expires_at=ask.expires_at,
        description=ask.description,
        status="inactive" if provider in VERIFYING_PROVIDERS else "active",
        provider_ids={name: prefix + secrets.token_hex(8) for name, prefix in PROVIDER_IDS[provider]},
    )
    app[ALLOWANCES].allowances[allowance.id] = allowance
    return Reply(201, allowance.view())


@routes.get("/agentic/{provider}/allowances/{allowance_id}")
async def read_allowance(request: web.Request) -> web.Response:
    """200 with the allowance's current state; 404 if the provider does not hold it."""
    _, allowance = allowance_in_path(request, "allowances", "read")
    return web.json_response(allowance.view())


@dataclass(frozen=True)
class UpdateRequest:
    """A validated update: each field None when absent (``description`` is cleared only by ``""``)."""

    amount: Amount | None
    expires_at: datetime.datetime | None
    description: str | None


@routes.patch("/agentic/{provider}/allowances/{allowance_id}")
async def update_allowance(request: web.Request) -> web.Response:
    """Change the amount, expiry or description; 200 with the allowance or 422 when refused."""
    provider, allowance = allowance_in_path(request, "allowances", "update")
    body = await read_json_object(request)
    errors = description_errors(body)
    amount = parse_amount(body["amount"], "amount", errors) if "amount" in body else None
    expires_at = parse_expiry(body["expires_at"], errors) if "expires_at" in body else None
    require_valid(errors)
    ask = UpdateRequest(amount, expires_at, body.get("description"))
    operation = partial(_update, allowance, ask)
    return await respond_idempotently(request, ("allowance.update", provider, allowance.id), operation)


async def _update(allowance: ProviderAllowance, ask: UpdateRequest) -> Reply:
    """Apply ``ask`` to ``allowance`` unless it is no longer live or the new amount is below what was
    spent (or in another currency)."""
    if allowance.current_status in ("cancelled", "expired"):
        raise rejection(f"ALLOWANCE_{allowance.current_status.upper()}", f"the allowance is {allowance.current_status}")
    if ask.amount is not None and ask.amount.currency != allowance.amount.currency:
        raise rejection("CURRENCY_MISMATCH", "the amount must stay in the allowance's currency")
    if ask.amount is not None and ask.amount.value < allowance.spent:
        raise rejection("AMOUNT_BELOW_SPENT", "the amount is below what the allowance already spent")
    allowance.amount = ask.amount or allowance.amount
    allowance.expires_at = ask.expires_at or allowance.expires_at
    if ask.description is not None:
        allowance.description = ask.description or None
    return Reply(200, allowance.view())


@routes.post("/agentic/{provider}/allowances/{allowance_id}/cancel")
async def cancel_allowance(request: web.Request) -> web.Response:
    """Cancel the allowance (no body); 200 with it, ``cancelled``; repeating it changes nothing."""
    provider, allowance = allowance_in_path(request, "allowances", "cancel")
    operation = partial(_cancel, allowance)
    return await respond_idempotently(request, ("allowance.cancel", provider, allowance.id), operation)


async def _cancel(allowance: ProviderAllowance) -> Reply:
    """Cancel ``allowance``; the cancel-failing card refuses the first attempt (each new key is one)."""
    allowance.cancel_attempts += 1
    failing = special_behaviour(allowance.provider, allowance.enrollment) is Behaviour.CANCEL_FAILS_ONCE
    if failing and allowance.cancel_attempts == 1:
        raise rejection("PROVIDER_ALLOWANCE_CANCEL_FAILED", "the cancellation failed at the provider; repeat it")
    allowance.status = "cancelled"
    return Reply(200, allowance.view())


@routes.post("/agentic/{provider}/allowances/{allowance_id}/verification")
async def start_verification(request: web.Request) -> web.Response:
    """Start (or restart) the allowance's verification: an OTP is sent; 201 ``{allowance_id, status:
    "otp_sent", attempts_remaining}``, or a 400/422 refusal."""
    provider, allowance = allowance_in_path(request, "verifications", "start")
    operation = partial(_start_verification, allowance)
    return await respond_idempotently(request, ("verification.start", provider, allowance.id), operation)


def _verifiable(allowance: ProviderAllowance) -> None:
    """Raise the refusal of a verification call on an allowance that cannot be verified (now)."""
    if allowance.provider not in VERIFYING_PROVIDERS:
        raise SandboxError(400, "VERIFICATION_NOT_REQUIRED", f"{allowance.provider} allowances need no verification")
    if special_behaviour(allowance.provider, allowance.enrollment) is Behaviour.NO_VERIFICATION:
        raise rejection("VERIFICATION_NOT_SUPPORTED", "the issuer offers no verification for this card")
    if allowance.current_status in ("cancelled", "expired"):
        raise rejection(f"ALLOWANCE_{allowance.current_status.upper()}", f"the allowance is {allowance.current_status}")
    if allowance.status == "active":
        raise SandboxError(400, "VERIFICATION_STATE_INVALID", "the allowance is already verified")


async def _start_verification(allowance: ProviderAllowance) -> Reply:
    """Send a new OTP (the code is always :data:`CORRECT_OTP`), which resets the wrong-code count."""
    _verifiable(allowance)
    sent = allowance.verification.otps_sent if allowance.verification else 0
    allowance.verification = Verification("otp_sent", wrong_codes=0, otps_sent=sent + 1)
    return Reply(201, allowance.verification.view(allowance.id))


@routes.post("/agentic/{provider}/allowances/{allowance_id}/verification/otp")
async def submit_otp(request: web.Request) -> web.Response:
    """Submit ``{otp}``: 200 ``{status: "verified"}`` (the allowance turns active), 400 ``INVALID_OTP``
    with ``attempts_remaining``, 422 ``PROVIDER_VERIFICATION_FAILED`` on the third wrong code in a row."""
    provider, allowance = allowance_in_path(request, "verifications", "otp")
    body = await read_json_object(request)
    if not isinstance(body.get("otp"), str):
        require_valid({"otp": "must be a string"})
    operation = partial(_submit_otp, allowance, body["otp"])
    return await respond_idempotently(request, ("verification.otp", provider, allowance.id), operation)


async def _submit_otp(allowance: ProviderAllowance, otp: str) -> Reply:
    """Check ``otp`` against the current verification, counting wrong codes."""
    _verifiable(allowance)
    verification = allowance.verification
    if verification is None or verification.status != "otp_sent":
        raise SandboxError(400, "VERIFICATION_STATE_INVALID", "no verification is waiting for a code; start one")
    if secrets.compare_digest(otp.encode(), CORRECT_OTP.encode()):
        verification.status = "verified"
        allowance.status = "active"
        return Reply(200, verification.view(allowance.id))
    verification.wrong_codes += 1
    if verification.wrong_codes >= MAX_OTP_ATTEMPTS:
        verification.status = "failed"
        raise rejection("PROVIDER_VERIFICATION_FAILED", "too many wrong codes; start the verification again")
    raise SandboxError(
        400, "INVALID_OTP", "the code is wrong", attempts_remaining=MAX_OTP_ATTEMPTS - verification.wrong_codes
    )


@routes.get("/_admin/allowances")
async def admin_allowances(request: web.Request) -> web.Response:
    """200 ``{allowances: [...], count}``: allowances held, filtered by ``provider``, ``status`` and
    card (``pan_last4``, ``par``, ``pan``), oldest first."""
    cards = CardFilter.from_query(request.query)
    provider, status = request.query.get("provider"), request.query.get("status")
    allowances = [
        allowance.admin_view()
        for allowance in request.app[ALLOWANCES].allowances.values()
        if provider in (None, allowance.provider)
        and status in (None, allowance.current_status)
        and cards.matches(allowance.card)
    ]
    return web.json_response({"allowances": allowances, "count": len(allowances)})
