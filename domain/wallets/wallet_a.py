"""wallet-a (Apple Pay) payment tokens, version EC_v1: verification then decryption (spec 001 sections 2, 4).

A token is the ``paymentData`` object of the wallet's payment response::

    {"version": "EC_v1", "data": <base64 ciphertext>, "signature": <base64 CMS>,
     "header": {"ephemeralPublicKey": <base64 SPKI>, "publicKeyHash": <base64 SHA-256>,
                "transactionId": <hex>, "applicationData": <hex, optional>}}

:func:`decrypt_token` verifies it as the payment token format requires (steps 1-4:
:mod:`domain.wallets.wallet_a_signature`) and only then decrypts it:

1. the signature is a detached CMS ``SignedData`` (parsed with asn1crypto) with one signer;
2. the signer's leaf certificate carries OID 1.2.840.113635.100.6.29, the certificate that issued it
   carries 1.2.840.113635.100.6.2.14 and is a CA, and the intermediate is signed by the pinned
   Apple Root CA - G3 (the copy shipped in ``roots/``, or the PEM the ``TESSERA_WALLET_A_ROOT_CA``
   setting names): a root carried inside the token is never trusted; every certificate is within its
   validity period at the clock's time;
3. the ``message-digest`` signed attribute is SHA-256 of ephemeralPublicKey || data || transactionId
   || applicationData, and the ECDSA-with-SHA-256 signature over the signed attributes verifies with
   the leaf key;
4. the ``signing-time`` attribute is within a window of the clock (replay guard);
5. the merchant key is chosen by ``header.publicKeyHash`` among the configured ones (rotation);
   ECDH with the ephemeral key, the single-step KDF of NIST SP 800-56A (SHA-256, other info
   ``"\\x0did-aes256-GCM" || "Apple" || SHA-256(merchant id)``), AES-256-GCM with a 16-byte zero IV;
6. the decrypted payment data is parsed into :class:`WalletAPayment`.

:func:`decrypt_payment` does the same for the tokenize body's ``apple_payment_data`` (``paymentData``
and a matching ``transactionIdentifier``). Any failure raises a
:class:`~domain.wallets.errors.WalletTokenError` subclass; nothing partial is returned. RSA_v1 tokens
are refused with :class:`UnsupportedVersion`. Certificate signatures are remembered per (certificate,
issuer) pair, since they depend on nothing else; validity periods are checked on every token.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from asn1crypto import core
from cryptography import x509
from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash

from domain.wallets.errors import (
    DecryptionFailed,
    MalformedToken,
    MerchantCertificateInvalid,
    MerchantKeyNotFound,
    PaymentDataInvalid,
    UnsupportedVersion,
)
from domain.wallets.fields import (
    DEFAULT_CLOCK,
    Authentication,
    CardData,
    Clock,
    aware,
    b64,
    card_number,
    hexa,
    load_json,
    obj,
    p256_public_key,
    text,
)
from domain.wallets.wallet_a_signature import DEFAULT_SIGNING_TIME_WINDOW, verify_signature

#: Extension of the merchant's payment processing certificate holding the merchant id hash (hex).
MERCHANT_ID_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.32")

#: The other info of the single-step KDF: algorithm id (length-prefixed) and party U info.
KDF_ALGORITHM_ID = b"\x0did-aes256-GCM"
KDF_PARTY_U = b"Apple"
GCM_IV = bytes(16)

VERSION = "EC_v1"
PAYMENT_DATA_TYPES = ("3DSecure", "EMV")


@lru_cache(maxsize=8)
def load_root_ca(path: str | None = None) -> x509.Certificate:
    """The pinned wallet-a root: Apple Root CA - G3 shipped with the package, or the PEM certificate at
    ``path`` (the ``TESSERA_WALLET_A_ROOT_CA`` setting, for sandboxes and tests).

    Raises :class:`OSError` when ``path`` cannot be read and :class:`ValueError` when it is not a PEM
    certificate: a misconfigured root is an operator error, not a token error.
    """
    if path is None:
        pem = resources.files("domain.wallets").joinpath("roots/AppleRootCA-G3.pem").read_bytes()
    else:
        with open(os.fspath(path), "rb") as handle:
            pem = handle.read()
    return x509.load_pem_x509_certificate(pem)


def public_key_hash(public_key: ec.EllipticCurvePublicKey) -> bytes:
    """SHA-256 of the DER SubjectPublicKeyInfo: what ``header.publicKeyHash`` carries (base64)."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).digest()


