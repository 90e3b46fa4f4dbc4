"""wallet-a (EC_v1) with tokens the tests issue themselves (their own root, intermediate and leaf with
the marker OIDs, detached CMS signatures made with asn1crypto): the full verification and decryption
path, and each way a chain, a signature or the payment data can be wrong."""

from __future__ import annotations

import base64
import datetime as dt
import json

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from domain.wallets import errors, wallet_a
from tests.wallets.conftest import fixed
from tests.wallets.issuers import (
    INTERMEDIATE_OID,
    LEAF_OID,
    SIGNED_AT,
    Merchant,
    WalletACA,
    apple_payment,
    certificate,
    key_pem,
    new_key,
    pem,
)


@pytest.fixture(scope="module")
def ca() -> WalletACA:
    return WalletACA()


@pytest.fixture(scope="module")
def merchant() -> Merchant:
    return Merchant()


def merchant_key(merchant: Merchant) -> wallet_a.MerchantKey:
    return wallet_a.MerchantKey.from_pem(pem(merchant.certificate), key_pem(merchant.key))


def decrypt(token, merchants, root, *, at=SIGNED_AT + dt.timedelta(seconds=30), **options):
    return wallet_a.decrypt_token(
        token, merchant_keys=[merchant_key(m) for m in merchants], root=root, clock=fixed(at), **options
    )


def test_full_path_3dsecure_dpan(ca, merchant):
    token = ca.token(apple_payment(), merchant, application_data=b"order-1234")
    payment = decrypt(token, [merchant], ca.root)
    assert payment.type == "dpan"
    assert payment.data.as_dict() == {"number": "4895370012003478", "expiration_month": 12, "expiration_year": 2029}
    assert payment.authentication.as_dict() == {
        "threeds_cryptogram": "AgAAAAAABk4DWZ4C28yUQAAAAAA=",
        "eci_indicator": "7",
    }
    assert (payment.currency_code, payment.transaction_amount) == ("978", 1250)
    assert payment.transaction_id == bytes(range(32)).hex()
    assert payment.signed_at == SIGNED_AT
    assert payment.resource_fields()["expires_at"] == "2029-12-31T23:59:59.999999+00:00"


def test_merchant_token_is_an_mpan_and_eci_may_be_absent(ca, merchant):
    payment_data = apple_payment(
        merchantTokenIdentifier="DNITHE302308980427388297",
        cardholderName="",
        paymentData={"onlinePaymentCryptogram": "AgAAAAAABk4DWZ4C28yUQAAAAAA="},
    )
    payment = decrypt(ca.token(payment_data, merchant), [merchant], ca.root)
    assert payment.type == "mpan"
    assert payment.merchant_token_identifier == "DNITHE302308980427388297"
    assert payment.authentication.eci_indicator is None
    assert payment.cardholder_name is None


def test_emv_payment_has_no_3ds_authentication(ca, merchant):
    payment_data = apple_payment(paymentDataType="EMV", paymentData={"emvData": "nwIGAAAAAAAA", "encryptedPINData": ""})
    payment = decrypt(ca.token(payment_data, merchant), [merchant], ca.root)
    assert payment.payment_data_type == "EMV"
    assert payment.authentication is None
    assert payment.emv_data == "nwIGAAAAAAAA"
    assert payment.resource_fields()["authentication"] is None


def test_rotation_chooses_the_key_the_header_names(ca, merchant):
    retiring, incoming = Merchant(identifier=merchant.identifier), merchant
    token = ca.token(apple_payment(), incoming)
    assert decrypt(token, [retiring, incoming], ca.root).data.number == "4895370012003478"
    with pytest.raises(errors.MerchantKeyNotFound):
        decrypt(token, [retiring], ca.root)


def test_header_naming_another_key_fails_decryption(ca, merchant):
    other = Merchant(identifier=merchant.identifier)
    token = ca.token(apple_payment(), merchant, key_hash_of=other)
    with pytest.raises(errors.DecryptionFailed, match="GCM"):
        decrypt(token, [merchant, other], ca.root)


def test_another_merchant_identifier_fails_decryption(ca, merchant):
    same_key_other_id = Merchant(identifier="merchant.com.other", key=merchant.key)
    token = ca.token(apple_payment(), merchant)
    with pytest.raises(errors.DecryptionFailed):
        decrypt(token, [same_key_other_id], ca.root)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"leaf_marker": None}, "leaf certificate lacks the marker extension 1.2.840.113635.100.6.29"),
        ({"leaf_marker": INTERMEDIATE_OID}, "leaf certificate lacks the marker extension"),
        ({"intermediate_marker": None}, "intermediate certificate lacks the marker extension 1.2.840.113635.100.6.2"),
        ({"intermediate_marker": LEAF_OID}, "intermediate certificate lacks the marker extension"),
        ({"intermediate_ca": False}, "intermediate certificate is not a CA"),
        ({"leaf_not_after": SIGNED_AT - dt.timedelta(days=1)}, "leaf certificate is outside its validity period"),
    ],
)
def test_chain_faults_are_refused(merchant, options, message):
    faulty = WalletACA(**options)
    with pytest.raises(errors.CertificateInvalid, match=message) as caught:
        decrypt(faulty.token(apple_payment(), merchant), [merchant], faulty.root)
    assert caught.value.extra == {"code": "certificate_invalid"}


