"""The HTTP adapter of the agentic payment providers (:mod:`providers.agentic` holds the interface,
the value types and the failure classes; the module docstring there says how calls are made and how
failures are classified) and the choice of adapter for a tenant (:func:`require_provider`)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

import urllib3

from config.settings import Settings
from infra.jobs import PermanentError, TransientError
from providers import HttpClient, ProviderAnswer, ProviderNotConfigured
from providers.agentic import (
    CARD_FIELDS,
    CREDENTIAL_FORMATS,
    DISPLAY_FIELDS,
    LIVE_URL_SETTINGS,
    OPERATIONS,
    PROVIDERS,
    UNCLASSIFIED,
    AgenticProvider,
    Amount,
    CredentialOutcomeUnknown,
    Enrollment,
    EnrollmentCard,
    EnrollmentFailed,
    MintedCredential,
    MppRequest,
    ProviderAllowance,
    ProviderRejection,
    VerificationState,
)


def provider_for(name: str, tenant_type: str, settings: Settings) -> AgenticProvider | None:
    """:func:`require_provider`, or None when the provider is not configured for the tenant (a check
    made before any work is recorded)."""
    try:
        return require_provider(name, tenant_type, settings)
    except ProviderNotConfigured:
        return None


def require_provider(name: str, tenant_type: str, settings: Settings) -> AgenticProvider:
    """The adapter of provider ``name`` for a tenant of ``tenant_type`` (``test`` or ``production``).

    Test tenants get the sandbox; production tenants the live URL. Raises
    :class:`providers.ProviderNotConfigured` (``<name> is not configured``) when that is not set,
    ValueError for an unknown provider name.
    """
    if name not in PROVIDERS:
        raise ValueError(f"unknown agentic provider {name}")
    if tenant_type == "test":
        base_url = f"{settings.sandbox_url.rstrip('/')}/agentic/{name}"
    else:
        base_url = getattr(settings, LIVE_URL_SETTINGS[name])
        if not base_url:
            raise ProviderNotConfigured(name, f"{name} is not configured")
    return HttpAgenticProvider(
        name,
        base_url,
        connect_timeout=settings.provider_connect_timeout_seconds,
        read_timeout=settings.agentic_provider_timeout_seconds,
    )


class HttpAgenticProvider:
    """JSON over HTTP to one provider's enrollment API at ``base_url`` (see the module docstring)."""

    def __init__(self, name: str, base_url: str, *, connect_timeout: float, read_timeout: float):
        self.name = name
        self.read_timeout = read_timeout
        self.http = HttpClient(base_url, name=name, connect_timeout=connect_timeout, read_timeout=read_timeout)

    def enroll(
        self, card: EnrollmentCard, consumer: dict[str, Any], *, attempt: str, idempotency_key: str
    ) -> Enrollment:
        """``POST /enrollments``: 201 -> :class:`Enrollment`; rejections -> :class:`EnrollmentFailed`."""
        body: dict[str, Any] = {
            "pan": card.pan,
            "expiration_month": card.expiration_month,
            "expiration_year": card.expiration_year,
            "consumer": {k: v for k, v in consumer.items() if v is not None},
            "attempt": attempt,
        }
        if card.cvc:
            body["cvc"] = card.cvc
        answer = self._call("POST", "/enrollments", body, idempotency_key=idempotency_key)
        if answer.status in (200, 201):
            return _enrollment(answer.body)
        raise _rejection(answer)

    def get_enrollment(self, enrollment_id: str) -> Enrollment:
        """``GET /enrollments/{id}``; a 404 means the provider dropped it: EnrollmentFailed."""
        answer = self._call("GET", f"/enrollments/{enrollment_id}")
        if answer.status == 200:
            return _enrollment(answer.body)
        raise _rejection(answer)

    def delete_enrollment(self, enrollment_id: str) -> None:
        """``DELETE /enrollments/{id}``: 2xx and 404 both mean removed."""
        answer = self._call("DELETE", f"/enrollments/{enrollment_id}")
        if answer.status < 300 or answer.status == 404:
            return
        raise _rejection(answer)

    def create_allowance(
        self,
        enrollment_id: str,
        amount: Amount,
        expires_at: datetime.datetime,
        description: str | None,
        *,
        idempotency_key: str,
    ) -> ProviderAllowance:
        """``POST /allowances`` on the enrollment: 201 -> :class:`ProviderAllowance` (``inactive`` while
        it needs verification); a rejection or read timeout -> :class:`ProviderRejection`
        ``PROVIDER_ALLOWANCE_FAILED`` (the rail's error, spec 001 section 7)."""
        body = {"enrollment_id": enrollment_id, "amount": amount.wire(), "expires_at": _wire_time(expires_at)}
        if description is not None:
            body["description"] = description
        answer = self._call("POST", "/allowances", body, idempotency_key=idempotency_key, operation="allowance")
        return _expect(answer, 201, "allowance", _allowance)

    def update_allowance(
        self,
        allowance_id: str,
        *,
        idempotency_key: str,
        amount: Amount | None = None,
        expires_at: datetime.datetime | None = None,
        description: str | None = None,
    ) -> ProviderAllowance:
        """``PATCH /allowances/{id}`` with the fields given (``description`` ``""`` clears it): 200 ->
        :class:`ProviderAllowance`; else :class:`ProviderRejection` ``PROVIDER_ALLOWANCE_UPDATE_FAILED``
        (the provider refused, e.g. an amount below what it counts as spent; spec 001 section 7)."""
        body: dict[str, Any] = {}
        if amount is not None:
            body["amount"] = amount.wire()
        if expires_at is not None:
            body["expires_at"] = _wire_time(expires_at)
        if description is not None:
            body["description"] = description
        answer = self._call(
            "PATCH", f"/allowances/{allowance_id}", body, idempotency_key=idempotency_key, operation="allowance_update"
        )
        return _expect(answer, 200, "allowance_update", _allowance)

    def cancel_allowance(self, allowance_id: str, *, idempotency_key: str) -> None:
        """``POST /allowances/{id}/cancel``: 200 and 404 (the provider holds no such allowance) both
        mean cancelled; else :class:`ProviderRejection` ``PROVIDER_ALLOWANCE_CANCEL_FAILED`` (status
        500: repeat the DELETE, spec 001 section 7). Each new attempt needs a new key: a key replays
        its first answer."""
        answer = self._call(
            "POST",
            f"/allowances/{allowance_id}/cancel",
            {},
            idempotency_key=idempotency_key,
            operation="allowance_cancel",
        )
        if answer.status not in (200, 404):
            raise _rejection(answer, "allowance_cancel")

    def start_verification(self, allowance_id: str, *, idempotency_key: str) -> VerificationState:
        """``POST /allowances/{id}/verification``: the provider sends an OTP; 201 ->
        :class:`VerificationState` ``otp_sent``. :class:`ProviderRejection` ``VERIFICATION_NOT_SUPPORTED``
        (422), ``VERIFICATION_NOT_REQUIRED`` (400), ``VERIFICATION_STATE_INVALID`` (400, already
        verified), else ``PROVIDER_VERIFICATION_FAILED``."""
        answer = self._call(
            "POST",
            f"/allowances/{allowance_id}/verification",
            {},
            idempotency_key=idempotency_key,
            operation="verification",
        )
        return _expect(answer, 201, "verification", _verification_state)

    def submit_otp(self, allowance_id: str, otp: str, *, idempotency_key: str) -> VerificationState:
        """``POST /allowances/{id}/verification/otp``: 200 -> :class:`VerificationState` ``verified``
        (the allowance is active). :class:`ProviderRejection` ``INVALID_OTP`` (400, with
        ``attempts_remaining``), ``PROVIDER_VERIFICATION_FAILED`` (the provider's attempt limit: start
        again), ``VERIFICATION_STATE_INVALID`` (no code awaited)."""
        answer = self._call(
            "POST",
            f"/allowances/{allowance_id}/verification/otp",
            {"otp": otp},
            idempotency_key=idempotency_key,
            operation="verification",
        )
        return _expect(answer, 200, "verification", _verification_state)

    def mint_credential(
        self, allowance_id: str, *, credential_format: str, amount: Amount, mpp: MppRequest | None, idempotency_key: str
    ) -> MintedCredential:
        """``POST /allowances/{id}/credentials``: 201 -> :class:`MintedCredential`.

        ``credential_format`` one of :data:`CREDENTIAL_FORMATS` for this provider (else ValueError, no
        call); ``mpp`` required for ``mpp``. A rejection -> :class:`ProviderRejection`
        ``PROVIDER_CREDENTIALS_FAILED`` (conclusive: nothing issued); a read timeout ->
        :class:`CredentialOutcomeUnknown` (spec 001 sections 7 and 8).
        """
        if credential_format not in CREDENTIAL_FORMATS[self.name]:
            raise ValueError(f"{self.name} does not mint {credential_format} credentials")
        if (credential_format == "mpp") != (mpp is not None):
            raise ValueError("mpp is required for the mpp format, and only for it")
        body: dict[str, Any] = {"format": credential_format, "amount": amount.wire()}
        if mpp is not None:
            body["mpp"] = {"key_set": mpp.key_set, "challenge": mpp.challenge}
        answer = self._call(
            "POST",
            f"/allowances/{allowance_id}/credentials",
            body,
            idempotency_key=idempotency_key,
            operation="credentials",
            on_timeout=CredentialOutcomeUnknown,
        )
        return _expect(answer, 201, "credentials", _minted)

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotency_key: str | None = None,
        operation: str = "enrollment",
        on_timeout: Callable[[str], PermanentError] | None = None,
    ) -> ProviderAnswer:
        """One call through :class:`providers.HttpClient`; a read timeout becomes ``on_timeout(message)``
        (default: the ``operation``'s :class:`ProviderRejection`)."""
        try:
            return self.http.call(method, path, body, idempotency_key=idempotency_key)
        except TransientError as exc:
            if isinstance(exc.__cause__, urllib3.exceptions.ReadTimeoutError):
                # The request reached the provider, which did not answer: asking again with the same
                # key would only wait on the same operation. Conclusive for this attempt.
                message = f"{self.name} did not answer within {self.read_timeout:g} s"
                if on_timeout is not None:
                    raise on_timeout(message) from None
                raise _failure(operation, message) from None
            raise