@dataclass(frozen=True)
class MerchantKey:
    """One of a merchant's payment processing keys (several may be active during a rotation).

    ``private_key`` P-256 (kept out of ``repr``); ``merchant_id_hash`` the 32-byte SHA-256 of the
    merchant identifier (party V info of the KDF); ``public_key_hash`` the 32 bytes the token's
    ``header.publicKeyHash`` names; ``expires_at`` the certificate's end of validity.
    """

    private_key: ec.EllipticCurvePrivateKey = field(repr=False)
    merchant_id_hash: bytes
    public_key_hash: bytes
    expires_at: dt.datetime | None = None

    @property
    def public_key_hash_b64(self) -> str:
        """``public_key_hash`` in base64, as the token header and the API show it."""
        return base64.b64encode(self.public_key_hash).decode()

    @classmethod
    def from_pem(cls, certificate_pem: bytes, private_key_pem: bytes, password: bytes | None = None) -> MerchantKey:
        """The key of a payment processing certificate (PEM) and its private key (PEM, PKCS#8 or SEC1).

        The merchant id hash is read from extension 1.2.840.113635.100.6.32 (a UTF8String of 64 hex
        digits). Raises :class:`MerchantCertificateInvalid` when the certificate or key cannot be read,
        the key is not P-256, the extension is absent or the key does not belong to the certificate.
        The message never includes key material.
        """
        try:
            certificate = x509.load_pem_x509_certificate(certificate_pem)
            private_key = serialization.load_pem_private_key(private_key_pem, password=password)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise MerchantCertificateInvalid("certificate or private key is not valid PEM") from None
        if not isinstance(private_key, ec.EllipticCurvePrivateKey) or not isinstance(private_key.curve, ec.SECP256R1):
            raise MerchantCertificateInvalid("private key must be an EC P-256 key")
        if certificate.public_key() != private_key.public_key():
            raise MerchantCertificateInvalid("private key does not belong to the certificate")
        return cls(
            private_key=private_key,
            merchant_id_hash=merchant_id_hash(certificate),
            public_key_hash=public_key_hash(private_key.public_key()),
            expires_at=certificate.not_valid_after_utc,
        )


def merchant_id_hash(certificate: x509.Certificate) -> bytes:
    """The 32-byte merchant id hash of extension 1.2.840.113635.100.6.32 of a payment processing
    certificate (a DER UTF8String of 64 hex digits), else :class:`MerchantCertificateInvalid`."""
    try:
        extension = certificate.extensions.get_extension_for_oid(MERCHANT_ID_OID).value
    except (x509.ExtensionNotFound, ValueError):
        raise MerchantCertificateInvalid("certificate has no readable merchant id extension") from None
    if not isinstance(extension, x509.UnrecognizedExtension):  # cryptography does not know this OID
        raise MerchantCertificateInvalid("certificate has no readable merchant id extension")
    raw = extension.value
    try:
        decoded = bytes.fromhex(_extension_text(raw))
    except ValueError:
        decoded = b""
    if len(decoded) != 32:
        raise MerchantCertificateInvalid("merchant id extension is not 64 hexadecimal digits")
    return decoded


