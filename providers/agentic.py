"""The agentic payment providers ``vic``, ``agentpay`` and ``psp``: the adapter interface, its value types
and failure classes (the HTTP adapter is :mod:`providers.agentic_http`).

Spec 001 sections 2 and 4 (Rails and providers); the wire contract is ``sandbox/README.md``
(Agentic providers), which the live providers share. Which base URL a call goes to:

* a **test** tenant: the sandbox, ``{TESSERA_SANDBOX_URL}/agentic/<provider>``;
* a **production** tenant: the live URL of the provider from the settings (``vic_url``,
  ``agentpay_url``, ``psp_url``), which is the provider API's base: the adapter calls
  ``{vic_url}/enrollments``. Unset: :func:`provider_for` answers None and the rail records
  ``PROVIDER_NOT_CONFIGURED``.

Every enrollment carries an ``Idempotency-Key`` (the job id): a job run twice (a worker died after
the call) asks once more with the same key and the provider answers the stored outcome, so a rail
is never enrolled twice. Calls time out after ``agentic_provider_timeout_seconds`` (read) and
``provider_connect_timeout_seconds`` (connect).

The allowance calls (spec 001 section 7; shapes in ``sandbox/README.md``) work the same way: set up an
allowance on an enrollment, update it, cancel it, start its verification, submit the OTP, mint a
payment credential. Each takes the caller's ``idempotency_key`` (required): the provider answers the
same for the same key, so a job run twice has one effect.

Failures are classified for the job template (``infra/task.py``):

* :class:`ProviderRejection` (a :class:`infra.jobs.PermanentError`; :class:`EnrollmentFailed` for
  enrollments): the provider answered a rejection (4xx), or did not answer in time once the request
  was sent (a read timeout: the same key would only wait again). ``code`` is always a code of the
  error catalogue: the provider's own code when it is one the operation may answer
  (:data:`OPERATIONS`), else the operation's own failure code (``PROVIDER_ENROLLMENT_FAILED``,
  ``PROVIDER_ALLOWANCE_FAILED`` ...); the provider's code and correlation id ride beside it.
* :class:`CredentialOutcomeUnknown` (also permanent): a mint whose read timed out. The provider may
  have issued a credential, so the platform must not treat it as a conclusive failure
  (``CREDENTIAL_OUTCOME_UNKNOWN``, spec 001 section 7, Unknown outcome).
* :class:`infra.jobs.TransientError`: connection failures, connect timeouts, 408, 429 and 5xx
  answers: ask again with the same key (for a mint: when the platform gives up on those, only a
  failure to connect proves that nothing was issued).

Nothing here logs or keeps the card number, the security code or a provider's message.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from infra.jobs import PermanentError

PROVIDERS: tuple[str, ...] = ("vic", "agentpay", "psp")
"""The agentic providers, by the names the API shows."""

#: provider -> the setting holding its live base URL
LIVE_URL_SETTINGS = {"vic": "vic_url", "agentpay": "agentpay_url", "psp": "psp_url"}

#: Provider rejection codes that are themselves codes of the error catalogue (spec 001 section 7);
#: any other rejection is unclassifiable and records PROVIDER_ENROLLMENT_FAILED.
CATALOGUE_ENROLLMENT_CODES = frozenset(
    {"CARD_REJECTED", "PROVIDER_ENROLLMENT_FAILED", "RAIL_ENROLLMENT_INVALID", "RAIL_ALREADY_ENROLLED"}
)
UNCLASSIFIED = "PROVIDER_ENROLLMENT_FAILED"

#: The card fields the payment method's ``card`` object may hold (spec 001 section 2, Card object).
CARD_FIELDS = (
    "brand",
    "bin",
    "last4",
    "expiration_month",
    "expiration_year",
    "funding",
    "type",
    "segment",
    "issuer",
    "issuer_country",
    "display",
)
DISPLAY_FIELDS = ("art_url", "background_color", "foreground_color", "description", "issuer_name")


@dataclass(frozen=True)
class EnrollmentCard:
    """The card sent to a provider: read from the card token by the worker, never stored elsewhere."""

    pan: str
    expiration_month: int
    expiration_year: int
    cvc: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:  # never show the number
        return f"EnrollmentCard(last4={self.pan[-4:]!r})"


@dataclass(frozen=True)
class Enrollment:
    """A provider's enrollment: ``status`` ``enabled`` or ``pending``; ``card`` the display data
    (already reduced to :data:`CARD_FIELDS`); ``provider_ids`` string -> string."""

    id: str
    status: str
    provider_ids: dict[str, str]
    card: dict[str, Any] | None


class ProviderRejection(PermanentError):
    """A conclusive provider failure: ``code`` from the error catalogue, ``status`` its HTTP status
    there, ``provider_code`` (the provider's own code, or None), ``correlation_id`` (the provider's
    correlation id, or None) and ``attempts_remaining`` (wrong OTPs still allowed, for INVALID_OTP)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        provider_code: str | None = None,
        correlation_id: str | None = None,
        status: int = 422,
        attempts_remaining: int | None = None,
    ):
        super().__init__(code, message, status=status)
        self.provider_code = provider_code
        self.correlation_id = correlation_id
        self.attempts_remaining = attempts_remaining


