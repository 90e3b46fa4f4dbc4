"""Test issuers of wallet tokens: a wallet-a certificate authority that signs EC_v1 tokens, and a
wallet-b key hierarchy that seals ECv2 tokens.

The key derivations here are written out from their specifications (NIST SP 800-56A single-step
KDF; RFC 5869 HKDF; the ECv2 length-prefixed signed strings) instead of calling the code under test,
so a token these issuers make checks the implementation against an independent reading.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

from asn1crypto import algos, cms
from asn1crypto import x509 as asn1_x509
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID

LEAF_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.29")
INTERMEDIATE_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.2.14")
MERCHANT_ID_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.32")
ASN1_NULL = b"\x05\x00"

#: The moment generated tokens are signed at; tests fix their clock near it.
SIGNED_AT = dt.datetime(2026, 3, 14, 15, 9, 26, tzinfo=dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer: x509.Certificate | None = None,
    issuer_key: ec.EllipticCurvePrivateKey | None = None,
    ca: bool = False,
    marker: x509.ObjectIdentifier | None = None,
    extra: tuple[x509.UnrecognizedExtension, ...] = (),
    not_before: dt.datetime = SIGNED_AT - dt.timedelta(days=365),
    not_after: dt.datetime = SIGNED_AT + dt.timedelta(days=365),
) -> x509.Certificate:
    """An X.509 certificate for ``key``: self-signed unless ``issuer``/``issuer_key`` are given, a CA
    when ``ca``, carrying the ``marker`` extension (ASN.1 NULL value) and any ``extra`` extensions."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer is not None else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if marker is not None:
        builder = builder.add_extension(x509.UnrecognizedExtension(marker, ASN1_NULL), critical=False)
    for extension in extra:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def spki(key: ec.EllipticCurvePublicKey) -> bytes:
    """DER SubjectPublicKeyInfo of ``key``."""
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# --------------------------------------------------------------------------------------------- wallet-a


@dataclass
class Merchant:
    """A merchant's payment processing certificate and key, for merchant identifier ``identifier``."""

    identifier: str = "merchant.com.tessera.test"
    key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)

    @property
    def id_hash(self) -> bytes:
        return hashlib.sha256(self.identifier.encode()).digest()

    @property
    def certificate(self) -> x509.Certificate:
        value = b"\x0c\x40" + self.id_hash.hex().upper().encode()  # DER UTF8String of 64 hex digits
        return certificate(
            f"Payment Processing:{self.identifier}",
            self.key,
            extra=(x509.UnrecognizedExtension(MERCHANT_ID_OID, value),),
        )

    @property
    def key_hash(self) -> bytes:
        return hashlib.sha256(spki(self.key.public_key())).digest()


def single_step_kdf(shared_secret: bytes, other_info: bytes) -> bytes:
    """NIST SP 800-56A section 5.8.1 with SHA-256, one block: H(counter=1 || Z || OtherInfo)."""
    return hashlib.sha256(struct.pack(">I", 1) + shared_secret + other_info).digest()