def _extension_text(raw: bytes) -> str:
    """The text of a DER string extension value (UTF8String, IA5String...), else ``raw`` read as ASCII
    (raises :class:`ValueError` when it is neither)."""
    try:
        value = core.load(raw).native
    except ValueError:
        value = None
    return value if isinstance(value, str) else raw.decode("ascii")


@dataclass(frozen=True)
class WalletAPayment:
    """A verified, decrypted wallet-a token: the fields of the wallet token resource (spec 001 section 2)
    that come from the token, plus the transaction context the payment data carries.

    ``type`` ``dpan`` (device token) or ``mpan`` (merchant token: the payment data names a
    ``merchantTokenIdentifier``); ``transaction_id`` the header's hex transaction id;
    ``payment_data_type`` ``3DSecure`` or ``EMV``; ``data`` the network token (DPAN or MPAN) and its
    expiry; ``authentication`` the online payment cryptogram and ECI (``3DSecure`` only);
    ``expires_at`` the end (UTC) of the day the token's ``applicationExpirationDate`` names;
    ``currency_code`` ISO 4217 numeric; ``transaction_amount`` in minor units; ``signed_at`` the CMS
    signing time. Card number, cryptogram, cardholder name and EMV data stay out of ``repr``.
    """

    type: str
    transaction_id: str
    payment_data_type: str
    device_manufacturer_identifier: str
    data: CardData
    authentication: Authentication | None
    expires_at: dt.datetime
    currency_code: str
    transaction_amount: int
    signed_at: dt.datetime
    cardholder_name: str | None = field(default=None, repr=False)
    emv_data: str | None = field(default=None, repr=False)
    merchant_token_identifier: str | None = None

    def resource_fields(self) -> dict:
        """The wallet token resource members this token fills (spec 001 section 2): ``type``,
        ``transaction_id``, ``payment_data_type``, ``device_manufacturer_identifier``, ``expires_at``
        (ISO 8601), ``data`` and ``authentication`` (``None`` for EMV)."""
        return {
            "type": self.type,
            "transaction_id": self.transaction_id,
            "payment_data_type": self.payment_data_type,
            "device_manufacturer_identifier": self.device_manufacturer_identifier,
            "expires_at": self.expires_at.isoformat(),
            "data": self.data.as_dict(),
            "authentication": self.authentication.as_dict() if self.authentication else None,
        }


@dataclass(frozen=True)
class _Token:
    """The decoded fields of an EC_v1 token."""

    data: bytes
    signature: bytes
    ephemeral_public_key: bytes
    public_key_hash: bytes
    transaction_id: bytes
    application_data: bytes

    @property
    def signed_content(self) -> bytes:
        """ephemeralPublicKey || data || transactionId || applicationData: what the CMS signature covers."""
        return self.ephemeral_public_key + self.data + self.transaction_id + self.application_data


def parse_token(payment_data: object) -> _Token:
    """The decoded fields of an EC_v1 ``paymentData`` object (shape only, nothing verified).

    Raises :class:`MalformedToken` naming the faulty field, :class:`UnsupportedVersion` for a version
    other than ``EC_v1`` (``RSA_v1`` included).
    """
    token = obj(payment_data, "paymentData")
    version = text(token, "version", "paymentData")
    if version != VERSION:
        raise UnsupportedVersion(f"paymentData.version {version[:16]!r} is not supported; only {VERSION} is")
    header = obj(token.get("header"), "paymentData.header")
    application_data = header.get("applicationData")
    if application_data is not None and not isinstance(application_data, str):
        raise MalformedToken("paymentData.header.applicationData must be a string")
    return _Token(
        data=b64(text(token, "data", "paymentData"), "paymentData.data"),
        signature=b64(text(token, "signature", "paymentData"), "paymentData.signature"),
        ephemeral_public_key=b64(
            text(header, "ephemeralPublicKey", "paymentData.header"), "paymentData.header.ephemeralPublicKey"
        ),
        public_key_hash=b64(text(header, "publicKeyHash", "paymentData.header"), "paymentData.header.publicKeyHash"),
        transaction_id=hexa(text(header, "transactionId", "paymentData.header"), "paymentData.header.transactionId"),
        application_data=hexa(application_data or "", "paymentData.header.applicationData"),
    )


