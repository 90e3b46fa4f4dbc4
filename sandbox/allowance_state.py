"""The simulated agentic providers' allowances, their state: the allowance and credential records,
the special outcomes of the allowance test cards, the parsing of amounts and expiries the allowance
and credential routes share (:mod:`sandbox.allowances`, :mod:`sandbox.credentials`).

Outcomes follow ``SANDBOX.md`` (Agentic providers: allowances, verification, credentials) and depend on
the provider and on the card behind the allowance's enrollment only: see :data:`BEHAVIOURS` and
``sandbox/README.md``. Minted credential values are returned once and never kept: the records hold
what was minted, not the values.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Any

from aiohttp import web

from sandbox.agentic import PROVIDER_BRANDS, Enrollment, endpoint_name, held_by, provider_in_path
from sandbox.cards import CardRef
from sandbox.replies import not_found
from sandbox.state import sandbox_of

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
PROVIDER_IDS = {
    "vic": (("mandate_reference", "vic_mdt_"),),
    "agentpay": (("agent_mandate_id", "ap_mdt_"),),
    "psp": (("spending_limit", "psp_sl_"),),
}


class Behaviour(Enum):
    """Special outcomes of the allowance test cards."""

    REJECT_SETUP = "422 PROVIDER_ALLOWANCE_FAILED on create"
    MINT_FAILS = "422 PROVIDER_CREDENTIALS_FAILED on every mint"
    MINT_HANGS = "no answer to a mint for hang_seconds"
    CANCEL_FAILS_ONCE = "422 PROVIDER_ALLOWANCE_CANCEL_FAILED on the first cancellation"
    NO_VERIFICATION = "422 VERIFICATION_NOT_SUPPORTED on every verification start"


# card number -> (behaviour, providers showing it)
BEHAVIOURS = {
    "4000000000004012": (Behaviour.REJECT_SETUP, frozenset({"vic"})),
    "4000000000004020": (Behaviour.MINT_FAILS, frozenset(PROVIDER_BRANDS)),
    "4000000000004038": (Behaviour.MINT_HANGS, frozenset(PROVIDER_BRANDS)),
    # at vic alone: the platform's DELETE cancels at every provider, so the repeated DELETE succeeds
    "4000000000004046": (Behaviour.CANCEL_FAILS_ONCE, frozenset({"vic"})),
    "4000000000004053": (Behaviour.NO_VERIFICATION, frozenset({"vic"})),
}


def special_behaviour(provider: str, enrollment: Enrollment) -> Behaviour | None:
    """The special outcome of ``enrollment``'s card at ``provider``, None for the ordinary one."""
    behaviour, providers = BEHAVIOURS.get(enrollment.card.pan, (None, frozenset()))
    return behaviour if provider in providers else None


def now() -> datetime.datetime:
    """The current time, UTC."""
    return datetime.datetime.now(datetime.UTC)


def timestamp(moment: datetime.datetime) -> str:
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


def parse_amount(raw: object, path: str, errors: dict[str, str]) -> Amount | None:
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


def parse_expiry(raw: object, errors: dict[str, str]) -> datetime.datetime | None:
    """``raw`` as a future aware datetime; None after adding a message to ``errors`` otherwise."""
    try:
        moment = datetime.datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        errors["expires_at"] = "must be an ISO 8601 date-time with a time zone"
        return None
    if moment <= now():
        errors["expires_at"] = "must be in the future"
        return None
    return moment


def description_errors(body: dict[str, Any]) -> dict[str, str]:
    """``{"description": message}`` when the body's ``description`` is not null nor a string of at most
    :data:`MAX_DESCRIPTION_LENGTH` characters, else ``{}``."""
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
        return "expired" if self.status != "cancelled" and self.expires_at <= now() else self.status

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
            "expires_at": timestamp(self.expires_at),
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

    def view(self, value: dict[str, Any]) -> dict[str, Any]:
        """The mint's answer: ``{id, allowance_id, provider, format, amount, credential, expires_at,
        created_at}``, ``credential`` being ``value`` (shown this once)."""
        return {
            "id": self.id,
            "allowance_id": self.allowance.id,
            "provider": self.allowance.provider,
            "format": self.format,
            "amount": self.amount.view(),
            "credential": value,
            "expires_at": timestamp(self.allowance.expires_at),
            "created_at": timestamp(self.created_at),
        }

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
            "created_at": timestamp(self.created_at),
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


def allowance_in_path(request: web.Request, resource: str, action: str) -> tuple[str, ProviderAllowance]:
    """The provider and the allowance named in the path, after counting the request under
    ``agentic.<provider>.<resource>.<action>``; 404 ``not_found`` when the provider does not hold it."""
    provider = provider_in_path(request)
    allowance = request.app[ALLOWANCES].find(provider, request.match_info["allowance_id"])
    sandbox_of(request).requests.count(endpoint_name(provider, resource, action), allowance.card if allowance else None)
    if allowance is None:
        raise not_found("allowance")
    return provider, allowance