def test_a_chain_to_another_root_is_refused_even_when_the_token_carries_that_root(ca, merchant):
    impostor = WalletACA()
    chain = [impostor.leaf, impostor.intermediate, impostor.root]
    token = impostor.token(apple_payment(), merchant, certificates=chain)
    with pytest.raises(errors.CertificateInvalid, match="not signed by the pinned root"):
        decrypt(token, [merchant], ca.root)


def test_leaf_issued_by_a_lookalike_intermediate_is_refused(ca, merchant):
    lookalike_key = new_key()
    lookalike = certificate(
        "Test Application Integration CA",
        lookalike_key,
        issuer=ca.root,
        issuer_key=new_key(),
        ca=True,
        marker=INTERMEDIATE_OID,
    )
    token = ca.token(apple_payment(), merchant, certificates=[ca.leaf, lookalike])
    with pytest.raises(errors.CertificateInvalid, match="leaf certificate is not signed by the intermediate"):
        decrypt(token, [merchant], ca.root)


def test_missing_certificates_are_refused(ca, merchant):
    with pytest.raises(errors.CertificateInvalid, match="intermediate certificate that issued the leaf"):
        decrypt(ca.token(apple_payment(), merchant, certificates=[ca.leaf]), [merchant], ca.root)
    with pytest.raises(errors.CertificateInvalid, match="signer's certificate is not in the signature"):
        decrypt(ca.token(apple_payment(), merchant, certificates=[ca.intermediate]), [merchant], ca.root)


def test_an_expired_pinned_root_is_refused(merchant):
    ca = WalletACA()
    ca.root = certificate("Test Root CA", ca.root_key, ca=True, not_after=SIGNED_AT - dt.timedelta(seconds=1))
    with pytest.raises(errors.CertificateInvalid, match="root certificate is outside its validity period"):
        decrypt(ca.token(apple_payment(), merchant), [merchant], ca.root)


def test_signature_by_another_key_than_the_leaf_is_refused(ca, merchant):
    with pytest.raises(errors.SignatureInvalid, match="leaf certificate"):
        decrypt(ca.token(apple_payment(), merchant, signer_key=new_key()), [merchant], ca.root)


def test_signed_digest_of_other_content_is_refused(ca, merchant):
    with pytest.raises(errors.MessageDigestMismatch):
        decrypt(ca.token(apple_payment(), merchant, digest=bytes(32)), [merchant], ca.root)


def test_digest_algorithm_other_than_sha256_is_refused(ca, merchant):
    with pytest.raises(errors.SignatureInvalid, match="not ECDSA with SHA-256"):
        decrypt(ca.token(apple_payment(), merchant, digest_algorithm="sha384"), [merchant], ca.root)


def test_signing_time_is_required_and_checked(ca, merchant):
    with pytest.raises(errors.SigningTimeOutOfWindow, match="missing"):
        decrypt(ca.token(apple_payment(), merchant, signing_time=None), [merchant], ca.root)
    late = ca.token(apple_payment(), merchant)
    with pytest.raises(errors.SigningTimeOutOfWindow):
        decrypt(late, [merchant], ca.root, at=SIGNED_AT + dt.timedelta(minutes=5, seconds=1))
    assert decrypt(late, [merchant], ca.root, at=SIGNED_AT + dt.timedelta(minutes=5))


def test_root_replaced_by_a_pem_path(ca, merchant, tmp_path):
    path = tmp_path / "root.pem"
    path.write_bytes(pem(ca.root))
    root = wallet_a.load_root_ca(str(path))
    assert root == ca.root
    assert decrypt(ca.token(apple_payment(), merchant), [merchant], root).data.number == "4895370012003478"


