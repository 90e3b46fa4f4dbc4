"""wallet-a (EC_v1) against the public vector: a real token signed by Apple's chain decrypts to its
published plaintext at the signing time, and every alteration is refused with its own error."""

from __future__ import annotations

import base64
import copy
import datetime as dt

import pytest
from asn1crypto import cms
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_der_public_key

from domain.wallets import errors, wallet_a
from tests.wallets.conftest import fixed, flip
from tests.wallets.issuers import Merchant, WalletACA, key_pem, pem

SIGNED_AT = dt.datetime(2021, 9, 1, 19, 3, 6, tzinfo=dt.UTC)
MERCHANT_ID_HASH = "358DA5890B9555C0A9EFB84B5CD6FF04BFDCD5AABF5DC14B9872D8DF51EAF439"


@pytest.fixture(scope="module")
def merchant_key(wallet_a_vector) -> wallet_a.MerchantKey:
    return wallet_a.MerchantKey.from_pem(wallet_a_vector["certificate"], wallet_a_vector["private_key"])


@pytest.fixture(scope="module")
def root(wallet_a_vector):
    return wallet_a.load_root_ca(wallet_a_vector["root_path"])


def decrypt(token, merchant_key, root, *, at=SIGNED_AT, **options):
    return wallet_a.decrypt_token(token, merchant_keys=[merchant_key], root=root, clock=fixed(at), **options)


def test_merchant_key_reads_the_merchant_id_hash_and_public_key_hash(merchant_key, wallet_a_vector):
    assert merchant_key.merchant_id_hash.hex().upper() == MERCHANT_ID_HASH
    assert merchant_key.public_key_hash_b64 == wallet_a_vector["token"]["header"]["publicKeyHash"]
    assert merchant_key.expires_at == dt.datetime(2023, 9, 30, 14, 15, 8, tzinfo=dt.UTC)
    assert "private_key" not in repr(merchant_key)


def test_ecdh_and_kdf_give_the_published_intermediate_values(merchant_key, wallet_a_vector):
    header = wallet_a_vector["token"]["header"]
    ephemeral = load_der_public_key(base64.b64decode(header["ephemeralPublicKey"]))
    shared_secret = merchant_key.private_key.exchange(ec.ECDH(), ephemeral)
    assert base64.b64encode(shared_secret).decode() == "yCUzDuNYTnUnANZEdxC7+DvPmqNslB2YWYn68SBsJHU="
    key = wallet_a.derive_key(shared_secret, merchant_key.merchant_id_hash)
    assert base64.b64encode(key).decode() == "3GTXJ4RuP/IhS23hsdOw2J2ecAZmC0RasbPIFdC3nQM="


def test_vector_decrypts_to_its_published_plaintext(wallet_a_vector, merchant_key, root):
    payment = decrypt(wallet_a_vector["token"], merchant_key, root)
    assert payment.data.number == "5353756319181169"
    assert (payment.data.expiration_month, payment.data.expiration_year) == (9, 2024)
    assert payment.expires_at == dt.datetime(2024, 9, 30, 23, 59, 59, 999999, tzinfo=dt.UTC)
    assert payment.currency_code == "840"
    assert payment.transaction_amount == 100
    assert payment.cardholder_name is None
    assert payment.device_manufacturer_identifier == "050110030273"
    assert payment.payment_data_type == "3DSecure"
    assert payment.authentication.threeds_cryptogram == "AMwBRjPWDnAgAA7Rls7mAoABFA=="
    assert payment.type == "dpan"
    assert payment.signed_at == SIGNED_AT
    assert payment.transaction_id == wallet_a_vector["token"]["header"]["transactionId"]
    assert payment.resource_fields() == {
        "type": "dpan",
        "transaction_id": payment.transaction_id,
        "payment_data_type": "3DSecure",
        "device_manufacturer_identifier": "050110030273",
        "expires_at": "2024-09-30T23:59:59.999999+00:00",
        "data": {"number": "5353756319181169", "expiration_month": 9, "expiration_year": 2024},
        "authentication": {
            "threeds_cryptogram": "AMwBRjPWDnAgAA7Rls7mAoABFA==",
            "eci_indicator": payment.authentication.eci_indicator,
        },
    }
    shown = repr(payment)
    assert "5353756319181169" not in shown and "AMwBRjPWDnAgAA7Rls7mAoABFA==" not in shown


