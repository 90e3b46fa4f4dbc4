"""The simulated agentic providers' allowances: setup, update, cancellation, OTP verification and the
minting of payment credentials.

Outcomes follow ``SANDBOX.md`` (Agentic providers: allowances, verification, credentials) and depend on
the provider and on the card behind the allowance's enrollment only: see :data:`_BEHAVIOURS` and
``sandbox/README.md``. An allowance is set up on an enrollment the provider holds
(:mod:`sandbox.agentic`), so no card number travels again. Minted credential values are returned once
and never kept: the admin view shows what was minted, not the values.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from functools import partial
from typing import Any

from aiohttp import web
from joserfc import jwe
from joserfc.errors import JoseError
from joserfc.jwk import ECKey, OKPKey

from sandbox.agentic import (
    AGENTIC,
    PROVIDER_BRANDS,
    Enrollment,
    endpoint_name,
    hang,
    held_by,
    provider_in_path,
    rejection,
)
from sandbox.cards import CardFilter, CardRef, luhn_check_digit
from sandbox.replies import Reply, SandboxError, not_found, read_json_object, require_valid
from sandbox.state import SANDBOX, Sandbox, respond_idempotently, sandbox_of

CORRECT_OTP = "000000"
"""The code of every OTP the sandbox sends."""

MAX_OTP_ATTEMPTS = 3
"""Wrong codes in a row that fail a verification (the next one must start again)."""

VERIFYING_PROVIDERS = frozenset({"vic", "agentpay"})
"""Providers whose allowances are ``inactive`` until verified (the agentic-token rail's); psp's are
``active`` from creation."""

FORMATS = {
    "vic": ("card", "network-token", "mpp"),
    "agentpay": ("card", "network-token", "mpp"),
    "psp": ("identifier", "mpp"),
}
"""Credential formats each provider mints (spec 001 section 4, Rails and providers)."""

CREDENTIAL_NUMBER_PREFIX = "400000100000"
"""Minted card and network-token credential numbers are this, three random digits and a Luhn digit."""

MPP_ALGORITHM = {"alg": "ECDH-ES", "enc": "A256GCM"}
"""How an MPP credential is sealed: JWE key agreement with the merchant's key, AES-256-GCM content."""

MAX_CHALLENGE_LENGTH = 1024
MAX_DESCRIPTION_LENGTH = 1000

_AMOUNT_VALUE = re.compile(r"(0|[1-9][0-9]{0,14})(\.[0-9]{1,4})?")
_CURRENCY = re.compile(r"[A-Z]{3}")

# provider -> names and prefixes of the identifiers it returns in an allowance's provider_ids
_PROVIDER_IDS = {
    "vic": (("mandate_reference", "vic_mdt_"),),
    "agentpay": (("agent_mandate_id", "ap_mdt_"),),
    "psp": (("spending_limit", "psp_sl_"),),
}


class _Behaviour(Enum):
    """Special outcomes of the allowance test cards."""

    REJECT_SETUP = "422 PROVIDER_ALLOWANCE_FAILED on create"
    MINT_FAILS = "422 PROVIDER_CREDENTIALS_FAILED on every mint"
    MINT_HANGS = "no answer to a mint for hang_seconds"
    CANCEL_FAILS_ONCE = "422 PROVIDER_ALLOWANCE_CANCEL_FAILED on the first cancellation"
    NO_VERIFICATION = "422 VERIFICATION_NOT_SUPPORTED on every verification start"


# card number -> (behaviour, providers showing it)
_BEHAVIOURS = {
    "4000000000004012": (_Behaviour.REJECT_SETUP, frozenset({"vic"})),
    "4000000000004020": (_Behaviour.MINT_FAILS, frozenset(PROVIDER_BRANDS)),
    "4000000000004038": (_Behaviour.MINT_HANGS, frozenset(PROVIDER_BRANDS)),
    # at vic alone: the platform's DELETE cancels at every provider, so the repeated DELETE succeeds
    "4000000000004046": (_Behaviour.CANCEL_FAILS_ONCE, frozenset({"vic"})),
    "4000000000004053": (_Behaviour.NO_VERIFICATION, frozenset({"vic"})),
}


def _behaviour(provider: str, enrollment: Enrollment) -> _Behaviour | None:
    """The special outcome of ``enrollment``'s card at ``provider``, None for the ordinary one."""
    behaviour, providers = _BEHAVIOURS.get(enrollment.card.pan, (None, frozenset()))
    return behaviour if provider in providers else None


def _now() -> datetime.datetime:
    """The current time, UTC."""
    return datetime.datetime.now(datetime.UTC)


def _timestamp(moment: datetime.datetime) -> str:
    """``moment`` as ISO 8601 in UTC with a ``Z`` (fractions of a second only when it has some)."""
    return moment.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Amount:
    """An exact amount: ``value`` (Decimal, at most 4 decimals) in ``currency`` (ISO 4217 code)."""

    value: Decimal
    currency: str

    def view(self) -> dict[str, str]:
        """``{"value": "25.00", "currency": "USD"}``: the value keeps the decimals it was given."""
        return {"value": format(self.value, "f"), "currency": self.currency}


def _amount(raw: object, path: str, errors: dict[str, str]) -> Amount | None:
    """``raw`` as a positive :class:`Amount`; None after adding messages to ``errors`` when malformed."""
    if not isinstance(raw, dict):
        errors[path] = "must be an object {value, currency}"
        return None
    value, currency = raw.get("value"), raw.get("currency")
    valid = True
    if not (isinstance(value, str) and _AMOUNT_VALUE.fullmatch(value) and Decimal(value) > 0):
        errors[f"{path}.value"] = "must be a decimal string above 0 with at most 4 decimals, e.g. 25.00"
        valid = False
    if not (isinstance(currency, str) and _CURRENCY.fullmatch(currency)):
        errors[f"{path}.currency"] = "must be an ISO 4217 code such as USD"
        valid = False
    if not (valid and isinstance(value, str) and isinstance(currency, str)):
        return None
    return Amount(Decimal(value), currency)


def _expiry(raw: object, errors: dict[str, str]) -> datetime.datetime | None:
    """``raw`` as a future aware datetime; None after adding a message to ``errors`` otherwise."""
    try:
        moment = datetime.datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        errors["expires_at"] = "must be an ISO 8601 date-time with a time zone"
        return None
    if moment <= _now():
        errors["expires_at"] = "must be in the future"
        return None
    return moment


def _description_errors(body: dict[str, Any]) -> dict[str, str]:
    description = body.get("description")
    if description is not None and not (isinstance(description, str) and len(description) <= MAX_DESCRIPTION_LENGTH):
        return {"description": f"must be a string of at most {MAX_DESCRIPTION_LENGTH} characters"}
    return {}


@dataclass
class Verification:
    """The current OTP verification of an allowance: ``status`` ``otp_sent``, ``verified`` or ``failed``;
    ``wrong_codes`` wrong codes in a row; ``otps_sent`` OTPs sent for the allowance so far."""

    status: str
    wrong_codes: int
    otps_sent: int

    def view(self, allowance_id: str) -> dict[str, Any]:
        """``{allowance_id, status, attempts_remaining}`` as the provider answers it."""
        remaining = MAX_OTP_ATTEMPTS - self.wrong_codes if self.status == "otp_sent" else 0
        return {"allowance_id": allowance_id, "status": self.status, "attempts_remaining": remaining}


@dataclass
class ProviderAllowance:
    """An allowance set up at ``provider`` on ``enrollment``: ``status`` ``inactive`` (awaiting
    verification), ``active`` or ``cancelled``; ``spent``: the sum of the credentials minted."""

    id: str
    provider: str
    enrollment: Enrollment
    amount: Amount
    spent: Decimal
    expires_at: datetime.datetime
    description: str | None
    status: str
    provider_ids: dict[str, str]
    verification: Verification | None = None
    cancel_attempts: int = 0
    credentials: int = 0

    @property
    def card(self) -> CardRef:
        """The reference of the card behind the enrollment."""
        return self.enrollment.card.ref

    @property
    def current_status(self) -> str:
        """``status``, or ``expired`` once ``expires_at`` has passed (a cancelled one stays cancelled)."""
        return "expired" if self.status != "cancelled" and self.expires_at <= _now() else self.status

    def view(self) -> dict[str, Any]:
        """The allowance as the provider returns it (see ``sandbox/README.md``)."""
        return {
            "id": self.id,
            "provider": self.provider,
            "enrollment_id": self.enrollment.id,
            "status": self.current_status,
            "verification_required": self.provider in VERIFYING_PROVIDERS,
            "amount": self.amount.view(),
            "amount_spent": Amount(self.spent, self.amount.currency).view(),
            "expires_at": _timestamp(self.expires_at),
            "description": self.description,
            "provider_ids": dict(self.provider_ids),
        }

    def admin_view(self) -> dict[str, Any]:
        """:meth:`view` plus the card (``pan_last4``, ``par``), the verification's counters, the
        cancellation attempts and the number of credentials minted."""
        verification = self.verification
        return {
            **self.view(),
            "pan_last4": self.card.last4,
            "par": self.card.par,
            "verification": None
            if verification is None
            else {
                "status": verification.status,
                "otps_sent": verification.otps_sent,
                "wrong_codes": verification.wrong_codes,
            },
            "cancel_attempts": self.cancel_attempts,
            "credentials": self.credentials,
        }


@dataclass(frozen=True)
class MintedCredential:
    """What the provider remembers of a minted credential: never its value."""

    id: str
    allowance: ProviderAllowance
    format: str
    amount: Amount
    created_at: datetime.datetime

    def admin_view(self) -> dict[str, Any]:
        """``{id, provider, allowance_id, format, amount, pan_last4, par, created_at}``."""
        return {
            "id": self.id,
            "provider": self.allowance.provider,
            "allowance_id": self.allowance.id,
            "format": self.format,
            "amount": self.amount.view(),
            "pan_last4": self.allowance.card.last4,
            "par": self.allowance.card.par,
            "created_at": _timestamp(self.created_at),
        }


class Allowances:
    """State of the agentic providers' allowances and of the credentials they minted, by id."""

    def __init__(self) -> None:
        self.allowances: dict[str, ProviderAllowance] = {}
        self.credentials: dict[str, MintedCredential] = {}

    def clear(self) -> None:
        """Forget every allowance and credential."""
        self.allowances.clear()
        self.credentials.clear()

    def find(self, provider: str, allowance_id: str) -> ProviderAllowance | None:
        """The allowance ``allowance_id`` if ``provider`` holds it."""
        return held_by(self.allowances, provider, allowance_id)


ALLOWANCES = web.AppKey("allowances", Allowances)
"""Application key of the :class:`Allowances` state."""

routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the allowance state and routes (API and admin) to ``app``; needs :mod:`sandbox.agentic`'s."""
    app[ALLOWANCES] = app[SANDBOX].register(Allowances())
    app.add_routes(routes)


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
    errors = _description_errors(body)
    if not (isinstance(enrollment_id, str) and enrollment_id):
        errors["enrollment_id"] = "must be a non-empty string"
    amount = _amount(body.get("amount"), "amount", errors)
    expires_at = _expiry(body.get("expires_at"), errors)
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
    if _behaviour(provider, enrollment) is _Behaviour.REJECT_SETUP:
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
        provider_ids={name: prefix + secrets.token_hex(8) for name, prefix in _PROVIDER_IDS[provider]},
    )
    app[ALLOWANCES].allowances[allowance.id] = allowance
    return Reply(201, allowance.view())


