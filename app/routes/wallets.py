"""Wallet tokens: ``/wallet-a`` (Apple Pay, EC_v1) and ``/wallet-b`` (Google Pay, ECv2) (spec 001
sections 2, 4, 5 and 9). Verification and decryption live in :mod:`domain.wallets`; storage and the
resource in :mod:`domain.wallets.service`. The deprecated ``/connections/<wallet>/...`` endpoints,
shut down on July 1, 2026, answer 410 naming their replacements.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import Field

from app.api import AnyOf, Api, Call
from app.routes.token_intents import TokenIntentOut
from app.schemas import RequestModel, ResponseModel
from domain.wallets import domains, service
from infra.errors import Problem, not_found

api = Api()
TAG = "Wallet tokens"

_REFUSALS = (
    "Every verification or decryption failure answers a problem with a stable `code` and a `detail` naming the "
    "check that failed (never key material or card data), and stores nothing: 400 `malformed_token` (not the "
    "documented shape); 422 `unsupported_version`, `certificate_invalid`, `signature_invalid`, "
    "`message_digest_mismatch`, `signing_time_out_of_window`, `merchant_key_not_found`, `decryption_failed`, "
    "`payment_data_invalid` (wallet-a); 422 `intermediate_key_signature_invalid`, `intermediate_key_expired`, "
    "`message_signature_invalid`, `message_expired`, `decryption_failed`, `payment_data_invalid` (wallet-b). "
    "A stored token is accepted once: the same wallet-a transaction id or wallet-b message id again answers 409 "
    "(a wallet-b PAN_ONLY token, which stores no wallet token, gives a new token intent until its "
    "messageExpiration). "
)
_CRYPTOGRAM = (
    "Cryptograms are not kept past their use (decided here): the cryptogram is sealed apart from the card and "
    "erased at its first use, the first `GET /wallet-a/{id}` with `wallet-a:reveal` or the first proxy request "
    'whose expressions read the token (`{{ wallet-a: <id> | json: "$.authentication.threeds_cryptogram" }}`), '
    "whichever comes first; unused, it is erased `TESSERA_WALLET_CRYPTOGRAM_RETENTION_SECONDS` (default 3600) "
    "after creation. Every other view shows `authentication.threeds_cryptogram` null. "
)
_ENRICHMENT = (
    "Card enrichment (`card`) is derived from the network token (DPAN or MPAN) inside the token: `bin`, `last4`, "
    "expiration and `brand`; the platform holds no BIN table, so `funding`, `authentication`, `issuer`, "
    "`issuer_country`, `segment` and `product` are null. `fingerprint` is the tenant's keyed fingerprint of the "
    "card number inside the token (the same a card token of that number gets). "
)


# ---- shapes --------------------------------------------------------------------------------------


class MerchantCertificateIn(RequestModel):
    """`POST /wallet-a/merchant-certificates`."""

    certificate: str = Field(min_length=1, max_length=16384, description="The payment processing certificate, PEM.")
    private_key: str = Field(
        min_length=1, max_length=16384, description="Its EC P-256 private key, PEM (PKCS#8 or SEC1). Never returned."
    )


class MerchantKeyIn(RequestModel):
    """`POST /wallet-b/merchant-keys`."""

    private_key: str = Field(
        min_length=1,
        max_length=16384,
        description="The merchant's EC P-256 private key: PEM, or base64 PKCS#8 DER as the "
        "wallet provider's tools print it. Never returned.",
    )


class MerchantKeyOut(ResponseModel):
    """A merchant certificate or key, without its private key."""

    id: uuid.UUID
    public_key_hash: str = Field(description="Base64 SHA-256 of the public key's DER SubjectPublicKeyInfo.")
    merchant_id: str | None = None
    expires_at: dt.datetime | None = None
    created_at: dt.datetime


class MerchantKeyList(ResponseModel):
    """The tenant's merchant keys, oldest first."""

    data: list[MerchantKeyOut]


class CardData(ResponseModel):
    """The network token inside the wallet token."""

    number: str
    expiration_month: int | None = None
    expiration_year: int | None = None


class AuthenticationOut(ResponseModel):
    """The one-time authentication of the payment."""

    threeds_cryptogram: str | None = None
    eci_indicator: str | None = None