def test_the_shipped_root_is_apple_root_ca_g3_and_is_the_default(wallet_a_vector, merchant_key, root):
    shipped = wallet_a.load_root_ca()
    assert shipped == root
    assert shipped.subject.rfc4514_string() == (
        "C=US,O=Apple Inc.,OU=Apple Certification Authority,CN=Apple Root CA - G3"
    )
    payment = wallet_a.decrypt_token(wallet_a_vector["token"], merchant_keys=[merchant_key], clock=fixed(SIGNED_AT))
    assert payment.data.number == "5353756319181169"


def test_signing_time_window_is_enforced_both_ways(wallet_a_vector, merchant_key, root):
    window = dt.timedelta(minutes=2)
    assert decrypt(wallet_a_vector["token"], merchant_key, root, at=SIGNED_AT + window, signing_time_window=window)
    for at in (SIGNED_AT + window + dt.timedelta(seconds=1), SIGNED_AT - window - dt.timedelta(seconds=1)):
        with pytest.raises(errors.SigningTimeOutOfWindow) as caught:
            decrypt(wallet_a_vector["token"], merchant_key, root, at=at, signing_time_window=window)
        assert caught.value.extra == {"code": "signing_time_out_of_window"}
        assert caught.value.status == 422


def test_today_the_expired_apple_certificates_are_refused(wallet_a_vector, merchant_key, root):
    with pytest.raises(errors.CertificateInvalid, match="leaf certificate is outside its validity period"):
        decrypt(wallet_a_vector["token"], merchant_key, root, at=dt.datetime(2026, 11, 23, tzinfo=dt.UTC))


@pytest.mark.parametrize(
    ("field", "alter"),
    [
        ("data", lambda token: token.update(data=flip(token["data"]))),
        (
            "ephemeralPublicKey",
            lambda token: token["header"].update(ephemeralPublicKey=flip(token["header"]["ephemeralPublicKey"], 40)),
        ),
        (
            "transactionId",
            lambda token: token["header"].update(transactionId="00" + token["header"]["transactionId"][2:]),
        ),
        ("applicationData", lambda token: token["header"].update(applicationData="deadbeef")),
    ],
)
def test_altered_signed_fields_fail_the_message_digest(wallet_a_vector, merchant_key, root, field, alter):
    token = copy.deepcopy(wallet_a_vector["token"])
    alter(token)
    with pytest.raises(errors.MessageDigestMismatch) as caught:
        decrypt(token, merchant_key, root)
    assert caught.value.extra["code"] == "message_digest_mismatch"


def test_altered_signature_value_is_refused(wallet_a_vector, merchant_key, root):
    token = copy.deepcopy(wallet_a_vector["token"])
    raw = base64.b64decode(token["signature"])
    signer = cms.ContentInfo.load(raw)["content"]["signer_infos"][0]
    signature = signer["signature"].native
    altered = signature[:-1] + bytes([signature[-1] ^ 0x01])
    assert raw.count(signature) == 1
    token["signature"] = base64.b64encode(raw.replace(signature, altered)).decode()
    with pytest.raises(errors.SignatureInvalid, match="does not verify with the leaf certificate"):
        decrypt(token, merchant_key, root)


def test_another_merchant_key_is_not_chosen(wallet_a_vector, root):
    other = Merchant()
    other_key = wallet_a.MerchantKey.from_pem(pem(other.certificate), key_pem(other.key))
    with pytest.raises(errors.MerchantKeyNotFound):
        decrypt(wallet_a_vector["token"], other_key, root)


def test_a_root_other_than_the_pinned_one_refuses_apple_tokens(wallet_a_vector, merchant_key):
    with pytest.raises(errors.CertificateInvalid, match="not signed by the pinned root"):
        decrypt(wallet_a_vector["token"], merchant_key, WalletACA().root)


def test_rsa_v1_and_unknown_versions_are_unsupported(wallet_a_vector, merchant_key, root):
    for version in ("RSA_v1", "EC_v2"):
        token = copy.deepcopy(wallet_a_vector["token"]) | {"version": version}
        with pytest.raises(errors.UnsupportedVersion):
            decrypt(token, merchant_key, root)