def derive_key(shared_secret: bytes, merchant_id_hash_: bytes) -> bytes:
    """The 32-byte AES key: NIST SP 800-56A single-step KDF (SHA-256, counter 1) over the ECDH shared
    secret with other info ``"\\x0did-aes256-GCM" || "Apple" || merchant id hash``."""
    kdf = ConcatKDFHash(
        algorithm=hashes.SHA256(), length=32, otherinfo=KDF_ALGORITHM_ID + KDF_PARTY_U + merchant_id_hash_
    )
    return kdf.derive(shared_secret)


def _merchant_key(token: _Token, merchant_keys: Sequence[MerchantKey]) -> MerchantKey:
    for key in merchant_keys:
        if hmac.compare_digest(key.public_key_hash, token.public_key_hash):
            return key
    raise MerchantKeyNotFound("no configured merchant key matches header.publicKeyHash")


def decrypt_payment_data(token: _Token, merchant_keys: Sequence[MerchantKey]) -> dict:
    """The decrypted payment data object of a (verified) token (step 5).

    Raises :class:`MerchantKeyNotFound`, :class:`MalformedToken` (ephemeral key not P-256),
    :class:`DecryptionFailed` (GCM tag does not verify: wrong key or altered ciphertext) or
    :class:`PaymentDataInvalid` (plaintext not a JSON object).
    """
    key = _merchant_key(token, merchant_keys)
    ephemeral = p256_public_key(token.ephemeral_public_key, "paymentData.header.ephemeralPublicKey")
    shared_secret = key.private_key.exchange(ec.ECDH(), ephemeral)
    try:
        plaintext = AESGCM(derive_key(shared_secret, key.merchant_id_hash)).decrypt(GCM_IV, token.data, None)
    except (InvalidTag, ValueError):
        raise DecryptionFailed("payment data does not decrypt with the merchant key (GCM tag mismatch)") from None
    return load_json(plaintext, "decrypted payment data", PaymentDataInvalid)


def _expiration(value: str | None) -> dt.date:
    if value is None or len(value) != 6 or not (value.isascii() and value.isdigit()):
        raise PaymentDataInvalid("applicationExpirationDate must be YYMMDD")
    try:
        return dt.date(2000 + int(value[:2]), int(value[2:4]), int(value[4:]))
    except ValueError:
        raise PaymentDataInvalid("applicationExpirationDate is not a calendar date") from None


def parse_payment_data(payment: dict, *, transaction_id: str, signed_at: dt.datetime) -> WalletAPayment:
    """A :class:`WalletAPayment` from decrypted EC_v1 payment data (step 6), else
    :class:`PaymentDataInvalid` naming the field (never its value)."""
    number = card_number(payment.get("applicationPrimaryAccountNumber"), "applicationPrimaryAccountNumber")
    expiry = _expiration(text(payment, "applicationExpirationDate", "paymentData", PaymentDataInvalid))
    currency = text(payment, "currencyCode", "paymentData", PaymentDataInvalid)
    amount = payment.get("transactionAmount")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
        raise PaymentDataInvalid("transactionAmount must be a non-negative integer")
    kind = text(payment, "paymentDataType", "paymentData", PaymentDataInvalid)
    if kind not in PAYMENT_DATA_TYPES:
        raise PaymentDataInvalid("paymentDataType must be 3DSecure or EMV")
    details = obj(payment.get("paymentData"), "paymentData.paymentData", PaymentDataInvalid)
    authentication = emv_data = None
    if kind == "3DSecure":
        authentication = Authentication(
            threeds_cryptogram=text(details, "onlinePaymentCryptogram", "paymentData.paymentData", PaymentDataInvalid),
            eci_indicator=text(details, "eciIndicator", "paymentData.paymentData", PaymentDataInvalid, optional=True),
        )
    else:
        emv_data = text(details, "emvData", "paymentData.paymentData", PaymentDataInvalid)
    merchant_token = text(payment, "merchantTokenIdentifier", "paymentData", PaymentDataInvalid, optional=True)
    return WalletAPayment(
        type="mpan" if merchant_token else "dpan",
        transaction_id=transaction_id,
        payment_data_type=kind,
        device_manufacturer_identifier=text(payment, "deviceManufacturerIdentifier", "paymentData", PaymentDataInvalid),
        data=CardData(number=number, expiration_month=expiry.month, expiration_year=expiry.year),
        authentication=authentication,
        expires_at=dt.datetime.combine(expiry, dt.time.max, tzinfo=dt.UTC),
        currency_code=currency,
        transaction_amount=amount,
        signed_at=signed_at,
        cardholder_name=text(payment, "cardholderName", "paymentData", PaymentDataInvalid, optional=True),
        emv_data=emv_data,
        merchant_token_identifier=merchant_token,
    )


