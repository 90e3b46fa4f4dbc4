"""wallet-b (ECv2) with tokens the tests seal themselves (their own root and intermediate signing keys):
CRYPTOGRAM_3DS and PAN_ONLY through the full path, and each way a token can be wrong."""

from __future__ import annotations

import base64
import datetime as dt
import json

import pytest

from domain.wallets import errors, wallet_b
from tests.wallets.conftest import fixed, flip
from tests.wallets.issuers import SIGNED_AT, WalletBIssuer, google_message, new_key

RECIPIENT = "merchant:12345678901234567890"
NOW = SIGNED_AT + dt.timedelta(seconds=30)


@pytest.fixture(scope="module")
def issuer() -> WalletBIssuer:
    return WalletBIssuer()


@pytest.fixture(scope="module")
def merchant():
    return new_key()


def decrypt(token, issuer, merchant, *, at=NOW, recipient_id=RECIPIENT, merchant_keys=None):
    return wallet_b.decrypt_token(
        token,
        recipient_id=recipient_id,
        merchant_keys=merchant_keys or [merchant],
        root_keys=[wallet_b.RootSigningKey.from_json(issuer.root_entry())],
        clock=fixed(at),
    )


def test_cryptogram_3ds_full_path(issuer, merchant):
    payment = decrypt(issuer.token(google_message(), merchant.public_key(), RECIPIENT), issuer, merchant)
    assert payment.auth_method == "CRYPTOGRAM_3DS"
    assert payment.resource_kind == "google_pay"
    assert payment.data.as_dict() == {"number": "4895370012003478", "expiration_month": 12, "expiration_year": 2029}
    assert payment.authentication.as_dict() == {
        "threeds_cryptogram": "AAAAAA8JjEB5hYZCE3ZkAAAAAAA=",
        "eci_indicator": "05",
    }
    assert payment.gateway_merchant_id == "tessera-test"
    assert payment.message_expires_at == SIGNED_AT + dt.timedelta(hours=1)
    shown = repr(payment)
    assert "4895370012003478" not in shown and "AAAAAA8JjEB5hYZCE3ZkAAAAAAA=" not in shown


def test_pan_only_full_path(issuer, merchant):
    payment = decrypt(issuer.token(google_message("PAN_ONLY"), merchant.public_key(), RECIPIENT), issuer, merchant)
    assert payment.resource_kind == "token_intent"
    assert payment.authentication is None
    assert payment.resource_fields()["data"]["number"] == "4895370012003478"


def test_eci_is_optional_for_cryptogram_3ds(issuer, merchant):
    message = google_message()
    del message["paymentMethodDetails"]["eciIndicator"]
    payment = decrypt(issuer.token(message, merchant.public_key(), RECIPIENT), issuer, merchant)
    assert payment.authentication.eci_indicator is None


def test_intermediate_key_expiry_is_checked_against_the_clock(merchant):
    issuer = WalletBIssuer(intermediate_expires_at=NOW)
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    assert decrypt(token, issuer, merchant, at=NOW - dt.timedelta(milliseconds=1))
    with pytest.raises(errors.IntermediateKeyExpired):
        decrypt(token, issuer, merchant, at=NOW)


def test_message_expiry_is_checked_against_the_clock(issuer, merchant):
    token = issuer.token(google_message(expires_at=NOW), merchant.public_key(), RECIPIENT)
    assert decrypt(token, issuer, merchant, at=NOW - dt.timedelta(milliseconds=1))
    with pytest.raises(errors.MessageExpired):
        decrypt(token, issuer, merchant, at=NOW)


def test_intermediate_key_signed_by_another_root_is_refused(issuer, merchant):
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT, intermediate_signer=new_key())
    with pytest.raises(errors.IntermediateKeySignatureInvalid):
        decrypt(token, issuer, merchant)


def test_one_good_signature_among_several_is_enough(issuer, merchant):
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    good = token["intermediateSigningKey"]["signatures"][0]
    token["intermediateSigningKey"]["signatures"] = [flip(good, 8), good]
    assert decrypt(token, issuer, merchant).data.number == "4895370012003478"


def test_token_sealed_for_another_recipient_is_refused(issuer, merchant):
    token = issuer.token(google_message(), merchant.public_key(), "merchant:other")
    with pytest.raises(errors.MessageSignatureInvalid, match=RECIPIENT):
        decrypt(token, issuer, merchant)