class EnrollmentFailed(ProviderRejection):
    """A conclusive enrollment failure (see :class:`ProviderRejection`)."""


class CredentialOutcomeUnknown(PermanentError):
    """A mint was sent and no answer came within the read timeout: a credential may have been issued
    whose value is lost. ``code`` ``CREDENTIAL_OUTCOME_UNKNOWN``, ``status`` 409 (spec 001 section 7)."""

    def __init__(self, message: str):
        super().__init__("CREDENTIAL_OUTCOME_UNKNOWN", message, status=409)


@dataclass(frozen=True)
class Operation:
    """How the answers of one kind of provider call are classified: ``failure`` is the catalogue code
    of an unclassifiable rejection or read timeout; ``passed`` maps the provider codes that are
    catalogue codes this call may answer to their HTTP status (spec 001 section 7)."""

    failure: str
    failure_status: int
    passed: dict[str, int]


#: Operation name -> its classification.
OPERATIONS = {
    "enrollment": Operation(
        UNCLASSIFIED,
        422,
        {code: 409 if code == "RAIL_ALREADY_ENROLLED" else 422 for code in CATALOGUE_ENROLLMENT_CODES},
    ),
    "allowance": Operation("PROVIDER_ALLOWANCE_FAILED", 422, {}),
    "allowance_update": Operation("PROVIDER_ALLOWANCE_UPDATE_FAILED", 422, {}),
    "allowance_cancel": Operation("PROVIDER_ALLOWANCE_CANCEL_FAILED", 500, {}),
    "verification": Operation(
        "PROVIDER_VERIFICATION_FAILED",
        422,
        {
            "INVALID_OTP": 400,
            "VERIFICATION_NOT_SUPPORTED": 422,
            "VERIFICATION_NOT_REQUIRED": 400,
            "VERIFICATION_STATE_INVALID": 400,
        },
    ),
    "credentials": Operation("PROVIDER_CREDENTIALS_FAILED", 422, {}),
}

#: Credential formats per provider (spec 001 section 4, Rails and providers).
CREDENTIAL_FORMATS = {
    "vic": ("card", "network-token", "mpp"),
    "agentpay": ("card", "network-token", "mpp"),
    "psp": ("identifier", "mpp"),
}


@dataclass(frozen=True)
class Amount:
    """An exact amount: ``value`` a finite Decimal (never a float: TypeError), ``currency`` an ISO 4217
    code."""

    value: Decimal
    currency: str

    def __post_init__(self) -> None:
        if not isinstance(self.value, Decimal) or not self.value.is_finite():
            raise TypeError("an amount's value is a finite Decimal")

    def wire(self) -> dict[str, str]:
        """``{"value": "25.00", "currency": "USD"}`` as the providers take it (plain notation)."""
        return {"value": format(self.value, "f"), "currency": self.currency}