@dataclass
class WalletACA:
    """A root, an intermediate with OID 1.2.840.113635.100.6.2.14 and a leaf with
    1.2.840.113635.100.6.29: the shape of the wallet-a signing chain, with keys the tests hold."""

    root_key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)
    intermediate_key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)
    leaf_key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)
    intermediate_marker: x509.ObjectIdentifier | None = INTERMEDIATE_OID
    intermediate_ca: bool = True
    leaf_marker: x509.ObjectIdentifier | None = LEAF_OID
    leaf_not_after: dt.datetime = SIGNED_AT + dt.timedelta(days=365)

    def __post_init__(self) -> None:
        self.root = certificate("Test Root CA", self.root_key, ca=True)
        self.intermediate = certificate(
            "Test Application Integration CA",
            self.intermediate_key,
            issuer=self.root,
            issuer_key=self.root_key,
            ca=self.intermediate_ca,
            marker=self.intermediate_marker,
        )
        self.leaf = certificate(
            "test-smp-broker-sign",
            self.leaf_key,
            issuer=self.intermediate,
            issuer_key=self.intermediate_key,
            marker=self.leaf_marker,
            not_after=self.leaf_not_after,
        )

    def sign(
        self,
        content: bytes,
        *,
        signing_time: dt.datetime | None = SIGNED_AT,
        signer_key: ec.EllipticCurvePrivateKey | None = None,
        certificates: list[x509.Certificate] | None = None,
        digest: bytes | None = None,
        digest_algorithm: str = "sha256",
    ) -> bytes:
        """A detached CMS SignedData over ``content``, signed by the leaf (or ``signer_key``), carrying
        the leaf and intermediate (or ``certificates``); ``digest`` overrides the message-digest
        attribute and ``signing_time`` ``None`` leaves that attribute out."""
        attrs = [
            cms.CMSAttribute({"type": "content_type", "values": ["data"]}),
            cms.CMSAttribute({"type": "message_digest", "values": [digest or hashlib.sha256(content).digest()]}),
        ]
        if signing_time is not None:
            time = cms.Time({"utc_time": signing_time})
            attrs.insert(1, cms.CMSAttribute({"type": "signing_time", "values": [time]}))
        signed_attrs = cms.CMSAttributes(attrs)
        # RFC 5652 section 5.4: the signature covers the DER of the attributes as a SET OF.
        signature = (signer_key or self.leaf_key).sign(signed_attrs.dump(), ec.ECDSA(hashes.SHA256()))
        leaf = asn1_x509.Certificate.load(self.leaf.public_bytes(serialization.Encoding.DER))
        signer = cms.SignerInfo(
            {
                "version": "v1",
                "sid": cms.SignerIdentifier(
                    {
                        "issuer_and_serial_number": cms.IssuerAndSerialNumber(
                            {"issuer": leaf.issuer, "serial_number": leaf.serial_number}
                        )
                    }
                ),
                "digest_algorithm": algos.DigestAlgorithm({"algorithm": digest_algorithm}),
                "signed_attrs": signed_attrs,
                "signature_algorithm": algos.SignedDigestAlgorithm({"algorithm": "sha256_ecdsa"}),
                "signature": signature,
            }
        )
        chain = certificates if certificates is not None else [self.leaf, self.intermediate]
        signed_data = cms.SignedData(
            {
                "version": "v1",
                "digest_algorithms": [algos.DigestAlgorithm({"algorithm": digest_algorithm})],
                "encap_content_info": {"content_type": "data"},
                "certificates": [asn1_x509.Certificate.load(c.public_bytes(serialization.Encoding.DER)) for c in chain],
                "signer_infos": [signer],
            }
        )
        return cms.ContentInfo({"content_type": "signed_data", "content": signed_data}).dump()

    def token(
        self,
        payment: dict | bytes,
        merchant: Merchant,
        *,
        key_hash_of: Merchant | None = None,
        application_data: bytes = b"",
        transaction_id: bytes = bytes(range(32)),
        **sign_options,
    ) -> dict:
        """An EC_v1 ``paymentData`` object sealing ``payment`` (a dict, or raw plaintext bytes) for
        ``merchant`` and signed by this chain; ``key_hash_of`` names another merchant's key in the
        header; ``sign_options`` go to :meth:`sign`."""
        ephemeral = new_key()
        shared_secret = ephemeral.exchange(ec.ECDH(), merchant.key.public_key())
        aes_key = single_step_kdf(shared_secret, b"\x0did-aes256-GCM" + b"Apple" + merchant.id_hash)
        plaintext = payment if isinstance(payment, bytes) else json.dumps(payment).encode()
        data = AESGCM(aes_key).encrypt(bytes(16), plaintext, None)
        ephemeral_der = spki(ephemeral.public_key())
        header = {
            "ephemeralPublicKey": b64(ephemeral_der),
            "publicKeyHash": b64((key_hash_of or merchant).key_hash),
            "transactionId": transaction_id.hex(),
        }
        if application_data:
            header["applicationData"] = application_data.hex()
        content = ephemeral_der + data + transaction_id + application_data
        return {
            "version": "EC_v1",
            "data": b64(data),
            "signature": b64(self.sign(content, **sign_options)),
            "header": header,
        }


def apple_payment(**overrides) -> dict:
    """Decrypted EC_v1 payment data for a 3DSecure DPAN (sandbox-style values)."""
    payment = {
        "applicationPrimaryAccountNumber": "4895370012003478",
        "applicationExpirationDate": "291231",
        "currencyCode": "978",
        "transactionAmount": 1250,
        "deviceManufacturerIdentifier": "040010030273",
        "paymentDataType": "3DSecure",
        "paymentData": {"onlinePaymentCryptogram": "AgAAAAAABk4DWZ4C28yUQAAAAAA=", "eciIndicator": "7"},
    }
    payment.update(overrides)
    return payment