def test_swapped_ephemeral_key_fails_the_tag(issuer, merchant):
    """A message re-signed by the intermediate key with another ephemeral key derives other keys."""
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    message = json.loads(token["signedMessage"])
    other = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    message["ephemeralPublicKey"] = json.loads(other["signedMessage"])["ephemeralPublicKey"]
    token |= issuer.sign_message(json.dumps(message), RECIPIENT)
    with pytest.raises(errors.DecryptionFailed):
        decrypt(token, issuer, merchant)


def test_ciphertext_altered_and_re_signed_fails_the_tag(issuer, merchant):
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    message = json.loads(token["signedMessage"])
    message["encryptedMessage"] = flip(message["encryptedMessage"], 0)
    token |= issuer.sign_message(json.dumps(message), RECIPIENT)
    with pytest.raises(errors.DecryptionFailed):
        decrypt(token, issuer, merchant)


def test_rotation_tries_each_merchant_key(issuer, merchant):
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    assert decrypt(token, issuer, merchant, merchant_keys=[new_key(), merchant]).data.number == "4895370012003478"


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (google_message() | {"paymentMethod": "CRYPTO"}, "paymentMethod must be CARD"),
        (google_message(authMethod="3DS"), "CRYPTOGRAM_3DS or PAN_ONLY"),
        (google_message(cryptogram=None), "cryptogram"),
        (google_message(pan="41111111111111AB"), "12 to 19 digits"),
        (google_message("PAN_ONLY", expirationMonth=13), "expirationMonth"),
        (google_message("PAN_ONLY", expirationYear="2029"), "expirationYear"),
        (google_message() | {"messageExpiration": 1}, "milliseconds"),
        (google_message() | {"messageExpiration": "9" * 15}, "out of range"),
        (google_message() | {"messageId": ""}, "messageId"),
        (google_message() | {"paymentMethodDetails": []}, "paymentMethodDetails must be an object"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_payment_data_faults_are_refused_without_echoing_card_data(issuer, merchant, message, text):
    token = issuer.token(message, merchant.public_key(), RECIPIENT)
    with pytest.raises(errors.PaymentDataInvalid, match=text) as caught:
        decrypt(token, issuer, merchant)
    assert "4895370012003478" not in json.dumps(caught.value.body())


@pytest.mark.parametrize(
    ("alter", "text"),
    [
        (lambda t: t.pop("intermediateSigningKey"), "intermediateSigningKey must be an object"),
        (lambda t: t["intermediateSigningKey"].update(signatures=[]), "signatures must be an array"),
        (lambda t: t["intermediateSigningKey"].update(signatures=[7]), r"signatures\[0\] must be a string"),
        (lambda t: t["intermediateSigningKey"].update(signatures=["%%%"]), "not valid base64"),
        (lambda t: t.pop("signature"), "token.signature must be a non-empty string"),
        (lambda t: t.update(signedMessage=None), "token.signedMessage must be a non-empty string"),
        (lambda t: t.pop("protocolVersion"), "protocolVersion must be a non-empty string"),
        (lambda t: t.update(signedMessage=t["signedMessage"] + "\ud800"), "signedMessage is not valid Unicode"),
        (lambda t: t["intermediateSigningKey"].update(signedKey="\udfff"), "signedKey is not valid Unicode"),
    ],
)
def test_malformed_tokens_are_400_naming_the_field(issuer, merchant, alter, text):
    token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
    alter(token)
    with pytest.raises(errors.MalformedToken, match=text) as caught:
        decrypt(token, issuer, merchant)
    assert caught.value.status == 400


def test_compressed_or_foreign_ephemeral_points_are_malformed(issuer, merchant):
    for point in (b"\x02" + bytes(32), b"\x04" + bytes(64)):
        message = {"encryptedMessage": "AAAA", "ephemeralPublicKey": base64.b64encode(point).decode(), "tag": "AAAA"}
        token = issuer.token(google_message(), merchant.public_key(), RECIPIENT)
        token |= issuer.sign_message(json.dumps(message), RECIPIENT)
        with pytest.raises(errors.MalformedToken, match="ephemeralPublicKey"):
            decrypt(token, issuer, merchant)


def test_signed_string_is_length_prefixed_little_endian():
    assert wallet_b.signed_string("Google", "ECv2") == b"\x06\x00\x00\x00Google\x04\x00\x00\x00ECv2"
    assert wallet_b.signed_string("é") == b"\x02\x00\x00\x00\xc3\xa9"
