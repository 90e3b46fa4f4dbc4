"""Fuzzing the token parsers with hypothesis: whatever the input, a wallet token is either decrypted to
exactly what was sealed or refused with a typed :class:`WalletTokenError`; never another exception."""

from __future__ import annotations

import base64
import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.wallets import wallet_a, wallet_b
from domain.wallets.errors import MessageExpired, PaymentDataInvalid, WalletTokenError
from tests.wallets.conftest import fixed
from tests.wallets.issuers import (
    SIGNED_AT,
    Merchant,
    WalletACA,
    WalletBIssuer,
    apple_payment,
    google_message,
    key_pem,
    new_key,
    pem,
)

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
CLOCK = fixed(SIGNED_AT)

CA = WalletACA()
MERCHANT = Merchant()
MERCHANT_KEY = wallet_a.MerchantKey.from_pem(pem(MERCHANT.certificate), key_pem(MERCHANT.key))
A_TOKEN = CA.token(apple_payment(), MERCHANT)

ISSUER = WalletBIssuer()
B_MERCHANT = new_key()
RECIPIENT = "merchant:fuzz"
B_TOKEN = ISSUER.token(google_message(), B_MERCHANT.public_key(), RECIPIENT)
ROOTS = [wallet_b.RootSigningKey.from_json(ISSUER.root_entry())]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.text(st.characters(exclude_categories=()), max_size=8),  # lone surrogates included
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
base64_blobs = st.binary(max_size=300).map(lambda raw: base64.b64encode(raw).decode())
field_values = json_values | base64_blobs | st.text(alphabet="0123456789abcdef", max_size=64)


def decrypt_a(token):
    return wallet_a.decrypt_token(token, merchant_keys=[MERCHANT_KEY], root=CA.root, clock=CLOCK)


def decrypt_b(token):
    return wallet_b.decrypt_token(
        token, recipient_id=RECIPIENT, merchant_keys=[B_MERCHANT], root_keys=ROOTS, clock=CLOCK
    )


def refused_or_exact(decrypt, token, number: str) -> None:
    try:
        payment = decrypt(token)
    except WalletTokenError:
        return
    assert payment.data.number == number  # an alteration that left the token valid changed nothing sealed


@FUZZ
@given(json_values)
def test_wallet_a_any_json_is_refused_with_a_typed_error(value):
    refused_or_exact(decrypt_a, value, "4895370012003478")


@FUZZ
@given(
    st.fixed_dictionaries(
        {
            "version": st.just("EC_v1") | field_values,
            "data": field_values,
            "signature": field_values,
            "header": st.fixed_dictionaries(
                {
                    "ephemeralPublicKey": field_values,
                    "publicKeyHash": field_values,
                    "transactionId": field_values,
                },
                optional={"applicationData": field_values},
            )
            | json_values,
        }
    )
)
def test_wallet_a_token_shaped_garbage_is_refused_with_a_typed_error(token):
    refused_or_exact(decrypt_a, token, "4895370012003478")


@FUZZ
@given(st.data())
def test_wallet_a_mutated_cms_signature_is_refused_with_a_typed_error(data):
    raw = bytearray(base64.b64decode(A_TOKEN["signature"]))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    token = copy.deepcopy(A_TOKEN) | {"signature": base64.b64encode(bytes(raw[:cut])).decode()}
    refused_or_exact(decrypt_a, token, "4895370012003478")


@FUZZ
@given(json_values)
def test_wallet_a_payment_data_parser_raises_only_payment_data_invalid(value):
    try:
        wallet_a.parse_payment_data(
            value if isinstance(value, dict) else {"value": value}, transaction_id="00", signed_at=SIGNED_AT
        )
    except PaymentDataInvalid:
        pass


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(apple_payment())), json_values, max_size=8))
def test_wallet_a_payment_data_with_wrong_field_types_raises_only_payment_data_invalid(overrides):
    try:
        wallet_a.parse_payment_data(apple_payment(**overrides), transaction_id="00", signed_at=SIGNED_AT)
    except PaymentDataInvalid:
        pass


@FUZZ
@given(json_values | st.text(max_size=200))
def test_wallet_b_any_json_is_refused_with_a_typed_error(value):
    refused_or_exact(decrypt_b, value, "4895370012003478")


@FUZZ
@given(
    st.fixed_dictionaries(
        {
            "protocolVersion": st.just("ECv2") | field_values,
            "signature": field_values,
            "signedMessage": field_values | json_values.map(json.dumps),
            "intermediateSigningKey": st.fixed_dictionaries(
                {
                    "signedKey": field_values | json_values.map(json.dumps),
                    "signatures": st.lists(field_values, max_size=3) | field_values,
                }
            )
            | json_values,
        }
    )
)
def test_wallet_b_token_shaped_garbage_is_refused_with_a_typed_error(token):
    refused_or_exact(decrypt_b, token, "4895370012003478")


@FUZZ
@given(st.sampled_from(["signature", "signedMessage", "signedKey"]), st.data())
def test_wallet_b_mutated_fields_are_refused_with_a_typed_error(name, data):
    token = copy.deepcopy(B_TOKEN)
    holder = token["intermediateSigningKey"] if name == "signedKey" else token
    value = list(holder[name])
    for _ in range(data.draw(st.integers(1, 3))):
        value[data.draw(st.integers(0, len(value) - 1))] = data.draw(st.characters(codec="utf-8"))
    holder[name] = "".join(value)
    refused_or_exact(decrypt_b, token, "4895370012003478")


@FUZZ
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_wallet_b_message_parser_raises_only_typed_errors(plaintext):
    try:
        wallet_b.parse_payment(plaintext, SIGNED_AT)
    except (PaymentDataInvalid, MessageExpired):
        pass


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["pan", "expirationMonth", "expirationYear", "authMethod", "cryptogram", "eciIndicator"]),
        json_values,
        max_size=6,
    )
)
def test_wallet_b_card_details_with_wrong_field_types_raise_only_payment_data_invalid(details):
    message = google_message()
    message["paymentMethodDetails"] |= details
    try:
        wallet_b.parse_payment(json.dumps(message).encode(), SIGNED_AT)
    except PaymentDataInvalid:
        pass