def decrypt_token(
    payment_data: object,
    *,
    merchant_keys: Sequence[MerchantKey],
    root: x509.Certificate | None = None,
    clock: Clock = DEFAULT_CLOCK,
    signing_time_window: dt.timedelta = DEFAULT_SIGNING_TIME_WINDOW,
) -> WalletAPayment:
    """Verify, then decrypt, an EC_v1 ``paymentData`` object (the whole of the module docstring).

    ``merchant_keys`` the merchant's active keys (chosen by ``header.publicKeyHash``); ``root`` the
    pinned root (default: the shipped Apple Root CA - G3; :func:`load_root_ca` reads the
    ``TESSERA_WALLET_A_ROOT_CA`` replacement); ``clock`` gives "now" for certificate validity and the
    signing time window. Raises a :class:`~domain.wallets.errors.WalletTokenError` subclass on any
    failure; returns only a fully verified and parsed payment.
    """
    token = parse_token(payment_data)
    signed_at = verify_signature(
        token.signature,
        token.signed_content,
        root=root or load_root_ca(),
        now=aware(clock()),
        signing_time_window=signing_time_window,
    )
    payment = decrypt_payment_data(token, merchant_keys)
    return parse_payment_data(payment, transaction_id=token.transaction_id.hex(), signed_at=signed_at)


def decrypt_payment(
    apple_payment_data: object,
    *,
    merchant_keys: Sequence[MerchantKey],
    root: x509.Certificate | None = None,
    clock: Clock = DEFAULT_CLOCK,
    signing_time_window: dt.timedelta = DEFAULT_SIGNING_TIME_WINDOW,
) -> WalletAPayment:
    """:func:`decrypt_token` for the ``apple_payment_data`` member of the tokenize body (spec 001
    section 4): only ``paymentData`` and ``transactionIdentifier`` are used, both required, and the
    identifier must name the same transaction as ``paymentData.header.transactionId`` (hex, any case).

    Raises :class:`MalformedToken` when either is missing or they disagree, and whatever
    :func:`decrypt_token` raises.
    """
    body = obj(apple_payment_data, "apple_payment_data")
    identifier = text(body, "transactionIdentifier", "apple_payment_data")
    payment_data = obj(body.get("paymentData"), "apple_payment_data.paymentData")
    header = obj(payment_data.get("header"), "apple_payment_data.paymentData.header")
    if identifier.lower() != str(header.get("transactionId", "")).lower():
        raise MalformedToken("apple_payment_data.transactionIdentifier does not match paymentData.header.transactionId")
    return decrypt_token(
        payment_data, merchant_keys=merchant_keys, root=root, clock=clock, signing_time_window=signing_time_window
    )
