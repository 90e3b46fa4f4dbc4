"""The wallet-a session gateway adapter: domain registration and merchant validation (spec 001 section 4).

:class:`WalletGateway` speaks the contract of ``sandbox/README.md`` ("Wallet session gateway") over
:class:`providers.HttpClient`. Test tenants reach the sandbox's ``sandbox`` environment
(``TESSERA_SANDBOX_URL`` + ``/wallet-gateway/sandbox``); production tenants need the live provider's
registration service, which this deployment does not configure (422 :class:`providers.ProviderNotConfigured`).
The merchant id toward the provider is the tenant id.

Failures: connection errors, timeouts, 408, 429 and 5xx are :class:`infra.jobs.TransientError`; a
4xx is :class:`infra.jobs.PermanentError` ``wallet_provider_rejected`` carrying the provider's own
``statusMessage``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from config.settings import Settings, get_settings
from infra.jobs import PermanentError, TransientError
from providers import HttpClient, ProviderAnswer, ProviderNotConfigured

PROVIDER_NAME = "wallet session gateway"
SANDBOX_PATH = "/wallet-gateway/sandbox"
SESSION_PATH = "/paymentservices/paymentSession"
#: The wallet provider's production payment session gateways (its published list of allowed hosts).
PRODUCTION_GATEWAY_HOSTS = (
    "apple-pay-gateway.apple.com",
    "cn-apple-pay-gateway.apple.com",
    *(f"apple-pay-gateway-nc-pod{n}.apple.com" for n in range(1, 6)),
    *(f"apple-pay-gateway-pr-pod{n}.apple.com" for n in range(1, 6)),
    *(f"cn-apple-pay-gateway-sh-pod{n}.apple.com" for n in range(1, 4)),
    *(f"cn-apple-pay-gateway-tj-pod{n}.apple.com" for n in range(1, 4)),
)
PRODUCTION_GATEWAY_URL = f"https://{PRODUCTION_GATEWAY_HOSTS[0]}{SESSION_PATH}"


def sandbox_gateway_url(settings: Settings | None = None) -> str:
    """The sandbox environment's payment session URL (``{wallet_sandbox_gateway_url}``)."""
    settings = settings or get_settings()
    return settings.sandbox_url.rstrip("/") + SANDBOX_PATH + SESSION_PATH


def gateway_environment(url: str, settings: Settings | None = None) -> str | None:
    """``sandbox`` or ``production``: the environment a ``validation_url`` targets; None when it is not
    an allowed gateway (the sandbox's session URL, or https on a host of :data:`PRODUCTION_GATEWAY_HOSTS`
    with the session path)."""
    if url == sandbox_gateway_url(settings):
        return "sandbox"
    parts = urlsplit(url)
    if (
        parts.scheme == "https"
        and parts.hostname in PRODUCTION_GATEWAY_HOSTS
        and parts.port is None
        and parts.path == SESSION_PATH
        and not parts.query
        and not parts.username
    ):
        return "production"
    return None


class WalletGateway:
    """The gateway of one environment; every method makes one call (see the module docstring)."""

    def __init__(self, base_url: str, settings: Settings):
        self._client = HttpClient(
            base_url,
            name=PROVIDER_NAME,
            connect_timeout=settings.provider_connect_timeout_seconds,
            read_timeout=settings.provider_read_timeout_seconds,
        )
        self._settings = settings

    @staticmethod
    def _checked(answer: ProviderAnswer) -> ProviderAnswer:
        if answer.status >= 400:
            body = answer.body if isinstance(answer.body, dict) else {}
            message = str(body.get("statusMessage") or f"answered {answer.status}")[:300]
            raise PermanentError("wallet_provider_rejected", message)
        return answer

    def register_domain(self, merchant_id: str, domain: str, *, idempotency_key: str) -> None:
        """Register ``domain`` for ``merchant_id`` (its association file was verified)."""
        self._checked(
            self._client.call(
                "POST", "/domains", {"merchant_id": merchant_id, "domain": domain}, idempotency_key=idempotency_key
            )
        )

    def remove_domain(self, merchant_id: str, domain: str, *, idempotency_key: str) -> None:
        """Forget ``domain`` of ``merchant_id`` (no error when unknown)."""
        self._checked(
            self._client.call(
                "POST",
                "/domains/remove",
                {"merchant_id": merchant_id, "domain": domain},
                idempotency_key=idempotency_key,
            )
        )

    def payment_session(self, validation_url: str, request: dict) -> dict:
        """The opaque merchant session the gateway at ``validation_url`` answers for ``request``
        (``{merchantIdentifier, displayName, initiative, initiativeContext}``)."""
        client = HttpClient(
            validation_url,
            name=PROVIDER_NAME,
            connect_timeout=self._settings.provider_connect_timeout_seconds,
            read_timeout=self._settings.provider_read_timeout_seconds,
        )
        answer = self._checked(client.call("POST", "", request))
        if not isinstance(answer.body, dict):
            raise TransientError("the wallet session gateway answered without a session object")
        return answer.body


def wallet_gateway_for(tenant_type: str, settings: Settings | None = None) -> WalletGateway:
    """The gateway of a tenant type: the sandbox for ``test`` tenants; 422 Provider not configured for
    production tenants (this deployment has no live registration service)."""
    settings = settings or get_settings()
    if tenant_type == "test":
        return WalletGateway(settings.sandbox_url.rstrip("/") + SANDBOX_PATH, settings)
    raise ProviderNotConfigured(PROVIDER_NAME)