class WalletTokenOut(ResponseModel):
    """The wallet token resource."""

    id: uuid.UUID
    type: str
    tenant_id: uuid.UUID
    status: str
    ingest_source: str
    expires_at: dt.datetime | None = None
    created_by: uuid.UUID | None = None
    modified_by: uuid.UUID | None = None
    created_at: dt.datetime
    modified_at: dt.datetime | None = None
    transaction_id: str
    payment_data_type: str | None = None
    device_manufacturer_identifier: str | None = None
    fingerprint: str | None = None
    card: dict[str, Any]
    data: CardData | None = None
    authentication: AuthenticationOut | None = None


class WalletACreated(ResponseModel):
    """`POST /wallet-a`."""

    wallet_a: WalletTokenOut


class WalletBCreated(ResponseModel):
    """`POST /wallet-b`: one of the two members."""

    google_pay: WalletTokenOut | None = None
    token_intent: TokenIntentOut | None = None


class WalletAIn(RequestModel):
    """`POST /wallet-a`."""

    apple_payment_data: dict[str, Any] = Field(
        description="The wallet's payment token: `paymentData` {data, signature, header {transactionId, "
        "publicKeyHash, applicationData, ephemeralPublicKey}, version} and `transactionIdentifier`, both required; "
        "other members are ignored."
    )
    expires_at: dt.datetime | None = Field(
        default=None, description="Default: the end of the day the decrypted application expiration date names."
    )
    merchant_registration_id: str | None = Field(
        default=None, max_length=255, description="Accepted; not used by decryption."
    )


class WalletBIn(RequestModel):
    """`POST /wallet-b` (the shapes are this implementation's design)."""

    google_payment_data: dict[str, Any] | str = Field(
        description="The ECv2 token: the JSON object (or its JSON text) {protocolVersion, signature, "
        "intermediateSigningKey, signedMessage}."
    )
    expires_at: dt.datetime | None = Field(default=None, description="Default: the end of the card's expiry month.")


# ---- merchant certificates and keys -------------------------------------------------------------


@api.route(
    "POST",
    "/wallet-a/merchant-certificates",
    permission="wallet-a:manage",
    body=MerchantCertificateIn,
    status=201,
    response=MerchantKeyOut,
    tag=TAG,
    summary="Add a wallet-a merchant certificate",
    errors=(400, 422),
    description="Stores the tenant's payment processing certificate and its private key (sealed with the "
    "tenant's data key; never returned). Several may be active at once for rotation: each token names its "
    "key by `header.publicKeyHash`. `merchant_id` is the certificate subject's UID when present, else the "
    "hex merchant id hash of extension 1.2.840.113635.100.6.32 (designed here). 422 "
    "`merchant_certificate_invalid` when the PEM cannot be read, the key is not P-256 or not the "
    "certificate's, the merchant id extension is missing, or the certificate has expired.",
)
async def add_certificate(call: Call):
    return await call.db(
        service.add_wallet_a_certificate,
        call.caller,
        certificate=call.body.certificate,
        private_key=call.body.private_key,
    )


@api.route(
    "GET",
    "/wallet-a/merchant-certificates",
    permission="wallet-a:manage",
    response=MerchantKeyList,
    tag=TAG,
    summary="List wallet-a merchant certificates",
    description="The tenant's certificates, oldest first (`{data: [...]}`; a handful at most, not paginated).",
)
async def list_certificates(call: Call):
    return {"data": await call.db(service.list_keys, call.caller, service.WALLET_A)}


@api.route(
    "DELETE",
    "/wallet-a/merchant-certificates/{id}",
    permission="wallet-a:manage",
    status=204,
    tag=TAG,
    summary="Delete a wallet-a merchant certificate",
    errors=(404,),
    description="Tokens sealed for its key are refused from then on (422 `merchant_key_not_found`).",
)
async def delete_certificate(call: Call):
    await call.db(service.delete_key, call.caller, service.WALLET_A, call.params["id"])


_B_KEYS = (
    "How the merchant's decryption keys are configured is this implementation's design: tenant "
    "configuration, permission `tenant:update`. "
)