@pytest.mark.parametrize(
    ("payment", "message"),
    [
        (b"not json at all", "not valid JSON"),
        (b"[1, 2]", "must be an object"),
        (apple_payment(applicationPrimaryAccountNumber="4895 3700 1200 3478"), "12 to 19 digits"),
        (apple_payment(applicationPrimaryAccountNumber=None), "12 to 19 digits"),
        (apple_payment(applicationExpirationDate="2912"), "YYMMDD"),
        (apple_payment(applicationExpirationDate="291332"), "not a calendar date"),
        (apple_payment(transactionAmount="12.50"), "transactionAmount"),
        (apple_payment(transactionAmount=True), "transactionAmount"),
        (apple_payment(currencyCode=None), "currencyCode"),
        (apple_payment(paymentDataType="Magstripe"), "3DSecure or EMV"),
        (apple_payment(paymentData={"eciIndicator": "7"}), "onlinePaymentCryptogram"),
        (apple_payment(paymentData="AgAAAAAABk4DWZ4C28yUQAAAAAA="), "paymentData.paymentData must be an object"),
        (apple_payment(paymentDataType="EMV", paymentData={}), "emvData"),
        (apple_payment(deviceManufacturerIdentifier=7), "deviceManufacturerIdentifier"),
    ],
)
def test_payment_data_faults_are_refused_without_echoing_card_data(ca, merchant, payment, message):
    with pytest.raises(errors.PaymentDataInvalid, match=message) as caught:
        decrypt(ca.token(payment, merchant), [merchant], ca.root)
    body = json.dumps(caught.value.body())
    assert "4895370012003478" not in body and "AgAAAAAABk4DWZ4C28yUQAAAAAA=" not in body
    assert caught.value.status == 422


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (lambda t: t.pop("header"), "paymentData.header must be an object"),
        (lambda t: t.update(data="not base64!"), "paymentData.data is not valid base64"),
        (lambda t: t.update(data=""), "paymentData.data must be a non-empty string"),
        (lambda t: t["header"].update(transactionId="xyz"), "transactionId is not valid hexadecimal"),
        (lambda t: t["header"].update(applicationData=12), "applicationData must be a string"),
        (lambda t: t.update(signature=base64.b64encode(b"\x30\x03\x02\x01\x01").decode()), "not a valid CMS"),
        (lambda t: t.pop("version"), "paymentData.version must be a non-empty string"),
    ],
)
def test_malformed_tokens_are_400_naming_the_field(ca, merchant, alter, message):
    token = ca.token(apple_payment(), merchant)
    alter(token)
    with pytest.raises(errors.MalformedToken, match=message) as caught:
        decrypt(token, [merchant], ca.root)
    assert caught.value.status == 400
    assert caught.value.body()["code"] == "malformed_token"


def test_ephemeral_key_on_another_curve_is_malformed(ca, merchant):
    """A signed token whose ephemeral key is not P-256 is refused before any key agreement."""
    token = ca.token(apple_payment(), merchant)
    der = (
        ec.generate_private_key(ec.SECP384R1())
        .public_key()
        .public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    )
    content = der + base64.b64decode(token["data"]) + bytes(range(32))
    token["header"]["ephemeralPublicKey"] = base64.b64encode(der).decode()
    token["signature"] = base64.b64encode(ca.sign(content)).decode()
    with pytest.raises(errors.MalformedToken, match="P-256"):
        decrypt(token, [merchant], ca.root)


def test_merchant_certificate_faults(merchant):
    other = Merchant()
    with pytest.raises(errors.MerchantCertificateInvalid, match="does not belong"):
        wallet_a.MerchantKey.from_pem(pem(merchant.certificate), key_pem(other.key))
    plain = certificate("No merchant id", merchant.key)
    with pytest.raises(errors.MerchantCertificateInvalid, match="no readable merchant id extension"):
        wallet_a.MerchantKey.from_pem(pem(plain), key_pem(merchant.key))
    bad_id = certificate(
        "Bad merchant id", merchant.key, extra=(x509.UnrecognizedExtension(wallet_a.MERCHANT_ID_OID, b"\x0c\x03abc"),)
    )
    with pytest.raises(errors.MerchantCertificateInvalid, match="64 hexadecimal digits"):
        wallet_a.MerchantKey.from_pem(pem(bad_id), key_pem(merchant.key))
    with pytest.raises(errors.MerchantCertificateInvalid, match="not valid PEM"):
        wallet_a.MerchantKey.from_pem(b"-----BEGIN CERTIFICATE-----\n", key_pem(merchant.key))


def test_a_chain_verified_before_still_has_its_validity_checked(ca, merchant):
    token = ca.token(apple_payment(), merchant)
    assert decrypt(token, [merchant], ca.root).data.number == "4895370012003478"
    with pytest.raises(errors.CertificateInvalid, match="leaf certificate is outside its validity period"):
        decrypt(
            token,
            [merchant],
            ca.root,
            at=ca.leaf.not_valid_after_utc + dt.timedelta(seconds=1),
            signing_time_window=dt.timedelta(days=3650),
        )


def test_apple_payment_data_body_needs_the_matching_transaction_identifier(ca, merchant):
    token = ca.token(apple_payment(), merchant)
    keys = [merchant_key(merchant)]
    clock = fixed(SIGNED_AT)
    body = {
        "paymentData": token,
        "transactionIdentifier": bytes(range(32)).hex().upper(),
        "paymentMethod": {"network": "Visa"},
    }
    assert wallet_a.decrypt_payment(body, merchant_keys=keys, root=ca.root, clock=clock).data.number == (
        "4895370012003478"
    )
    for faulty, message in (
        (body | {"transactionIdentifier": "00" * 32}, "does not match"),
        ({"paymentData": token}, "transactionIdentifier must be a non-empty string"),
        ({"transactionIdentifier": body["transactionIdentifier"]}, "paymentData must be an object"),
    ):
        with pytest.raises(errors.MalformedToken, match=message):
            wallet_a.decrypt_payment(faulty, merchant_keys=keys, root=ca.root, clock=clock)
