"""The agentic payment providers ``vic``, ``agentpay`` and ``psp``: adapter interface and HTTP adapter.

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

Failures are classified for the job template (``infra/task.py``):

* :class:`EnrollmentFailed` (a :class:`infra.jobs.PermanentError`): the provider answered a
  rejection (422 and other 4xx), or did not answer in time once the request was sent (a read
  timeout: the outcome is unknown and the same key would only wait again; the rail records
  ``PROVIDER_ENROLLMENT_FAILED`` and can be retried). ``code`` is always a code of the error
  catalogue; the provider's own code and correlation id ride beside it.
* :class:`infra.jobs.TransientError`: connection failures, connect timeouts, 408, 429 and 5xx
  answers: retried with backoff.

Nothing here logs or keeps the card number, the security code or a provider's message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import urllib3

from config.settings import Settings
from infra.jobs import PermanentError, TransientError
from providers import HttpClient, ProviderAnswer

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
    "brand", "bin", "last4", "expiration_month", "expiration_year", "funding", "type", "segment", "issuer",
    "issuer_country", "display",
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


class EnrollmentFailed(PermanentError):
    """A conclusive enrollment failure: ``code`` from the error catalogue, ``provider_code`` (the
    provider's own code, or None) and ``correlation_id`` (the provider's correlation id, or None)."""

    def __init__(self, code: str, message: str, *, provider_code: str | None = None,
                 correlation_id: str | None = None, status: int = 422):
        super().__init__(code, message, status=status)
        self.provider_code = provider_code
        self.correlation_id = correlation_id


class AgenticProvider(Protocol):
    """What the platform asks of an agentic provider."""

    name: str

    def enroll(self, card: EnrollmentCard, consumer: dict[str, Any], *, attempt: str,
               idempotency_key: str) -> Enrollment:
        """Enroll ``card`` for ``consumer`` (``attempt``: ``create`` or ``retry``)."""

    def get_enrollment(self, enrollment_id: str) -> Enrollment:
        """The enrollment's current state; EnrollmentFailed when the provider no longer holds it."""

    def delete_enrollment(self, enrollment_id: str) -> None:
        """Remove the enrollment (idempotent: an unknown enrollment is already removed)."""


def provider_for(name: str, tenant_type: str, settings: Settings) -> AgenticProvider | None:
    """The adapter of provider ``name`` for a tenant of ``tenant_type`` (``test`` or ``production``).

    Test tenants get the sandbox; production tenants the live URL, or None when it is not set.
    Raises ValueError for an unknown provider name.
    """
    if name not in PROVIDERS:
        raise ValueError(f"unknown agentic provider {name}")
    if tenant_type == "test":
        base_url = f"{settings.sandbox_url.rstrip('/')}/agentic/{name}"
    else:
        base_url = getattr(settings, LIVE_URL_SETTINGS[name])
        if not base_url:
            return None
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

    def enroll(self, card: EnrollmentCard, consumer: dict[str, Any], *, attempt: str,
               idempotency_key: str) -> Enrollment:
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

    def _call(self, method: str, path: str, body: Any = None, *, idempotency_key: str | None = None
              ) -> ProviderAnswer:
        try:
            return self.http.call(method, path, body, idempotency_key=idempotency_key)
        except TransientError as exc:
            if isinstance(exc.__cause__, urllib3.exceptions.ReadTimeoutError):
                # The request reached the provider, which did not answer: asking again with the same
                # key would only wait on the same operation. Conclusive for this attempt.
                raise EnrollmentFailed(
                    UNCLASSIFIED, f"{self.name} did not answer within {self.read_timeout:g} s"
                ) from None
            raise


def _enrollment(body: Any) -> Enrollment:
    if not isinstance(body, dict) or not isinstance(body.get("id"), str) or body.get("status") not in (
        "enabled", "pending"
    ):
        raise EnrollmentFailed(UNCLASSIFIED, "the provider answered an enrollment the platform cannot read")
    ids = body.get("provider_ids") if isinstance(body.get("provider_ids"), dict) else {}
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


def _rejection(answer: ProviderAnswer) -> EnrollmentFailed:
    body = answer.body if isinstance(answer.body, dict) else {}
    provider_code = body.get("code") if isinstance(body.get("code"), str) else None
    correlation = body.get("provider_correlation_id")
    code = provider_code if provider_code in CATALOGUE_ENROLLMENT_CODES else UNCLASSIFIED
    return EnrollmentFailed(
        code,
        f"the provider answered {answer.status}",
        provider_code=(provider_code or f"HTTP_{answer.status}")[:100],
        correlation_id=correlation[:200] if isinstance(correlation, str) else None,
        status=409 if code == "RAIL_ALREADY_ENROLLED" else 422,
    )