@api.route(
    "POST",
    "/wallet-b/merchant-keys",
    permission="tenant:update",
    body=MerchantKeyIn,
    status=201,
    response=MerchantKeyOut,
    tag=TAG,
    summary="Add a wallet-b merchant key",
    errors=(400, 422),
    description=_B_KEYS + "The key is sealed with the tenant's data key and never returned; `merchant_id` is "
    "the recipient id tokens must be sealed for, `merchant:<tenant id>` (the tenant id is the merchant id "
    "toward the provider). Several keys may be active: each is tried.",
)
async def add_b_key(call: Call):
    return await call.db(service.add_wallet_b_key, call.caller, private_key=call.body.private_key)


@api.route(
    "GET",
    "/wallet-b/merchant-keys",
    permission="tenant:update",
    response=MerchantKeyList,
    tag=TAG,
    summary="List wallet-b merchant keys",
    description=_B_KEYS + "Oldest first, not paginated.",
)
async def list_b_keys(call: Call):
    return {"data": await call.db(service.list_keys, call.caller, service.WALLET_B)}


@api.route(
    "DELETE",
    "/wallet-b/merchant-keys/{id}",
    permission="tenant:update",
    status=204,
    tag=TAG,
    summary="Delete a wallet-b merchant key",
    errors=(404,),
    description=_B_KEYS,
)
async def delete_b_key(call: Call):
    await call.db(service.delete_key, call.caller, service.WALLET_B, call.params["id"])


# ---- domains and merchant sessions ---------------------------------------------------------------

_DOMAINS = (
    "A tenant's domains belong to its environment: the wallet provider's sandbox for test tenants, production "
    "for production tenants (a domain registered in one is unknown to the other). Registering a domain fetches "
    "its verification file `https://<domain>/.well-known/apple-developer-merchantid-domain-association` "
    "(`TESSERA_WALLET_A_DOMAIN_FILE_URL`) in a worker through the platform's outbound client, then registers the "
    "domain with the wallet provider under the tenant id as merchant id; the request waits up to "
    "`TESSERA_WALLET_WAIT_SECONDS` (default 10 s). 422 when the file is not available (the domain is not "
    "kept); 502 when the provider cannot be reached (contact support). Designed here: a domain whose work is still "
    "running after the wait is listed with `status` `pending` and becomes `verified` (or disappears if its file "
    "was not available); domains are normalised to lower-case ASCII (IDNA). At most 99 domains (400). "
    "Production tenants: 422 Provider not configured (this deployment has no live registration service). "
)


class DomainIn(RequestModel):
    """`POST /wallet-a/domain-registration` and `POST /wallet-a/domain-deregistration`."""

    domain: str = Field(min_length=1, max_length=253)


class DomainsIn(RequestModel):
    """`PUT /wallet-a/domain-registration`."""

    domains: list[str] = Field(max_length=domains.MAX_DOMAINS)


class DomainOut(ResponseModel):
    """A registered domain."""

    domain: str
    status: str = Field(description="`verified`, or `pending` while its verification runs.")


class DomainsOut(ResponseModel):
    """The tenant's domains in its environment."""

    domains: list[DomainOut]


class SessionIn(RequestModel):
    """`POST /wallet-a/session`."""

    validation_url: str | None = Field(default=None, max_length=2048)
    display_name: str = Field(min_length=1, max_length=64)
    domain: str = Field(min_length=1, max_length=253)
    merchant_registration_id: str | None = Field(default=None, max_length=255)


async def _registered(call: Call, values: list[str], *, replace: bool, field: str) -> dict:
    job_ids = await call.db(domains.register_domains, call.caller, values, replace=replace, field=field)
    if job_ids:
        await call.wait_for_jobs(job_ids, timeout=call.settings.wallet_wait_seconds)
    return await call.db(domains.registration_outcome, call.caller, job_ids)


@api.route(
    "POST",
    "/wallet-a/domain-registration",
    permission="wallet-a:manage",
    body=DomainIn,
    response=DomainsOut,
    tag=TAG,
    summary="Register a wallet-a domain",
    errors=(400, 422, 502),
    description="Adds one domain; answers every domain of the tenant's environment. " + _DOMAINS,
)
async def register_domain(call: Call):
    return await _registered(call, [call.body.domain], replace=False, field="domain")