# --------------------------------------------------------------------------------------------- wallet-b


def hkdf_sha256(ikm: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF with SHA-256 and a zero salt."""
    prk = hmac.digest(bytes(32), ikm, "sha256")
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        out += block
        counter += 1
    return out[:length]


def ecv2_signed_string(*parts: str) -> bytes:
    return b"".join(struct.pack("<I", len(p.encode())) + p.encode() for p in parts)


def millis(moment: dt.datetime) -> str:
    return str(int(moment.timestamp() * 1000))


@dataclass
class WalletBIssuer:
    """A root signing key and an intermediate signing key (expiring ``intermediate_expires_at``) that
    seal ECv2 tokens."""

    root_key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)
    intermediate_key: ec.EllipticCurvePrivateKey = field(default_factory=new_key)
    intermediate_expires_at: dt.datetime = SIGNED_AT + dt.timedelta(days=7)
    root_expires_at: dt.datetime = SIGNED_AT + dt.timedelta(days=3650)

    def root_entry(self) -> dict:
        """This root as an entry of the provider's published key list."""
        return {
            "keyValue": b64(spki(self.root_key.public_key())),
            "protocolVersion": "ECv2",
            "keyExpiration": millis(self.root_expires_at),
        }

    def token(
        self,
        message: dict | bytes,
        merchant_public_key: ec.EllipticCurvePublicKey,
        recipient_id: str,
        *,
        intermediate_signer: ec.EllipticCurvePrivateKey | None = None,
    ) -> dict:
        """An ECv2 token sealing ``message`` (a dict, or raw plaintext bytes) for ``merchant_public_key``
        and ``recipient_id``; ``intermediate_signer`` signs the intermediate key instead of the root."""
        signed_key = json.dumps(
            {
                "keyValue": b64(spki(self.intermediate_key.public_key())),
                "keyExpiration": millis(self.intermediate_expires_at),
            }
        )
        key_signature = (intermediate_signer or self.root_key).sign(
            ecv2_signed_string("Google", "ECv2", signed_key), ec.ECDSA(hashes.SHA256())
        )
        ephemeral = new_key()
        point = ephemeral.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        shared_secret = ephemeral.exchange(ec.ECDH(), merchant_public_key)
        material = hkdf_sha256(point + shared_secret, b"Google", 64)
        plaintext = message if isinstance(message, bytes) else json.dumps(message).encode()
        encryptor = Cipher(algorithms.AES(material[:32]), modes.CTR(bytes(16))).encryptor()
        ciphertext = encryptor.update(plaintext) + encryptor.finalize()
        signed_message = json.dumps(
            {
                "encryptedMessage": b64(ciphertext),
                "ephemeralPublicKey": b64(point),
                "tag": b64(hmac.digest(material[32:], ciphertext, "sha256")),
            }
        )
        return self.sign_message(signed_message, recipient_id) | {
            "intermediateSigningKey": {"signedKey": signed_key, "signatures": [b64(key_signature)]},
        }

    def sign_message(self, signed_message: str, recipient_id: str) -> dict:
        """``signature``, ``protocolVersion`` and ``signedMessage`` for ``signed_message`` and ``recipient_id``."""
        signature = self.intermediate_key.sign(
            ecv2_signed_string("Google", recipient_id, "ECv2", signed_message), ec.ECDSA(hashes.SHA256())
        )
        return {"protocolVersion": "ECv2", "signature": b64(signature), "signedMessage": signed_message}


def google_message(auth_method: str = "CRYPTOGRAM_3DS", *, expires_at: dt.datetime | None = None, **details) -> dict:
    """A decrypted ECv2 message for a card, expiring an hour after :data:`SIGNED_AT` by default."""
    method_details = {
        "pan": "4895370012003478",
        "expirationMonth": 12,
        "expirationYear": 2029,
        "authMethod": auth_method,
    }
    if auth_method == "CRYPTOGRAM_3DS":
        method_details |= {"cryptogram": "AAAAAA8JjEB5hYZCE3ZkAAAAAAA=", "eciIndicator": "05"}
    method_details |= details
    return {
        "gatewayMerchantId": "tessera-test",
        "messageExpiration": millis(expires_at or SIGNED_AT + dt.timedelta(hours=1)),
        "messageId": "AH2Ejtc-test-message",
        "paymentMethod": "CARD",
        "paymentMethodDetails": method_details,
    }
