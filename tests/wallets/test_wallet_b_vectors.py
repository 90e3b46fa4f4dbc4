"""wallet-b (ECv2) against the public vectors: the valid token decrypts to its published plaintext
and each refused token fails with its own error."""

from __future__ import annotations

import copy
import datetime as dt
import json

import pytest

from domain.wallets import errors, wallet_b
from tests.wallets.conftest import fixed, flip
from tests.wallets.issuers import new_key

#: Before the valid token's intermediate key expires (2029-07-22).
NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def setup(wallet_b_vectors) -> dict:
    return {
        "recipient_id": wallet_b_vectors["recipient_id"],
        "merchant_keys": [wallet_b.private_key_from_b64_pkcs8(wallet_b_vectors["private_key"])],
        "root_keys": [wallet_b.RootSigningKey.from_json(wallet_b_vectors["valid_root_signing_key"])],
    }


def decrypt(token, setup, *, at=NOW, **overrides):
    return wallet_b.decrypt_token(token, clock=fixed(at), **(setup | overrides))


def test_valid_token_decrypts_to_its_published_plaintext(wallet_b_vectors, setup):
    payment = decrypt(wallet_b_vectors["encrypted_token"], setup)
    expected = wallet_b_vectors["decrypted_google_pay_token"]
    details = expected["paymentMethodDetails"]
    assert payment.auth_method == details["authMethod"] == "PAN_ONLY"
    assert payment.resource_kind == "token_intent"
    assert payment.data.number == details["pan"]
    assert payment.data.expiration_month == details["expirationMonth"]
    assert payment.data.expiration_year == details["expirationYear"]
    assert payment.message_id == expected["messageId"]
    assert payment.message_expires_at == dt.datetime.fromtimestamp(int(expected["messageExpiration"]) / 1000, dt.UTC)
    assert payment.message_expires_at.year == 3000
    assert payment.payment_method == "CARD"
    assert payment.authentication is None
    assert payment.resource_fields() == {
        "auth_method": "PAN_ONLY",
        "message_id": expected["messageId"],
        "data": {"number": "4111111111111111", "expiration_month": 12, "expiration_year": 2026},
        "authentication": None,
    }
    assert "4111111111111111" not in repr(payment)


def test_token_given_as_json_text_decrypts_alike(wallet_b_vectors, setup):
    payment = decrypt(json.dumps(wallet_b_vectors["encrypted_token"]), setup)
    assert payment.data.number == "4111111111111111"


def test_expired_message_is_refused(wallet_b_vectors, setup):
    with pytest.raises(errors.MessageExpired) as caught:
        decrypt(wallet_b_vectors["encrypted_expired_token"], setup)
    assert caught.value.extra == {"code": "message_expired"}


def test_plaintext_that_is_not_json_is_refused(wallet_b_vectors, setup):
    with pytest.raises(errors.PaymentDataInvalid, match="not valid JSON"):
        decrypt(wallet_b_vectors["encrypted_plaintext"], setup)


def test_tag_that_does_not_verify_is_refused_before_decryption(wallet_b_vectors, setup):
    with pytest.raises(errors.DecryptionFailed, match="HMAC"):
        decrypt(wallet_b_vectors["encrypted_invalid_tag"], setup)


def test_expired_intermediate_key_is_refused(wallet_b_vectors, setup):
    with pytest.raises(errors.IntermediateKeyExpired, match="2013-02-16"):
        decrypt(wallet_b_vectors["encrypted_google_pay_token_with_expired_intermediate_signature"], setup)


def test_valid_token_after_its_intermediate_key_expired_is_refused(wallet_b_vectors, setup):
    with pytest.raises(errors.IntermediateKeyExpired):
        decrypt(wallet_b_vectors["encrypted_token"], setup, at=dt.datetime(2029, 7, 23, tzinfo=dt.UTC))


def test_wrong_recipient_fails_the_message_signature(wallet_b_vectors, setup):
    with pytest.raises(errors.MessageSignatureInvalid, match="merchant:12345678901234567890"):
        decrypt(wallet_b_vectors["encrypted_token"], setup, recipient_id="merchant:12345678901234567890")


def test_altered_signed_message_fails_the_message_signature(wallet_b_vectors, setup):
    token = copy.deepcopy(wallet_b_vectors["encrypted_token"])
    message = json.loads(token["signedMessage"])
    message["encryptedMessage"] = flip(message["encryptedMessage"])
    token["signedMessage"] = json.dumps(message)
    with pytest.raises(errors.MessageSignatureInvalid):
        decrypt(token, setup)


def test_altered_message_signature_is_refused(wallet_b_vectors, setup):
    token = copy.deepcopy(wallet_b_vectors["encrypted_token"])
    token["signature"] = flip(token["signature"], 10)
    with pytest.raises(errors.MessageSignatureInvalid):
        decrypt(token, setup)


def test_altered_intermediate_key_fails_its_signature(wallet_b_vectors, setup):
    token = copy.deepcopy(wallet_b_vectors["encrypted_token"])
    signed_key = json.loads(token["intermediateSigningKey"]["signedKey"])
    signed_key["keyExpiration"] = "9" + signed_key["keyExpiration"][1:]
    token["intermediateSigningKey"]["signedKey"] = json.dumps(signed_key)
    with pytest.raises(errors.IntermediateKeySignatureInvalid):
        decrypt(token, setup)


def test_expired_or_unknown_root_key_is_refused(wallet_b_vectors, setup):
    valid = setup["root_keys"][0]
    expired = wallet_b.RootSigningKey(valid.key, expires_at=NOW - dt.timedelta(seconds=1))
    ecv1 = wallet_b.RootSigningKey(valid.key, expires_at=None, protocol_version="ECv1")
    other = wallet_b.RootSigningKey(new_key().public_key(), expires_at=None)
    for roots in ([expired], [ecv1], [other], []):
        with pytest.raises(errors.IntermediateKeySignatureInvalid):
            decrypt(wallet_b_vectors["encrypted_token"], setup, root_keys=roots)


def test_wrong_merchant_key_fails_the_tag(wallet_b_vectors, setup):
    with pytest.raises(errors.DecryptionFailed):
        decrypt(wallet_b_vectors["encrypted_token"], setup, merchant_keys=[new_key()])


def test_key_rotation_tries_every_merchant_key(wallet_b_vectors, setup):
    keys = [new_key(), *setup["merchant_keys"]]
    assert decrypt(wallet_b_vectors["encrypted_token"], setup, merchant_keys=keys).data.number == "4111111111111111"


def test_other_protocol_versions_are_unsupported(wallet_b_vectors, setup):
    for version in ("ECv1", "ECv3"):
        token = copy.deepcopy(wallet_b_vectors["encrypted_token"]) | {"protocolVersion": version}
        with pytest.raises(errors.UnsupportedVersion):
            decrypt(token, setup)


def test_root_key_list_in_the_published_shape_is_read(wallet_b_vectors):
    keys = wallet_b.RootSigningKey.from_key_list({"keys": [wallet_b_vectors["valid_root_signing_key"]]})
    assert len(keys) == 1
    assert keys[0].protocol_version == "ECv2"
    assert keys[0].expires_at == dt.datetime.fromtimestamp(32506264800, dt.UTC)