def _failure(operation: str, message: str, code: str | None = None, **details: Any) -> ProviderRejection:
    """A :class:`ProviderRejection` (:class:`EnrollmentFailed` for enrollments) of ``operation``: with
    ``code`` when it is one the operation passes on (:data:`OPERATIONS`), else the operation's own."""
    kind = EnrollmentFailed if operation == "enrollment" else ProviderRejection
    rule = OPERATIONS[operation]
    if code in rule.passed:
        return kind(code, message, status=rule.passed[code], **details)
    return kind(rule.failure, message, status=rule.failure_status, **details)


def _expect(answer: ProviderAnswer, status: int, operation: str, read: Callable[[Any], Any]) -> Any:
    """``read(body)`` when the answer has ``status`` (or 200), else the rejection it carries."""
    if answer.status not in (status, 200):
        raise _rejection(answer, operation)
    try:
        return read(answer.body)
    except (KeyError, TypeError, ValueError, InvalidOperation):
        raise _failure(operation, "the provider answered a body the platform cannot read") from None


def _wire_time(moment: datetime.datetime) -> str:
    """An aware datetime as ISO 8601 in UTC (ValueError for a naive one)."""
    if moment.tzinfo is None:
        raise ValueError("a time zone is required")
    return moment.astimezone(datetime.UTC).isoformat()


