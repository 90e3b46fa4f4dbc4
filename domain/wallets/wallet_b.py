"""wallet-b (Google Pay) payment tokens, protocol ECv2: verification then decryption (spec 001 section 4).

A token is the JSON object the wallet hands the merchant::

    {"protocolVersion": "ECv2", "signature": <base64 DER ECDSA>,
     "intermediateSigningKey": {"signedKey": <JSON text {keyValue, keyExpiration}>,
                                "signatures": [<base64 DER ECDSA>, ...]},
     "signedMessage": <JSON text {encryptedMessage, ephemeralPublicKey, tag}>}

:func:`decrypt_token` follows the ECv2 rules in this order, refusing at the first failure:

1. one of ``intermediateSigningKey.signatures`` verifies (ECDSA P-256, SHA-256) with an unexpired
   ``ECv2`` root signing key over the signed string ``"Google" || "ECv2" || signedKey``;
2. the intermediate key's ``keyExpiration`` (milliseconds since the epoch) is after the clock;
3. ``signature`` verifies with the intermediate key over ``"Google" || recipient id || "ECv2" ||
   signedMessage``, where every part of a signed string is preceded by its length in UTF-8 bytes as
   a 4-byte little-endian integer (a token sealed for another recipient fails here);
4. ECDH of a merchant private key with ``ephemeralPublicKey`` (uncompressed point); HKDF-SHA-256
   over ``ephemeralPublicKey || shared secret`` with a zero salt and info ``"Google"`` gives 64 bytes:
   the first 32 are the AES-256 key, the last 32 the HMAC-SHA-256 key; the ``tag`` must equal
   HMAC-SHA-256 of ``encryptedMessage`` (checked before anything is decrypted); AES-256-CTR with a
   zero IV decrypts it;
5. the plaintext's ``messageExpiration`` (milliseconds) is after the clock;
6. ``paymentMethodDetails`` is parsed: ``CRYPTOGRAM_3DS`` (network token with cryptogram and ECI) or
   ``PAN_ONLY`` (card number only).

Any failure raises a :class:`~domain.wallets.errors.WalletTokenError` subclass; nothing partial is
returned.
"""

from __future__ import annotations

import base64
import datetime as dt
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import load_der_private_key

from domain.wallets.errors import (
    DecryptionFailed,
    IntermediateKeyExpired,
    IntermediateKeySignatureInvalid,
    MalformedToken,
    MessageExpired,
    MessageSignatureInvalid,
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
    load_json,
    obj,
    p256_public_key,
    text,
)

PROTOCOL_VERSION = "ECv2"
SENDER_ID = "Google"
HKDF_INFO = b"Google"
CTR_IV = bytes(16)
AUTH_METHODS = ("CRYPTOGRAM_3DS", "PAN_ONLY")
#: Signatures tried on the intermediate key at most (a token listing more is malformed).
MAX_SIGNATURES = 8