@api.route(
    "PUT",
    "/wallet-a/domain-registration",
    permission="wallet-a:manage",
    body=DomainsIn,
    response=DomainsOut,
    tag=TAG,
    summary="Replace the wallet-a domains",
    errors=(400, 422, 502),
    description="The tenant's domains become exactly `domains`: new ones are registered, missing ones "
    "removed. " + _DOMAINS,
)
async def replace_domains(call: Call):
    return await _registered(call, call.body.domains, replace=True, field="domains")


@api.route(
    "GET",
    "/wallet-a/domain-registration",
    permission="wallet-a:manage",
    response=DomainsOut,
    tag=TAG,
    summary="List the wallet-a domains",
    description=_DOMAINS,
)
async def list_domains(call: Call):
    return await call.db(domains.list_domains, call.caller)


@api.route(
    "POST",
    "/wallet-a/domain-deregistration",
    permission="wallet-a:manage",
    body=DomainIn,
    status=204,
    tag=TAG,
    summary="Deregister a wallet-a domain",
    errors=(400, 404),
    description="Forgets the domain at once (404 when it is not registered); a worker tells the wallet "
    "provider (retried until it answers).",
)
async def deregister_domain(call: Call):
    await call.db(domains.deregister_domain, call.caller, call.body.domain)


@api.route(
    "POST",
    "/wallet-a/session",
    permission="wallet-a:session",
    body=SessionIn,
    response=dict[str, Any],
    tag=TAG,
    summary="Create a wallet-a merchant session",
    errors=(400, 422, 503),
    description="Merchant validation through the wallet provider's payment session gateway: answers the "
    "gateway's opaque session object unchanged. `validation_url` defaults to the gateway of the tenant's "
    "environment (test tenants: the sandbox gateway, `TESSERA_SANDBOX_URL` + "
    "`/wallet-gateway/sandbox/paymentservices/paymentSession`; production: "
    "`https://apple-pay-gateway.apple.com/paymentservices/paymentSession`) and must be one of the allowed "
    "gateways. The merchant identifier sent is the tenant id; `merchant_registration_id` is passed on as "
    "`merchantRegistrationId`. The call runs in a worker; this request waits up to "
    "`TESSERA_WALLET_WAIT_SECONDS`. Errors, all 422 distinguished by detail: validation_url not an allowed "
    "gateway; merchant not enrolled in the environment validation_url targets (the detail names both); "
    "domain not registered (verified) in the tenant's environment; certificate configuration missing "
    "(production gateways need a merchant identity certificate this deployment does not hold); the wallet "
    "provider rejected the request (detail includes its message). 503 when the session service is "
    "unavailable or slower than the wait.",
)
async def create_session(call: Call):
    b = call.body
    row_id, job_id = await call.db(
        domains.start_session,
        call.caller,
        display_name=b.display_name,
        domain=b.domain,
        validation_url=b.validation_url,
        merchant_registration_id=b.merchant_registration_id,
    )
    await call.wait_for_jobs([job_id], timeout=call.settings.wallet_wait_seconds)
    return await call.db(domains.session_outcome, call.caller, row_id, job_id)


# ---- tokens --------------------------------------------------------------------------------------


@api.route(
    "POST",
    "/wallet-a",
    permission="wallet-a:create",
    body=WalletAIn,
    status=201,
    response=WalletACreated,
    tag=TAG,
    summary="Decrypt a wallet-a token",
    errors=(400, 409, 422),
    description="Verifies the EC_v1 token (CMS signature, leaf and intermediate certificate OIDs, chain to "
    "the pinned Apple Root CA - G3 or `TESSERA_WALLET_A_ROOT_CA`, message digest over ephemeralPublicKey, "
    "data, transactionId and applicationData, signing time within "
    "`TESSERA_WALLET_A_SIGNING_TIME_WINDOW_SECONDS`), then decrypts it with the merchant certificate its "
    "`publicKeyHash` names, stores the wallet token and answers `{wallet_a: resource}` without `data` "
    "(read it through GET with `wallet-a:reveal` or proxy expressions "
    '`{{ wallet-a: <id> | json: "$.data.number" }}`). ' + _REFUSALS + _CRYPTOGRAM + _ENRICHMENT,
)
async def create_a(call: Call):
    return await call.db(
        service.create_wallet_a, call.caller, call.body.apple_payment_data, expires_at=call.body.expires_at
    )