def _allowance_in_path(request: web.Request, resource: str, action: str) -> tuple[str, ProviderAllowance]:
    """The provider and the allowance named in the path, after counting the request under
    ``agentic.<provider>.<resource>.<action>``; 404 ``not_found`` when the provider does not hold it."""
    provider = provider_in_path(request)
    allowance = request.app[ALLOWANCES].find(provider, request.match_info["allowance_id"])
    sandbox_of(request).requests.count(endpoint_name(provider, resource, action), allowance.card if allowance else None)
    if allowance is None:
        raise not_found("allowance")
    return provider, allowance


@routes.get("/agentic/{provider}/allowances/{allowance_id}")
async def read_allowance(request: web.Request) -> web.Response:
    """200 with the allowance's current state; 404 if the provider does not hold it."""
    _, allowance = _allowance_in_path(request, "allowances", "read")
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
    provider, allowance = _allowance_in_path(request, "allowances", "update")
    body = await read_json_object(request)
    errors = _description_errors(body)
    amount = _amount(body["amount"], "amount", errors) if "amount" in body else None
    expires_at = _expiry(body["expires_at"], errors) if "expires_at" in body else None
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
    provider, allowance = _allowance_in_path(request, "allowances", "cancel")
    operation = partial(_cancel, allowance)
    return await respond_idempotently(request, ("allowance.cancel", provider, allowance.id), operation)


