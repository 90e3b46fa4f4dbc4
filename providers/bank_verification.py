"""The bank account verification adapter: is an account open to debits (``enabled``), closed or
blocked (``disabled``), or could the provider not tell (``error``)?

:class:`BankVerifier` speaks the contract of ``sandbox/README.md`` ("Bank account verification") over
:class:`providers.HttpClient`: ``POST /accounts/verify`` ``{routing_number, account_number}`` answers
``{status}``. Test tenants reach the sandbox (``TESSERA_SANDBOX_URL`` + ``/bank-verification``);
production tenants need a live provider, which this deployment does not configure (the 422 of
:class:`providers.ProviderNotConfigured`).

Failures: connection errors, timeouts, 408, 429 and 5xx are :class:`infra.jobs.TransientError`; a
4xx is :class:`infra.jobs.PermanentError` ``bank_verification_rejected`` with the provider's message.
"""

from __future__ import annotations

from config.settings import Settings, get_settings
from infra.jobs import TransientError
from providers import HttpClient, ProviderNotConfigured, permanent_from_answer

PROVIDER_NAME = "bank account verification"
SANDBOX_PATH = "/bank-verification"
#: What a verification answers.
STATUSES = ("enabled", "disabled", "error")


class BankVerifier:
    """One provider's verification endpoint; each call is one request."""

    def __init__(self, base_url: str, settings: Settings):
        self._client = HttpClient(
            base_url,
            name=PROVIDER_NAME,
            connect_timeout=settings.provider_connect_timeout_seconds,
            read_timeout=settings.provider_read_timeout_seconds,
        )

    def verify(self, routing_number: str, account_number: str, *, idempotency_key: str) -> str:
        """The account's status, one of :data:`STATUSES`."""
        answer = self._client.call(
            "POST",
            "/accounts/verify",
            {"routing_number": routing_number, "account_number": account_number},
            idempotency_key=idempotency_key,
        )
        if answer.status >= 400:
            raise permanent_from_answer(answer, default_code="bank_verification_rejected")
        status = answer.body.get("status") if isinstance(answer.body, dict) else None
        if status not in STATUSES:
            raise TransientError(f"the {PROVIDER_NAME} provider answered without a known status")
        return status


def bank_verifier_for(tenant_type: str | None, settings: Settings | None = None) -> BankVerifier:
    """The verifier of a tenant type: the sandbox for ``test`` tenants; 422 Provider not configured for
    production tenants (this deployment has no live verification provider)."""
    settings = settings or get_settings()
    if tenant_type == "test":
        return BankVerifier(settings.sandbox_url.rstrip("/") + SANDBOX_PATH, settings)
    raise ProviderNotConfigured(PROVIDER_NAME)
