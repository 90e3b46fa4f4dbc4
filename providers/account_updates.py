"""The card networks' account updater: one batch call per chunk of rows.

``POST {base}/card-network/account-updates`` (``sandbox/README.md``, "Card networks: account updater")
takes ``{merchant_id, tenant_type, items: [{ref, pan, expiration_month, expiration_year, merchant_id}]}``
(at most :data:`MAX_ITEMS` items, four-digit years, nulls for unknown values) and answers
``{results: [{ref, code, new_pan?, new_expiration_month?, new_expiration_year?}]}``, one result per
item in order. Test tenants call the sandbox (``TESSERA_SANDBOX_URL``); production tenants call
``TESSERA_CARD_NETWORK_URL`` and, when it is unset, get a :class:`infra.jobs.PermanentError`
``PROVIDER_NOT_CONFIGURED``. Transport failures, 408, 429 and 5xx are :class:`infra.jobs.TransientError`
(retried); other 4xx answers and malformed answers are permanent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.settings import Settings, get_settings
from infra.jobs import PermanentError
from providers import HttpClient, ProviderNotConfigured, permanent_from_answer
from providers.card_network import PROVIDER_NAME

PATH = "/card-network/account-updates"
MAX_ITEMS = 10_000
"""Most rows one call may carry."""

NOT_CONFIGURED = (
    "The card network's account updater is not configured for production tenants on this deployment "
    "(TESSERA_CARD_NETWORK_URL is unset)."
)


@dataclass(frozen=True)
class UpdateItem:
    """One row sent to the networks: ``ref`` (the caller's row reference, echoed back), the card
    number, its expiration (month 1-12 and four-digit year, or both None) and the row's merchant id."""

    ref: str
    pan: str
    expiration_month: int | None
    expiration_year: int | None
    merchant_id: str | None


@dataclass(frozen=True)
class UpdateResult:
    """The networks' answer for one row: ``code`` (``UPD_*``, ``WRN_*``, ``ERR_*`` or None for no
    update) and, for ``UPD_*``, the new number and expiration when known."""

    ref: str
    code: str | None
    new_pan: str | None = None
    new_expiration_month: int | None = None
    new_expiration_year: int | None = None


def base_url(tenant_type: str, settings: Settings | None = None) -> str:
    """The card network's base URL for a tenant of ``tenant_type`` (``test`` -> the sandbox).

    Raises :class:`providers.ProviderNotConfigured` for a production tenant without
    ``TESSERA_CARD_NETWORK_URL``.
    """
    settings = settings or get_settings()
    if tenant_type == "test":
        return settings.sandbox_url
    if not settings.card_network_url:
        raise ProviderNotConfigured(PROVIDER_NAME, NOT_CONFIGURED)
    return settings.card_network_url


class AccountUpdatesClient:
    """The batch call adapter for one tenant type."""

    def __init__(self, tenant_type: str, settings: Settings | None = None):
        settings = settings or get_settings()
        self.tenant_type = tenant_type
        self._http = HttpClient(
            base_url(tenant_type, settings),
            name=PROVIDER_NAME,
            connect_timeout=settings.provider_connect_timeout_seconds,
            read_timeout=settings.provider_read_timeout_seconds,
        )

    def updates(
        self, items: list[UpdateItem], *, idempotency_key: str, merchant_id: str | None = None
    ) -> list[UpdateResult]:
        """Ask the networks about ``items`` (at most :data:`MAX_ITEMS`) in one call; one result per item,
        in order. ``idempotency_key`` (job id and chunk number) makes a repeated call the same call.

        Raises TransientError (retry) or PermanentError (a 4xx answer, or an answer whose results do
        not match the items).
        """
        if len(items) > MAX_ITEMS:
            raise ValueError(f"at most {MAX_ITEMS} items per call")
        if not items:
            return []
        body = {
            "merchant_id": merchant_id,
            "tenant_type": self.tenant_type,
            "items": [
                {
                    "ref": item.ref,
                    "pan": item.pan,
                    "expiration_month": item.expiration_month,
                    "expiration_year": item.expiration_year,
                    "merchant_id": item.merchant_id,
                }
                for item in items
            ],
        }
        answer = self._http.call("POST", PATH, body, idempotency_key=idempotency_key)
        if answer.status >= 400:
            raise permanent_from_answer(answer, default_code="CARD_NETWORK_REJECTED")
        results = answer.body.get("results") if isinstance(answer.body, dict) else None
        if not isinstance(results, list) or len(results) != len(items):
            raise PermanentError("CARD_NETWORK_BAD_ANSWER", "the card network answered without one result per row")
        return [_result(item.ref, raw) for item, raw in zip(items, results, strict=True)]


def _result(ref: str, raw: Any) -> UpdateResult:
    if not isinstance(raw, dict) or raw.get("ref") != ref:
        raise PermanentError("CARD_NETWORK_BAD_ANSWER", "the card network answered rows out of order")
    code = raw.get("code")
    month, year = raw.get("new_expiration_month"), raw.get("new_expiration_year")
    new_pan = raw.get("new_pan")
    return UpdateResult(
        ref=ref,
        code=code if isinstance(code, str) and code else None,
        new_pan=new_pan if isinstance(new_pan, str) else None,
        new_expiration_month=month if type(month) is int else None,
        new_expiration_year=year if type(year) is int else None,
    )