async def _cancel(allowance: ProviderAllowance) -> Reply:
    """Cancel ``allowance``; the cancel-failing card refuses the first attempt (each new key is one)."""
    allowance.cancel_attempts += 1
    failing = _behaviour(allowance.provider, allowance.enrollment) is _Behaviour.CANCEL_FAILS_ONCE
    if failing and allowance.cancel_attempts == 1:
        raise rejection("PROVIDER_ALLOWANCE_CANCEL_FAILED", "the cancellation failed at the provider; repeat it")
    allowance.status = "cancelled"
    return Reply(200, allowance.view())


@routes.post("/agentic/{provider}/allowances/{allowance_id}/verification")
async def start_verification(request: web.Request) -> web.Response:
    """Start (or restart) the allowance's verification: an OTP is sent; 201 ``{allowance_id, status:
    "otp_sent", attempts_remaining}``, or a 400/422 refusal."""
    provider, allowance = _allowance_in_path(request, "verifications", "start")
    operation = partial(_start_verification, allowance)
    return await respond_idempotently(request, ("verification.start", provider, allowance.id), operation)


def _verifiable(allowance: ProviderAllowance) -> None:
    """Raise the refusal of a verification call on an allowance that cannot be verified (now)."""
    if allowance.provider not in VERIFYING_PROVIDERS:
        raise SandboxError(400, "VERIFICATION_NOT_REQUIRED", f"{allowance.provider} allowances need no verification")
    if _behaviour(allowance.provider, allowance.enrollment) is _Behaviour.NO_VERIFICATION:
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
    provider, allowance = _allowance_in_path(request, "verifications", "otp")
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