def signed_string(*parts: str) -> bytes:
    """The ECv2 signed string: each part's UTF-8 bytes preceded by their length as 4 little-endian bytes."""
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def _from_millis(value: object, path: str, error: type = MalformedToken) -> dt.datetime:
    """A timestamp given as a decimal string of milliseconds since the epoch (UTC)."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 15:
        raise error(f"{path} must be a string of milliseconds since the epoch")
    try:
        return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=int(value))
    except OverflowError:
        raise error(f"{path} is out of range") from None


@dataclass(frozen=True)
class RootSigningKey:
    """A root signing key of the wallet provider (its published key list): P-256 ``key``,
    ``expires_at`` (``None``: no expiration given) and ``protocol_version`` (only ``ECv2`` keys are
    used)."""

    key: ec.EllipticCurvePublicKey
    expires_at: dt.datetime | None
    protocol_version: str = PROTOCOL_VERSION

    @classmethod
    def from_json(cls, entry: object) -> RootSigningKey:
        """One entry of the published key list, ``{"keyValue": <base64 DER SPKI>, "protocolVersion":
        "ECv2", "keyExpiration": <ms string, optional>}``; raises :class:`MalformedToken` (a
        misconfigured root list is refused as loudly as a bad token)."""
        entry = obj(entry, "rootSigningKey")
        expiration = entry.get("keyExpiration")
        return cls(
            key=p256_public_key(
                b64(text(entry, "keyValue", "rootSigningKey"), "rootSigningKey.keyValue"), "rootSigningKey.keyValue"
            ),
            expires_at=None if expiration is None else _from_millis(expiration, "rootSigningKey.keyExpiration"),
            protocol_version=text(entry, "protocolVersion", "rootSigningKey"),
        )

    @classmethod
    def from_key_list(cls, document: object) -> list[RootSigningKey]:
        """Every entry of a published key list ``{"keys": [...]}``."""
        keys = obj(document, "rootSigningKeys").get("keys")
        if not isinstance(keys, list):
            raise MalformedToken("rootSigningKeys.keys must be an array")
        return [cls.from_json(entry) for entry in keys]


@dataclass(frozen=True)
class WalletBPayment:
    """A verified, decrypted ECv2 token.

    ``auth_method`` ``CRYPTOGRAM_3DS`` (``data`` is a network token, ``authentication`` carries its
    cryptogram and ECI) or ``PAN_ONLY`` (``data`` is the card number, no authentication);
    ``message_id`` the provider's message id; ``message_expires_at`` when the message expires;
    ``gateway_merchant_id`` when the token carries one. Card number and cryptogram stay out of
    ``repr``.
    """

    auth_method: str
    message_id: str
    message_expires_at: dt.datetime
    data: CardData
    authentication: Authentication | None
    gateway_merchant_id: str | None = None
    payment_method: str = field(default="CARD")

    @property
    def resource_kind(self) -> str:
        """``google_pay`` for ``CRYPTOGRAM_3DS`` and ``token_intent`` for ``PAN_ONLY`` (spec 001 section 4:
        the member name the create answer wraps the resource in)."""
        return "google_pay" if self.auth_method == "CRYPTOGRAM_3DS" else "token_intent"

    def resource_fields(self) -> dict:
        """The resource members this token fills: ``auth_method``, ``message_id``, ``data`` and
        ``authentication`` (``None`` for ``PAN_ONLY``)."""
        return {
            "auth_method": self.auth_method,
            "message_id": self.message_id,
            "data": self.data.as_dict(),
            "authentication": self.authentication.as_dict() if self.authentication else None,
        }


def _verify_ecdsa(key: ec.EllipticCurvePublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def verify_intermediate_key(
    token: dict, root_keys: Sequence[RootSigningKey], now: dt.datetime
) -> ec.EllipticCurvePublicKey:
    """The intermediate signing key, once one of its signatures verifies with an unexpired ECv2 root
    key (step 1) and it has not expired (step 2). Raises :class:`MalformedToken`,
    :class:`IntermediateKeySignatureInvalid` or :class:`IntermediateKeyExpired`."""
    intermediate = obj(token.get("intermediateSigningKey"), "intermediateSigningKey")
    signed_key = text(intermediate, "signedKey", "intermediateSigningKey")
    signatures = intermediate.get("signatures")
    if not isinstance(signatures, list) or not signatures or len(signatures) > MAX_SIGNATURES:
        raise MalformedToken(f"intermediateSigningKey.signatures must be an array of 1 to {MAX_SIGNATURES} strings")
    decoded = []
    for index, signature in enumerate(signatures):
        if not isinstance(signature, str):
            raise MalformedToken(f"intermediateSigningKey.signatures[{index}] must be a string")
        decoded.append(b64(signature, f"intermediateSigningKey.signatures[{index}]"))
    usable = [
        root.key
        for root in root_keys
        if root.protocol_version == PROTOCOL_VERSION and (root.expires_at is None or root.expires_at > now)
    ]
    message = signed_string(SENDER_ID, PROTOCOL_VERSION, signed_key)
    if not any(_verify_ecdsa(key, signature, message) for key in usable for signature in decoded):
        raise IntermediateKeySignatureInvalid(
            "no intermediate signing key signature verifies with an unexpired ECv2 root signing key"
        )
    key_json = load_json(signed_key, "intermediateSigningKey.signedKey")
    expires_at = _from_millis(key_json.get("keyExpiration"), "intermediateSigningKey.signedKey.keyExpiration")
    if expires_at <= now:
        raise IntermediateKeyExpired(f"intermediate signing key expired at {expires_at.isoformat()}")
    value = text(key_json, "keyValue", "intermediateSigningKey.signedKey")
    return p256_public_key(
        b64(value, "intermediateSigningKey.signedKey.keyValue"), "intermediateSigningKey.signedKey.keyValue"
    )


def derive_keys(shared_secret: bytes, ephemeral_public_key: bytes) -> tuple[bytes, bytes]:
    """``(aes_key, mac_key)``, 32 bytes each: HKDF-SHA-256 (zero salt, info ``"Google"``, 64 bytes) over
    ``ephemeral public key || shared secret``, split first half / second half."""
    material = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=HKDF_INFO).derive(
        ephemeral_public_key + shared_secret
    )
    return material[:32], material[32:]


def decrypt_message(signed_message: dict, merchant_keys: Sequence[ec.EllipticCurvePrivateKey]) -> bytes:
    """The plaintext of ``signedMessage`` (step 4), trying each merchant key (rotation) until the HMAC
    tag verifies. Raises :class:`MalformedToken` or :class:`DecryptionFailed`."""
    ciphertext = b64(text(signed_message, "encryptedMessage", "signedMessage"), "signedMessage.encryptedMessage")
    ephemeral_raw = b64(text(signed_message, "ephemeralPublicKey", "signedMessage"), "signedMessage.ephemeralPublicKey")
    tag = b64(text(signed_message, "tag", "signedMessage"), "signedMessage.tag")
    if ephemeral_raw[:1] != b"\x04":
        raise MalformedToken("signedMessage.ephemeralPublicKey must be an uncompressed P-256 point")
    ephemeral = p256_public_key(ephemeral_raw, "signedMessage.ephemeralPublicKey")
    for private_key in merchant_keys:
        aes_key, mac_key = derive_keys(private_key.exchange(ec.ECDH(), ephemeral), ephemeral_raw)
        if hmac.compare_digest(hmac.digest(mac_key, ciphertext, "sha256"), tag):
            decryptor = Cipher(algorithms.AES(aes_key), modes.CTR(CTR_IV)).decryptor()
            return decryptor.update(ciphertext) + decryptor.finalize()
    raise DecryptionFailed("signedMessage tag does not verify with any merchant key (HMAC mismatch)")


def _month(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 12:
        raise PaymentDataInvalid("paymentMethodDetails.expirationMonth must be an integer from 1 to 12")
    return value


def _year(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1000 <= value <= 9999:
        raise PaymentDataInvalid("paymentMethodDetails.expirationYear must be a four-digit integer")
    return value


def parse_payment(plaintext: bytes, now: dt.datetime) -> WalletBPayment:
    """A :class:`WalletBPayment` from the decrypted message (steps 5 and 6). Raises
    :class:`PaymentDataInvalid` (naming the field, never its value) or :class:`MessageExpired`."""
    message = load_json(plaintext, "decrypted message", PaymentDataInvalid)
    expires_at = _from_millis(message.get("messageExpiration"), "messageExpiration", PaymentDataInvalid)
    if expires_at <= now:
        raise MessageExpired(f"message expired at {expires_at.isoformat()}")
    method = text(message, "paymentMethod", "message", PaymentDataInvalid)
    if method != "CARD":
        raise PaymentDataInvalid("paymentMethod must be CARD")
    details = obj(message.get("paymentMethodDetails"), "paymentMethodDetails", PaymentDataInvalid)
    auth_method = text(details, "authMethod", "paymentMethodDetails", PaymentDataInvalid)
    if auth_method not in AUTH_METHODS:
        raise PaymentDataInvalid("paymentMethodDetails.authMethod must be CRYPTOGRAM_3DS or PAN_ONLY")
    authentication = None
    if auth_method == "CRYPTOGRAM_3DS":
        authentication = Authentication(
            threeds_cryptogram=text(details, "cryptogram", "paymentMethodDetails", PaymentDataInvalid),
            eci_indicator=text(details, "eciIndicator", "paymentMethodDetails", PaymentDataInvalid, optional=True),
        )
    return WalletBPayment(
        auth_method=auth_method,
        message_id=text(message, "messageId", "message", PaymentDataInvalid),
        message_expires_at=expires_at,
        data=CardData(
            number=card_number(details.get("pan"), "paymentMethodDetails.pan"),
            expiration_month=_month(details.get("expirationMonth")),
            expiration_year=_year(details.get("expirationYear")),
        ),
        authentication=authentication,
        gateway_merchant_id=text(message, "gatewayMerchantId", "message", PaymentDataInvalid, optional=True),
        payment_method=method,
    )


def decrypt_token(
    token: object,
    *,
    recipient_id: str,
    merchant_keys: Sequence[ec.EllipticCurvePrivateKey],
    root_keys: Sequence[RootSigningKey],
    clock: Clock = DEFAULT_CLOCK,
) -> WalletBPayment:
    """Verify, then decrypt, an ECv2 token (steps 1-6 of the module docstring).

    ``token`` the parsed JSON object (or its JSON text); ``recipient_id`` who it was sealed for
    (``merchant:<id>``); ``merchant_keys`` the merchant's P-256 private keys (rotation: each is tried);
    ``root_keys`` the provider's root signing keys; ``clock`` gives "now" for every expiry. Raises a
    :class:`~domain.wallets.errors.WalletTokenError` subclass on any failure.
    """
    if isinstance(token, str | bytes):
        token = load_json(token, "token")
    token = obj(token, "token")
    version = text(token, "protocolVersion", "token")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocolVersion {version[:16]!r} is not supported; only {PROTOCOL_VERSION} is")
    now = aware(clock())
    intermediate_key = verify_intermediate_key(token, root_keys, now)
    signature = b64(text(token, "signature", "token"), "token.signature")
    signed_message = text(token, "signedMessage", "token")
    message = signed_string(SENDER_ID, recipient_id, PROTOCOL_VERSION, signed_message)
    if not _verify_ecdsa(intermediate_key, signature, message):
        raise MessageSignatureInvalid(f"message signature does not verify for recipient id {recipient_id!r}")
    plaintext = decrypt_message(load_json(signed_message, "signedMessage"), merchant_keys)
    return parse_payment(plaintext, now)


def private_key_from_b64_pkcs8(value: str) -> ec.EllipticCurvePrivateKey:
    """A merchant P-256 private key from base64 PKCS#8 DER (the form the provider's tools print);
    raises :class:`ValueError` when it is not one."""
    key = load_der_private_key(base64.b64decode(value, validate=True), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError("not a P-256 private key")
    return key
