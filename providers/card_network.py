"""The card network adapter: network tokens (provision, card art, cryptogram, suspend, resume, delete).

:class:`CardNetwork` is the interface every card network adapter offers; :class:`HttpCardNetwork`
speaks the card-network HTTP contract of ``sandbox/README.md`` ("Card networks: network tokens") over
:class:`providers.HttpClient` (timeouts from the ``provider_*_timeout_seconds`` settings, the
caller's idempotency key on every mutating call). :func:`card_network_for` picks the sandbox for test
tenants and the live network configured by ``card_network_url`` for production tenants (422
:class:`providers.ProviderNotConfigured` when there is none).

Failures are classified for the job template (``infra/task.py``): connection errors, timeouts, 408,
429 and 5xx are :class:`infra.jobs.TransientError` (retried with backoff); other 4xx answers are
:class:`infra.jobs.PermanentError` carrying the network's ``code`` (``card_not_eligible``,
``network_not_supported``, ``token_not_active``, ``token_deleted``, ``not_found``, ...) and the HTTP
status the platform's API answers it with; a 2xx answer whose body does not have the documented
shape is transient too (the same idempotency key replays the stored answer, so a retry is safe).

The class is meant to be extended: the account-updater batch call joins it as one more method of
:class:`CardNetwork`, implemented by :class:`HttpCardNetwork` with the same :meth:`HttpCardNetwork._call`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from config.settings import Settings, get_settings
from infra.jobs import PermanentError, TransientError
from providers import HttpClient, ProviderAnswer, ProviderNotConfigured, permanent_from_answer

PROVIDER_NAME = "card network"
SANDBOX_PATH = "/card-network"
"""Where the sandbox serves the card-network contract under ``TESSERA_SANDBOX_URL``."""

# The network's own 4xx statuses -> the status the platform answers with (others: 422).
_STATUS_OF_ANSWER = {404: 404, 409: 409}


class HasTenantType(Protocol):
    """A caller or tenant: anything that says whether it is a ``test`` or ``production`` tenant."""

    @property
    def tenant_type(self) -> str: ...


@dataclass(frozen=True)
class CardToProvision:
    """What a network needs to issue a network token for a card.

    ``number``: the card number (PAN); ``expiration_month`` 1-12 and four-digit ``expiration_year``;
    ``cvc`` (optional); ``cardholder``: ``{name?, address?: {line1, line2, line3, postal_code, city,
    state_code, country_code}}`` or None; ``merchant_id``: the tenant's merchant, or None for the
    network's default.
    """

    number: str
    expiration_month: int
    expiration_year: int
    cvc: str | None = None
    cardholder: dict | None = None
    merchant_id: str | None = None

    def __repr__(self) -> str:  # never print the number or the cvc
        return f"CardToProvision(last4={self.number[-4:]!r}, expiration={self.expiration_month}/{self.expiration_year})"


@dataclass(frozen=True)
class ProvisionedToken:
    """A network token as the network issued it.

    ``reference``: the network's id; ``number``: the DPAN (16 digits); ``expiration_month`` /
    ``expiration_year`` of the network token; ``par``: payment account reference (the same for
    every network token of one card); ``status``: ``active`` | ``suspended`` | ``deleted``;
    ``details``: the spec's "Network token details" object (``bin, last4, expiration_month,
    expiration_year, brand, funding, segment, product, issuer, issuer_country, additional``).
    """

    reference: str
    number: str
    expiration_month: int
    expiration_year: int
    par: str | None
    status: str
    details: dict = field(default_factory=dict)

    def __repr__(self) -> str:  # never print the DPAN
        return f"ProvisionedToken(reference={self.reference!r}, status={self.status!r})"


@dataclass(frozen=True)
class Cryptogram:
    """A one-time cryptogram and its electronic commerce indicator (``eci``, e.g. ``05``)."""

    cryptogram: str
    eci: str

    def __repr__(self) -> str:  # never print the cryptogram
        return f"Cryptogram(eci={self.eci!r})"


class CardNetwork:
    """The interface of a card network's network-token service (and, later, its account updater).

    Every method makes one provider call and raises :class:`infra.jobs.TransientError` or
    :class:`infra.jobs.PermanentError` on failure. ``idempotency_key`` (a job id) makes a repeated call
    return the first call's answer: the network never issues two tokens for one key.
    Subclasses implement the methods; the base raises NotImplementedError.
    """

    name = PROVIDER_NAME

    def provision(self, card: CardToProvision, *, idempotency_key: str) -> ProvisionedToken:
        """Issue a network token for ``card``.

        Permanent errors: ``card_not_eligible`` (the issuer declined), ``network_not_supported``
        (the card's brand has no network tokens), ``invalid_request``.
        """
        raise NotImplementedError

    def card_art(self, reference: str) -> dict:
        """The card art ``{background_color, logo, card_image}`` of the network token ``reference``
        (each image ``{url, description, height, width}``; any of them may be null)."""
        raise NotImplementedError

    def cryptogram(self, reference: str, *, idempotency_key: str) -> Cryptogram:
        """A fresh cryptogram of an active network token (permanent ``token_not_active`` otherwise)."""
        raise NotImplementedError

    def suspend(self, reference: str, *, idempotency_key: str) -> str:
        """Suspend the network token; returns its status at the network (``suspended``)."""
        raise NotImplementedError

    def resume(self, reference: str, *, idempotency_key: str) -> str:
        """Resume a suspended network token; returns its status at the network (``active``)."""
        raise NotImplementedError

    def delete(self, reference: str, *, idempotency_key: str) -> str:
        """Delete the network token for good; returns its status at the network (``deleted``)."""
        raise NotImplementedError


class HttpCardNetwork(CardNetwork):
    """:class:`CardNetwork` over HTTP: the contract of ``sandbox/README.md`` relative to ``base_url``.

    ``POST {base}/network-tokens``, ``GET {base}/network-tokens/{id}/card-art``,
    ``POST {base}/network-tokens/{id}/cryptograms``, ``POST .../suspend``, ``POST .../resume``,
    ``DELETE {base}/network-tokens/{id}``. Timeouts in seconds.
    """

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, read_timeout: float = 45.0):
        self.client = HttpClient(
            base_url, name=PROVIDER_NAME, connect_timeout=connect_timeout, read_timeout=read_timeout
        )

    def _call(self, method: str, path: str, body: Any = None, *, idempotency_key: str | None = None) -> Any:
        """One call; the JSON body of a 2xx answer, else the classified error."""
        answer = self.client.call(method, path, body, idempotency_key=idempotency_key)
        if 200 <= answer.status < 300:
            return answer.body
        raise _permanent(answer)

    def provision(self, card: CardToProvision, *, idempotency_key: str) -> ProvisionedToken:
        """See :meth:`CardNetwork.provision`."""
        body: dict[str, Any] = {
            "pan": card.number,
            "expiration_month": card.expiration_month,
            "expiration_year": card.expiration_year,
        }
        if card.cvc:
            body["cvc"] = card.cvc
        if card.cardholder:
            body["cardholder"] = card.cardholder
        if card.merchant_id:
            body["merchant_id"] = card.merchant_id
        answer = self._call("POST", "/network-tokens", body, idempotency_key=idempotency_key)
        return _provisioned(answer)

    def card_art(self, reference: str) -> dict:
        """See :meth:`CardNetwork.card_art`."""
        answer = self._call("GET", f"/network-tokens/{reference}/card-art")
        art = answer.get("card_art") if isinstance(answer, dict) else None
        if not isinstance(art, dict):
            raise TransientError("the card network answered card art of an unexpected shape")
        return {key: art.get(key) for key in ("background_color", "logo", "card_image")}

    def cryptogram(self, reference: str, *, idempotency_key: str) -> Cryptogram:
        """See :meth:`CardNetwork.cryptogram`."""
        answer = self._call("POST", f"/network-tokens/{reference}/cryptograms", idempotency_key=idempotency_key)
        if not (isinstance(answer, dict) and isinstance(answer.get("cryptogram"), str)):
            raise TransientError("the card network answered a cryptogram of an unexpected shape")
        return Cryptogram(answer["cryptogram"], str(answer.get("eci") or ""))

    def suspend(self, reference: str, *, idempotency_key: str) -> str:
        """See :meth:`CardNetwork.suspend`."""
        return self._status_change("POST", f"/network-tokens/{reference}/suspend", idempotency_key)

    def resume(self, reference: str, *, idempotency_key: str) -> str:
        """See :meth:`CardNetwork.resume`."""
        return self._status_change("POST", f"/network-tokens/{reference}/resume", idempotency_key)

    def delete(self, reference: str, *, idempotency_key: str) -> str:
        """See :meth:`CardNetwork.delete`."""
        return self._status_change("DELETE", f"/network-tokens/{reference}", idempotency_key)

    def _status_change(self, method: str, path: str, idempotency_key: str) -> str:
        answer = self._call(method, path, idempotency_key=idempotency_key)
        if not (isinstance(answer, dict) and isinstance(answer.get("status"), str)):
            raise TransientError("the card network answered a status change of an unexpected shape")
        return answer["status"]


def _permanent(answer: ProviderAnswer) -> PermanentError:
    """A 4xx answer as a PermanentError with the platform's status for it."""
    error = permanent_from_answer(answer, default_code="card_network_error")
    error.status = _STATUS_OF_ANSWER.get(answer.status, 422)
    error.details = {"network_status": answer.status}
    return error


_DETAIL_KEYS = ("bin", "last4", "brand", "funding", "segment", "product", "issuer", "issuer_country")


def _provisioned(answer: Any) -> ProvisionedToken:
    """The network's provisioning answer as a :class:`ProvisionedToken` (TransientError if malformed)."""
    try:
        number = answer["number"]
        month, year = int(answer["expiration_month"]), int(answer["expiration_year"])
        reference = str(answer["id"])
        if not (isinstance(number, str) and number.isdigit()):
            raise ValueError("number")
    except (KeyError, TypeError, ValueError) as exc:
        raise TransientError("the card network answered a network token of an unexpected shape") from exc
    details = {key: answer.get(key) for key in _DETAIL_KEYS}
    details["bin"] = details["bin"] or number[:8]
    details["last4"] = details["last4"] or number[-4:]
    details["expiration_month"] = month
    details["expiration_year"] = year
    details["additional"] = list(answer.get("additional") or [])
    return ProvisionedToken(
        reference=reference,
        number=number,
        expiration_month=month,
        expiration_year=year,
        par=answer.get("par"),
        status=str(answer.get("status") or "active"),
        details=details,
    )


def ensure_configured(who: str | HasTenantType, settings: Settings | None = None) -> None:
    """Check, without building an adapter, that a card network serves ``who`` (a caller or a tenant
    type): the api's early answer before it records any work. Test tenants always have the sandbox.
    Raises the 422 problem of :class:`providers.ProviderNotConfigured` for a production tenant when
    ``TESSERA_CARD_NETWORK_URL`` is unset."""
    tenant_type = who if isinstance(who, str) else who.tenant_type
    if tenant_type != "test" and not (settings or get_settings()).card_network_url:
        raise ProviderNotConfigured(PROVIDER_NAME)


def card_network_for(who: str | HasTenantType, settings: Settings | None = None) -> CardNetwork:
    """The card network adapter for a caller (anything with a ``tenant_type``) or a tenant type (``test`` |
    ``production``).

    Test tenants reach the sandbox at ``TESSERA_SANDBOX_URL`` + ``/card-network``; production tenants
    the live network at ``TESSERA_CARD_NETWORK_URL``. Raises the 422 problem of
    :class:`providers.ProviderNotConfigured` for a production tenant when no live URL is configured.
    """
    settings = settings or get_settings()
    tenant_type = who if isinstance(who, str) else who.tenant_type
    timeouts = {
        "connect_timeout": settings.provider_connect_timeout_seconds,
        "read_timeout": settings.provider_read_timeout_seconds,
    }
    if tenant_type == "test":
        return HttpCardNetwork(settings.sandbox_url.rstrip("/") + SANDBOX_PATH, **timeouts)
    if not settings.card_network_url:
        raise ProviderNotConfigured(PROVIDER_NAME)
    return HttpCardNetwork(settings.card_network_url, **timeouts)