def _amount(body: Any) -> Amount:
    value, currency = body["value"], body["currency"]
    if not isinstance(value, str) or not isinstance(currency, str):
        raise TypeError("amount fields must be strings")
    return Amount(Decimal(value), currency)


def _time(value: Any) -> datetime.datetime:
    moment = datetime.datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError("a time zone is required")
    return moment


def _allowance(body: Any) -> ProviderAllowance:
    raw_ids = body.get("provider_ids")
    ids = raw_ids if isinstance(raw_ids, dict) else {}
    if body["status"] not in ("inactive", "active", "cancelled", "expired") or not isinstance(body["id"], str):
        raise ValueError("not an allowance")
    return ProviderAllowance(
        id=body["id"],
        status=body["status"],
        verification_required=body.get("verification_required") is True,
        amount=_amount(body["amount"]),
        amount_spent=_amount(body["amount_spent"]),
        expires_at=_time(body["expires_at"]),
        provider_ids={str(k): v for k, v in ids.items() if isinstance(v, str)},
    )


def _verification_state(body: Any) -> VerificationState:
    if body["status"] not in ("otp_sent", "verified"):
        raise ValueError("not a verification step")
    return VerificationState(status=body["status"], attempts_remaining=int(body.get("attempts_remaining") or 0))


