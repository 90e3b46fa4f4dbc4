"""Every column of sealed values (``storage.crypto``), with the purpose and resource id each value is
bound to: what a data key rotation re-encrypts. ``tests/keys`` checks that every binary column of
the models is either here or named in :data:`NOT_SEALED_BY_TENANT_KEYS`."""

from __future__ import annotations

from domain.agentic.allowance_state import OTP_PURPOSE, SEALED_PURPOSE
from domain.client_keys.service import PURPOSE as CLIENT_KEY_PURPOSE
from domain.network_tokens.provisioning import SOURCE_PURPOSE as NETWORK_TOKEN_SOURCE_PURPOSE
from domain.network_tokens.token_intents import DATA_PURPOSE as TOKEN_INTENT_PURPOSE
from domain.network_tokens.views import DATA_PURPOSE as NETWORK_TOKEN_PURPOSE
from domain.proxy.service import CONFIGURATION_PURPOSE as PROXY_CONFIGURATION_PURPOSE
from domain.reactors.runs import RUN_PURPOSE
from domain.reactors.service import CONFIGURATION_PURPOSE as REACTOR_CONFIGURATION_PURPOSE
from domain.tenancy.tenants import WEBHOOK_SECRET_PURPOSE
from domain.tokens.idempotency import ANSWER_PURPOSE
from domain.tokens.store import DATA_PURPOSE as TOKEN_PURPOSE
from domain.wallets.domains import SESSION_PURPOSE
from domain.wallets.service import CRYPTOGRAM_PURPOSE, KEY_PURPOSE
from domain.wallets.service import DATA_PURPOSE as WALLET_TOKEN_PURPOSE
from storage.models import Tenant, Token, TokenIdempotencyKey
from storage.models_allowances import AllowanceRail, PaymentCredential
from storage.models_client_keys import ClientEncryptionKey
from storage.models_network_tokens import NetworkToken, TokenIntent
from storage.models_proxy import Proxy
from storage.models_reactors import Reactor, ReactorRun
from storage.models_wallets import WalletMerchantKey, WalletSession, WalletToken
from storage.sealed import SealedColumn
from storage.types import table_of

SEALED: tuple[SealedColumn, ...] = (
    SealedColumn(table_of(Tenant), "webhook_secret_ct", WEBHOOK_SECRET_PURPOSE, resource="id", tenant="id"),
    SealedColumn(table_of(Token), "data_ct", TOKEN_PURPOSE),
    SealedColumn(table_of(TokenIdempotencyKey), "answer_ct", ANSWER_PURPOSE, resource_parts=("scope", "key")),
    SealedColumn(table_of(NetworkToken), "data_ct", NETWORK_TOKEN_PURPOSE),
    SealedColumn(table_of(NetworkToken), "source_ct", NETWORK_TOKEN_SOURCE_PURPOSE),
    SealedColumn(table_of(TokenIntent), "data_ct", TOKEN_INTENT_PURPOSE),
    SealedColumn(table_of(ClientEncryptionKey), "private_key_ct", CLIENT_KEY_PURPOSE),
    SealedColumn(table_of(WalletMerchantKey), "private_key_ct", KEY_PURPOSE),
    SealedColumn(table_of(WalletToken), "data_ct", WALLET_TOKEN_PURPOSE),
    SealedColumn(table_of(WalletToken), "cryptogram_ct", CRYPTOGRAM_PURPOSE),
    SealedColumn(table_of(WalletSession), "session_ct", SESSION_PURPOSE),
    SealedColumn(table_of(AllowanceRail), "otp_sealed", OTP_PURPOSE),
    SealedColumn(table_of(PaymentCredential), "sealed", SEALED_PURPOSE),
    SealedColumn(table_of(Proxy), "configuration_ct", PROXY_CONFIGURATION_PURPOSE),
    SealedColumn(table_of(Reactor), "configuration_ct", REACTOR_CONFIGURATION_PURPOSE),
    SealedColumn(table_of(Reactor), "requested_configuration_ct", REACTOR_CONFIGURATION_PURPOSE),
    SealedColumn(table_of(ReactorRun), "request_ct", RUN_PURPOSE),
    SealedColumn(table_of(ReactorRun), "result_ct", RUN_PURPOSE),
)

#: Binary columns that hold no value sealed under a tenant's data key, and why.
NOT_SEALED_BY_TENANT_KEYS: dict[str, str] = {
    "tenant_data_keys.wrapped_key": "a data key, wrapped by the master or KMS key (tessera keys rewrap)",
    "tenant_index_keys.wrapped_key": "the derivation key, wrapped by the master or KMS key (tessera keys rewrap)",
    "key_checks.check_value": "the key check, wrapped by the master or KMS key",
    "account_updater_chunks.result": "a chunk's result rows as CSV text: token ids and expiry dates, no card data",
}