@api.route(
    "GET",
    "/wallet-a/{id}",
    permission=AnyOf("wallet-a:read", "wallet-a:reveal"),
    response=WalletTokenOut,
    tag=TAG,
    summary="Get a wallet-a token",
    errors=(404,),
    description="The resource at top level. With `wallet-a:reveal`: `data` complete and the cryptogram "
    "(once); with `wallet-a:read`: `data` masked (first six and last four digits). 404 when missing or "
    "another tenant's. " + _CRYPTOGRAM,
)
async def get_a(call: Call):
    return await call.db(service.read_wallet_a, call.caller, call.params["id"])


@api.route(
    "POST",
    "/wallet-b",
    permission="wallet-b:create",
    body=WalletBIn,
    status=201,
    response=WalletBCreated,
    tag=TAG,
    summary="Decrypt a wallet-b token",
    errors=(400, 409, 422, 503),
    description="Verifies the ECv2 token (intermediate signing key signed by an unexpired root key of "
    "`TESSERA_WALLET_B_ROOT_KEYS`, not expired; message signature for the recipient id "
    "`merchant:<tenant id>`), then decrypts it (HKDF-SHA256, HMAC-SHA256 checked before AES-256-CTR) with "
    "the tenant's wallet-b merchant keys. `CRYPTOGRAM_3DS` stores a wallet token and answers "
    "`{google_pay: resource}` without `data` (type `network_token`, `payment_data_type` `3DSecure`, "
    "`transaction_id` the message id; read through proxy expressions `{{ wallet-b: <id> | json: "
    '"$.data.number" }}`; there is no GET of a wallet-b token). `PAN_ONLY` answers '
    "`{token_intent: ...}`: a token intent holding the card (`{{ token_intent: <id> | ... }}`). "
    "503 when the root keys are not configured. " + _REFUSALS + _CRYPTOGRAM + _ENRICHMENT,
)
async def create_b(call: Call):
    return await call.db(
        service.create_wallet_b, call.caller, call.body.google_payment_data, expires_at=call.body.expires_at
    )


# ---- the shut-down wallet connections (spec 001 section 9) -------------------------------------

_CONNECTION_WALLETS = {
    "wallet-a": "/wallet-a",
    "wallet-b": "/wallet-b",
    "apple-pay": "/wallet-a",
    "google-pay": "/wallet-b",
}
_SHUT_DOWN = (
    "Permission: none (any valid API key learns that the endpoint is gone). Shut down on July 1, 2026 "
    "(deprecated August 05, 2025): answers 410 naming the replacement. Endpoints "
    "moved from /connections/<wallet>/* to /<wallet>/*; permissions from connections:<wallet>:invoke and "
    "connections:<wallet>:manage to wallet-a:session, wallet-a:create, wallet-a:manage and wallet-b:create; "
    "`apple_payment_method_token` became `apple_payment_data`; proxy expressions `token_intent:` became "
    "`wallet-a:` (or `wallet-b:` for the cryptogram method). `apple-pay` and `google-pay` are read as "
    "`wallet-a` and `wallet-b`."
)


def _gone(call: Call) -> Problem:
    wallet = call.params["wallet"]
    if wallet not in _CONNECTION_WALLETS:
        return not_found("resource")
    rest = call.params.get("operation")
    replacement = _CONNECTION_WALLETS[wallet] + (f"/{rest}" if rest else "")
    return Problem(
        410,
        f"The wallet connection endpoints under /connections/{wallet}/ were shut down on July 1, "
        f"2026; use {replacement} (permissions wallet-a:session, wallet-a:create, wallet-a:manage, "
        "wallet-b:create; the field apple_payment_method_token is now apple_payment_data).",
        extra={"replacement": replacement},
    )


for _method in ("GET", "POST", "PUT", "DELETE"):
    for _path in ("/connections/{wallet}", "/connections/{wallet}/{operation}"):

        @api.route(
            _method,
            _path,
            status=410,
            tag=TAG,
            summary=f"Wallet connection {_method} {_path} (shut down)",
            errors=(410,),
            deprecated=True,
            description=_SHUT_DOWN,
        )
        async def connection_gone(call: Call):
            raise _gone(call)

        connection_gone.__name__ = "connection_operation_gone" if "operation" in _path else "connection_gone"