@dataclass(frozen=True)
class ProviderAllowance:
    """An allowance at a provider: ``status`` ``inactive`` (awaiting verification), ``active``,
    ``cancelled`` or ``expired``; ``amount_spent`` what the provider counts as minted;
    ``provider_ids`` string -> string (informational)."""

    id: str
    status: str
    verification_required: bool
    amount: Amount
    amount_spent: Amount
    expires_at: datetime.datetime
    provider_ids: dict[str, str]


@dataclass(frozen=True)
class VerificationState:
    """A verification step's outcome: ``status`` ``otp_sent`` or ``verified``; ``attempts_remaining``
    wrong codes still allowed."""

    status: str
    attempts_remaining: int


@dataclass(frozen=True)
class MppRequest:
    """What an ``mpp`` mint seals the credential for: the merchant's JWK set (public keys, as fetched
    from its key-set address) and its challenge."""

    key_set: dict[str, Any]
    challenge: str


@dataclass(frozen=True)
class MintedCredential:
    """A payment credential the provider issued: ``credential`` is its value, returned to the caller
    once and never stored readable: ``{number, expiration_month, expiration_year, cvc}`` (card,
    network-token), ``{id}`` (identifier) or ``{token}`` (mpp). ``repr`` never shows it."""

    id: str
    format: str
    amount: Amount
    expires_at: datetime.datetime
    credential: dict[str, Any] = field(repr=False)


class AgenticProvider(Protocol):
    """What the platform asks of an agentic provider."""

    name: str

    def enroll(
        self, card: EnrollmentCard, consumer: dict[str, Any], *, attempt: str, idempotency_key: str
    ) -> Enrollment:
        """Enroll ``card`` for ``consumer`` (``attempt``: ``create`` or ``retry``)."""

    def get_enrollment(self, enrollment_id: str) -> Enrollment:
        """The enrollment's current state; EnrollmentFailed when the provider no longer holds it."""

    def delete_enrollment(self, enrollment_id: str) -> None:
        """Remove the enrollment (idempotent: an unknown enrollment is already removed)."""

    def create_allowance(
        self,
        enrollment_id: str,
        amount: Amount,
        expires_at: datetime.datetime,
        description: str | None,
        *,
        idempotency_key: str,
    ) -> ProviderAllowance:
        """Set up an allowance on the enrollment; ProviderRejection PROVIDER_ALLOWANCE_FAILED."""

    def update_allowance(
        self,
        allowance_id: str,
        *,
        idempotency_key: str,
        amount: Amount | None = None,
        expires_at: datetime.datetime | None = None,
        description: str | None = None,
    ) -> ProviderAllowance:
        """Change the allowance; ProviderRejection PROVIDER_ALLOWANCE_UPDATE_FAILED."""

    def cancel_allowance(self, allowance_id: str, *, idempotency_key: str) -> None:
        """Cancel the allowance; ProviderRejection PROVIDER_ALLOWANCE_CANCEL_FAILED (500)."""

    def start_verification(self, allowance_id: str, *, idempotency_key: str) -> VerificationState:
        """Send an OTP; ProviderRejection VERIFICATION_NOT_SUPPORTED, VERIFICATION_NOT_REQUIRED ..."""

    def submit_otp(self, allowance_id: str, otp: str, *, idempotency_key: str) -> VerificationState:
        """Check the OTP; ProviderRejection INVALID_OTP, PROVIDER_VERIFICATION_FAILED ..."""

    def mint_credential(
        self, allowance_id: str, *, credential_format: str, amount: Amount, mpp: MppRequest | None, idempotency_key: str
    ) -> MintedCredential:
        """Mint a credential; ProviderRejection PROVIDER_CREDENTIALS_FAILED, CredentialOutcomeUnknown."""