@dataclass(frozen=True)
class MintRequest:
    """A validated mint: the format, the amount and, for ``mpp``, the merchant's key set and challenge."""

    format: str
    amount: Amount
    key_set: dict[str, Any] | None
    challenge: str | None


@routes.post("/agentic/{provider}/allowances/{allowance_id}/credentials")
async def mint_credential(request: web.Request) -> web.Response:
    """Mint a payment credential; 201 with it (its value this once) or a 422 refusal."""
    provider, allowance = _allowance_in_path(request, "credentials", "create")
    body = await read_json_object(request)
    errors: dict[str, str] = {}
    if body.get("format") not in FORMATS[provider]:
        errors["format"] = f"must be one of {', '.join(FORMATS[provider])}"
    amount = _amount(body.get("amount"), "amount", errors)
    key_set, challenge = _mpp_fields(body, errors)
    require_valid(errors)
    assert amount is not None, "a malformed amount is in errors"
    ask = MintRequest(body["format"], amount, key_set, challenge)
    operation = partial(_mint, request.app[SANDBOX], request.app[ALLOWANCES], allowance, ask)
    return await respond_idempotently(request, ("credential.mint", provider, allowance.id), operation)


def _mpp_fields(body: dict[str, Any], errors: dict[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """``mpp.key_set`` and ``mpp.challenge`` (required for the ``mpp`` format, ignored otherwise)."""
    if body.get("format") != "mpp":
        return None, None
    mpp = body.get("mpp")
    if not isinstance(mpp, dict):
        errors["mpp"] = "must be an object {key_set, challenge} for the mpp format"
        return None, None
    key_set, challenge = mpp.get("key_set"), mpp.get("challenge")
    if not (isinstance(key_set, dict) and isinstance(key_set.get("keys"), list) and key_set["keys"]):
        errors["mpp.key_set"] = "must be a JWK set {keys: [...]} with at least one key"
    elif any(not isinstance(key, dict) or "d" in key for key in key_set["keys"]):
        errors["mpp.key_set"] = "must hold public JWKs only"
    if not (isinstance(challenge, str) and 0 < len(challenge) <= MAX_CHALLENGE_LENGTH):
        errors["mpp.challenge"] = f"must be a string of 1 to {MAX_CHALLENGE_LENGTH} characters"
    return key_set, challenge


async def _mint(sandbox: Sandbox, state: Allowances, allowance: ProviderAllowance, ask: MintRequest) -> Reply:
    """Mint ``ask`` on ``allowance`` (which must be active, unexpired, in the currency, with room)."""
    status = allowance.current_status
    if status != "active":
        code = "ALLOWANCE_NOT_ACTIVE" if status == "inactive" else f"ALLOWANCE_{status.upper()}"
        raise rejection(code, f"the allowance is {status}")
    if ask.amount.currency != allowance.amount.currency:
        raise rejection("CURRENCY_MISMATCH", "the amount is not in the allowance's currency")
    if allowance.spent + ask.amount.value > allowance.amount.value:
        raise rejection("AMOUNT_EXCEEDED", "the amount exceeds what the allowance has left")
    behaviour = _behaviour(allowance.provider, allowance.enrollment)
    if behaviour is _Behaviour.MINT_HANGS:
        await hang(sandbox)
    if behaviour is _Behaviour.MINT_FAILS:
        raise rejection("PROVIDER_CREDENTIALS_FAILED", "the provider issued no credential")
    minted = MintedCredential(f"cred_{secrets.token_hex(12)}", allowance, ask.format, ask.amount, _now())
    value = _credential_value(minted, ask)
    allowance.spent += ask.amount.value
    allowance.credentials += 1
    state.credentials[minted.id] = minted
    return Reply(
        201,
        {
            "id": minted.id,
            "allowance_id": allowance.id,
            "provider": allowance.provider,
            "format": minted.format,
            "amount": minted.amount.view(),
            "credential": value,
            "expires_at": _timestamp(allowance.expires_at),
            "created_at": _timestamp(minted.created_at),
        },
    )


def _credential_value(minted: MintedCredential, ask: MintRequest) -> dict[str, Any]:
    """The credential in its format: card fields, ``{id}``, or ``{token}`` sealed for the merchant."""
    allowance = minted.allowance
    if allowance.provider == "psp":
        inner: dict[str, Any] = {"id": f"spt_{secrets.token_hex(12)}"}
    else:
        body = CREDENTIAL_NUMBER_PREFIX + f"{secrets.randbelow(1000):03d}"
        inner = {
            "number": body + luhn_check_digit(body),
            "expiration_month": allowance.expires_at.month,
            "expiration_year": allowance.expires_at.year,
            "cvc": f"{secrets.randbelow(1000):03d}",
        }
    if ask.format != "mpp":
        return inner
    return {"token": _seal(minted, inner, ask)}


def _seal(minted: MintedCredential, inner: dict[str, Any], ask: MintRequest) -> str:
    """The MPP token: a compact JWE (``ECDH-ES``, ``A256GCM``, ``typ`` ``mpp+jwe``, the key's ``kid``)
    for the first usable key of the merchant's set, over ``{challenge, credential_id, provider,
    amount, credential, iat, exp}``; 422 ``MPP_KEY_UNSUPPORTED`` when the set has no usable key."""
    key = _recipient_key(ask.key_set or {})
    if key is None:
        raise rejection("MPP_KEY_UNSUPPORTED", "the key set holds no X25519 or P-256 encryption key")
    issued = int(minted.created_at.timestamp())
    claims = {
        "challenge": ask.challenge,
        "credential_id": minted.id,
        "provider": minted.allowance.provider,
        "amount": minted.amount.view(),
        "credential": inner,
        "iat": issued,
        "exp": int(minted.allowance.expires_at.timestamp()),
    }
    header = {**MPP_ALGORITHM, "typ": "mpp+jwe", **({"kid": key.kid} if key.kid else {})}
    return jwe.encrypt_compact(header, json.dumps(claims).encode(), key)


_RECIPIENT_KINDS: dict[tuple[str, str], type[OKPKey] | type[ECKey]] = {
    ("OKP", "X25519"): OKPKey,
    ("EC", "P-256"): ECKey,
}


def _recipient_key(key_set: dict[str, Any]) -> OKPKey | ECKey | None:
    """The first key of ``key_set`` usable for ``ECDH-ES``: OKP X25519 or EC P-256, ``use`` absent or
    ``enc``; keys that do not import are skipped."""
    for entry in key_set.get("keys", []):
        kind = _RECIPIENT_KINDS.get((entry.get("kty"), entry.get("crv")))
        if kind is None or entry.get("use", "enc") != "enc":
            continue
        try:
            return kind.import_key(entry)
        except (JoseError, ValueError, TypeError):
            continue
    return None


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


@routes.get("/_admin/credentials")
async def admin_credentials(request: web.Request) -> web.Response:
    """200 ``{credentials: [...], count}``: credentials minted (never their values), filtered by
    ``provider``, ``allowance_id``, ``format`` and card (``pan_last4``, ``par``, ``pan``), oldest first."""
    cards = CardFilter.from_query(request.query)
    wanted = {name: request.query.get(name) for name in ("provider", "allowance_id", "format")}
    views = (
        credential.admin_view()
        for credential in request.app[ALLOWANCES].credentials.values()
        if cards.matches(credential.allowance.card)
    )
    credentials = [view for view in views if all(value in (None, view[name]) for name, value in wanted.items())]
    return web.json_response({"credentials": credentials, "count": len(credentials)})
