"""Why a wallet payment token is refused (spec 001 sections 2 and 4: every failure is a 4xx).

Each refusal is a :class:`WalletTokenError`, a :class:`infra.errors.Problem` the API answers as
``application/problem+json`` with a stable machine ``code`` member beside a ``detail`` saying what
failed. Details name the check that failed and never carry a PAN, a cryptogram, key material or
decrypted data. Nothing is returned, stored or partially decrypted when one is raised.

Status: ``400`` when the token is not even well formed (:class:`MalformedToken`), ``422`` when a
well-formed token fails verification or decryption.
"""

from __future__ import annotations

from typing import ClassVar

from infra.errors import Problem


class WalletTokenError(Problem):
    """Base of every wallet token refusal; ``code`` is the stable machine code (``extra['code']``)."""

    code: ClassVar[str] = "wallet_token_invalid"
    status_code: ClassVar[int] = 422
    title_text: ClassVar[str] = "Wallet token refused"

    def __init__(self, detail: str):
        super().__init__(self.status_code, detail, title=self.title_text, extra={"code": self.code})


class MalformedToken(WalletTokenError):
    """The token is not the documented JSON shape (missing field, wrong type, bad base64 or hex, bad ASN.1)."""

    code = "malformed_token"
    status_code = 400
    title_text = "Malformed wallet token"


class UnsupportedVersion(WalletTokenError):
    """The token's ``version`` / ``protocolVersion`` is not one this service decrypts."""

    code = "unsupported_version"


class CertificateInvalid(WalletTokenError):
    """A certificate of the wallet-a signature is missing, lacks its marker OID, is outside its validity
    period, is not a CA where one is needed, or the chain does not lead to the pinned root."""

    code = "certificate_invalid"


class SignatureInvalid(WalletTokenError):
    """The wallet-a CMS signature does not verify with the leaf certificate's key."""

    code = "signature_invalid"


class MessageDigestMismatch(WalletTokenError):
    """The wallet-a signed ``message-digest`` attribute is not SHA-256 of the signed token fields
    (ephemeral key, data, transaction id or application data altered)."""

    code = "message_digest_mismatch"


class SigningTimeOutOfWindow(WalletTokenError):
    """The wallet-a CMS signing time is farther from the clock than the allowed window (replay guard)."""

    code = "signing_time_out_of_window"


class MerchantCertificateInvalid(WalletTokenError):
    """The merchant's payment processing certificate or key cannot be used: not PEM, not P-256, no
    merchant id extension, or the key does not belong to the certificate."""

    code = "merchant_certificate_invalid"


class MerchantKeyNotFound(WalletTokenError):
    """No configured merchant key matches the token's ``publicKeyHash``."""

    code = "merchant_key_not_found"


class DecryptionFailed(WalletTokenError):
    """Authenticated decryption failed: AES-GCM tag (wallet-a) or HMAC tag (wallet-b) does not verify,
    meaning the ciphertext was altered or sealed for another merchant key."""

    code = "decryption_failed"


class PaymentDataInvalid(WalletTokenError):
    """The decrypted payment data is not the documented JSON shape."""

    code = "payment_data_invalid"


class IntermediateKeySignatureInvalid(WalletTokenError):
    """wallet-b: no signature on the intermediate signing key verifies with an unexpired root key."""

    code = "intermediate_key_signature_invalid"


class IntermediateKeyExpired(WalletTokenError):
    """wallet-b: the intermediate signing key's ``keyExpiration`` has passed."""

    code = "intermediate_key_expired"


class MessageSignatureInvalid(WalletTokenError):
    """wallet-b: the message signature does not verify with the intermediate key for this recipient id."""

    code = "message_signature_invalid"


class MessageExpired(WalletTokenError):
    """wallet-b: the decrypted ``messageExpiration`` has passed."""

    code = "message_expired"