def _minted(body: Any) -> MintedCredential:
    credential = body["credential"]
    if not isinstance(credential, dict) or not isinstance(body["id"], str):
        raise ValueError("not a credential")
    return MintedCredential(
        id=body["id"],
        format=str(body["format"]),
        amount=_amount(body["amount"]),
        expires_at=_time(body["expires_at"]),
        credential=credential,
    )


def _enrollment(body: Any) -> Enrollment:
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("id"), str)
        or body.get("status") not in ("enabled", "pending")
    ):
        raise EnrollmentFailed(UNCLASSIFIED, "the provider answered an enrollment the platform cannot read")
    raw_ids = body.get("provider_ids")
    ids = raw_ids if isinstance(raw_ids, dict) else {}
    return Enrollment(
        id=body["id"],
        status=body["status"],
        provider_ids={str(k): v for k, v in ids.items() if isinstance(v, str)},
        card=display_card(body.get("card")),
    )


def display_card(card: Any) -> dict[str, Any] | None:
    """The provider's card reduced to the fields of the spec's card object (anything else, a number
    in particular, is dropped); None when the provider sent none."""
    if not isinstance(card, dict):
        return None
    kept = {name: card[name] for name in CARD_FIELDS if name in card}
    if isinstance(kept.get("display"), dict):
        kept["display"] = {name: kept["display"].get(name) for name in DISPLAY_FIELDS}
    elif "display" in kept:
        del kept["display"]
    for name in ("issuer", "issuer_country"):
        if name in kept and not isinstance(kept[name], dict):
            del kept[name]
    kept["type"] = "card"
    return kept


def _rejection(answer: ProviderAnswer, operation: str = "enrollment") -> ProviderRejection:
    """The :class:`ProviderRejection` of a 4xx answer to an ``operation`` call (see :data:`OPERATIONS`)."""
    body = answer.body if isinstance(answer.body, dict) else {}
    provider_code = body.get("code") if isinstance(body.get("code"), str) else None
    correlation = body.get("provider_correlation_id")
    remaining = body.get("attempts_remaining")
    details = {
        "provider_code": (provider_code or f"HTTP_{answer.status}")[:100],
        "correlation_id": correlation[:200] if isinstance(correlation, str) else None,
        "attempts_remaining": remaining if isinstance(remaining, int) and not isinstance(remaining, bool) else None,
    }
    return _failure(operation, f"the provider answered {answer.status}", provider_code, **details)
