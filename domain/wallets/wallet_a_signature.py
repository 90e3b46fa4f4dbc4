"""wallet-a (Apple Pay) EC_v1 token signatures: the detached CMS ``SignedData`` and its certificate chain
up to the pinned root (steps 1-4 of :mod:`domain.wallets.wallet_a`'s docstring).

:func:`verify_signature` trusts nothing the token carries before checking it: one signer, the leaf and
intermediate marker extensions, the chain to the pinned Apple Root CA - G3 (never a root inside the
token), validity periods at the clock's time, the ``message-digest`` over the signed content, the
ECDSA-with-SHA-256 signature, and the ``signing-time`` window (replay guard). Certificate signatures are
remembered per (certificate, issuer) pair. Failures raise :class:`~domain.wallets.errors.WalletTokenError`
subclasses.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from dataclasses import dataclass
from functools import lru_cache

from asn1crypto import cms
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from domain.wallets.errors import (
    CertificateInvalid,
    MalformedToken,
    MessageDigestMismatch,
    SignatureInvalid,
    SigningTimeOutOfWindow,
    WalletTokenError,
)
from domain.wallets.fields import aware

#: Marker extension of the leaf (signing) certificate.
LEAF_MARKER_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.29")
#: Marker extension of the intermediate CA (Apple Application Integration CA - G3).
INTERMEDIATE_MARKER_OID = x509.ObjectIdentifier("1.2.840.113635.100.6.2.14")
#: How far the CMS signing time may be from the clock, either way ("a few minutes" in the format).
DEFAULT_SIGNING_TIME_WINDOW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class _Signer:
    """What the CMS structure says, before any of it is trusted."""

    certificates: list[x509.Certificate]
    issuer_der: bytes
    serial_number: int
    digest_algorithm: str
    signature_algorithm: str
    signature: bytes
    signed_attrs_der: bytes
    content_type: str | None
    message_digest: bytes | None
    signing_time: dt.datetime | None


def _read_cms(signature: bytes) -> _Signer:
    """The single signer of a detached CMS ``SignedData``, else :class:`MalformedToken`.

    asn1crypto parses lazily, so every access that can meet bad encoding stays inside the ``try``.
    """
    try:
        info = cms.ContentInfo.load(signature, strict=False)
        if info["content_type"].native != "signed_data":
            raise MalformedToken("paymentData.signature is not CMS SignedData")
        signed = info["content"]
        if signed["encap_content_info"]["content"].native is not None:
            raise MalformedToken("paymentData.signature must be a detached signature")
        signer_infos = signed["signer_infos"]
        if len(signer_infos) != 1:
            raise MalformedToken("paymentData.signature must have exactly one signer")
        signer = signer_infos[0]
        sid = signer["sid"]
        if sid.name != "issuer_and_serial_number":
            raise MalformedToken("paymentData.signature signer must be named by issuer and serial number")
        signed_attrs = signer["signed_attrs"]
        if not len(signed_attrs):
            raise MalformedToken("paymentData.signature has no signed attributes")
        attrs: dict[str, list] = {}
        for attr in signed_attrs:
            attrs.setdefault(attr["type"].native, []).extend(attr["values"])
        for name in ("content_type", "message_digest", "signing_time"):
            if len(attrs.get(name, ())) > 1:
                raise MalformedToken(f"paymentData.signature has more than one {name} attribute")
        certificates = [
            x509.load_der_x509_certificate(choice.chosen.dump())
            for choice in (signed["certificates"] or [])
            if choice.name == "certificate"
        ]
        content_type = attrs.get("content_type", [None])[0]
        message_digest = attrs.get("message_digest", [None])[0]
        signing_time = attrs.get("signing_time", [None])[0]
        signed_at = signing_time.native if signing_time is not None else None
        if signed_at is not None and (not isinstance(signed_at, dt.datetime) or signed_at.tzinfo is None):
            raise MalformedToken("paymentData.signature signing time has no time zone")
        return _Signer(
            certificates=certificates,
            issuer_der=sid.chosen["issuer"].dump(),
            serial_number=sid.chosen["serial_number"].native,
            digest_algorithm=signer["digest_algorithm"]["algorithm"].native,
            signature_algorithm=signer["signature_algorithm"]["algorithm"].native,
            signature=signer["signature"].native,
            # The signature covers the DER of the attributes with the SET OF tag, not the [0] implicit tag.
            signed_attrs_der=signed_attrs.untag().dump(),
            content_type=content_type.native if content_type is not None else None,
            message_digest=message_digest.native if message_digest is not None else None,
            signing_time=signed_at,
        )
    except WalletTokenError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError):
        raise MalformedToken("paymentData.signature is not a valid CMS signature") from None


def _has_extension(certificate: x509.Certificate, oid: x509.ObjectIdentifier) -> bool:
    try:
        certificate.extensions.get_extension_for_oid(oid)
    except x509.ExtensionNotFound:
        return False
    except ValueError:  # an extension cryptography cannot parse
        return False
    return True


def _is_ca(certificate: x509.Certificate) -> bool:
    try:
        return bool(certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except (x509.ExtensionNotFound, ValueError):
        return False


def _check_validity(certificate: x509.Certificate, role: str, now: dt.datetime) -> None:
    if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
        raise CertificateInvalid(
            f"{role} certificate is outside its validity period "
            f"({certificate.not_valid_before_utc.isoformat()} to {certificate.not_valid_after_utc.isoformat()})"
        )


def _issued_by(child: x509.Certificate, issuer: x509.Certificate, what: str) -> None:
    if not _directly_issued(child, issuer):
        raise CertificateInvalid(what)


@lru_cache(maxsize=256)
def _directly_issued(child: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``child`` names ``issuer`` as issuer and carries its valid signature. Certificates hash
    and compare by their DER encoding, so this pure result is remembered: every token of a period
    carries the same intermediate, and its signature by the root (P-384) is the costliest check."""
    try:
        child.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _verify_chain(signer: _Signer, root: x509.Certificate, now: dt.datetime) -> ec.EllipticCurvePublicKey:
    """The leaf certificate's EC public key, once leaf -> intermediate -> pinned root is verified; else
    :class:`CertificateInvalid` (also when a certificate of the token cannot be read: cryptography
    parses names, extensions and keys lazily)."""
    try:
        return _chain_leaf_key(signer, root, now)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise CertificateInvalid("a certificate of the signature cannot be read") from None


def _chain_leaf_key(signer: _Signer, root: x509.Certificate, now: dt.datetime) -> ec.EllipticCurvePublicKey:
    leaf = next(
        (
            cert
            for cert in signer.certificates
            if cert.serial_number == signer.serial_number and cert.issuer.public_bytes() == signer.issuer_der
        ),
        None,
    )
    if leaf is None:
        raise CertificateInvalid("the signer's certificate is not in the signature")
    if not _has_extension(leaf, LEAF_MARKER_OID):
        raise CertificateInvalid(f"leaf certificate lacks the marker extension {LEAF_MARKER_OID.dotted_string}")
    intermediate = next(
        (cert for cert in signer.certificates if cert is not leaf and cert.subject == leaf.issuer), None
    )
    if intermediate is None:
        raise CertificateInvalid("the intermediate certificate that issued the leaf is not in the signature")
    if not _has_extension(intermediate, INTERMEDIATE_MARKER_OID):
        raise CertificateInvalid(
            f"intermediate certificate lacks the marker extension {INTERMEDIATE_MARKER_OID.dotted_string}"
        )
    if not _is_ca(intermediate):
        raise CertificateInvalid("intermediate certificate is not a CA")
    _issued_by(leaf, intermediate, "leaf certificate is not signed by the intermediate certificate")
    _issued_by(intermediate, root, "intermediate certificate is not signed by the pinned root")
    for certificate, role in ((leaf, "leaf"), (intermediate, "intermediate"), (root, "root")):
        _check_validity(certificate, role, now)
    public_key = leaf.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise CertificateInvalid("leaf certificate key is not an EC key")
    return public_key


def verify_signature(
    signature: bytes,
    signed_content: bytes,
    *,
    root: x509.Certificate,
    now: dt.datetime,
    signing_time_window: dt.timedelta = DEFAULT_SIGNING_TIME_WINDOW,
) -> dt.datetime:
    """Verify the detached CMS ``signature`` of an EC_v1 token over ``signed_content``
    (ephemeralPublicKey || data || transactionId || applicationData; steps 1-4 of the module docstring)
    at ``now``; return the signing time.

    Raises :class:`MalformedToken` (not CMS, several signers, no signed attributes),
    :class:`CertificateInvalid`, :class:`MessageDigestMismatch`, :class:`SignatureInvalid` or
    :class:`SigningTimeOutOfWindow`.
    """
    signer = _read_cms(signature)
    public_key = _verify_chain(signer, root, aware(now))
    if signer.digest_algorithm != "sha256" or signer.signature_algorithm not in ("sha256_ecdsa", "ecdsa"):
        raise SignatureInvalid(
            f"signature algorithm {signer.signature_algorithm}/{signer.digest_algorithm} is not ECDSA with SHA-256"
        )
    if signer.content_type != "data":
        raise SignatureInvalid("signed content-type attribute is missing or is not id-data")
    if signer.message_digest is None:
        raise SignatureInvalid("signed message-digest attribute is missing")
    if not hmac.compare_digest(signer.message_digest, hashlib.sha256(signed_content).digest()):
        raise MessageDigestMismatch(
            "message digest does not match ephemeralPublicKey, data, transactionId and applicationData"
        )
    try:
        public_key.verify(signer.signature, signer.signed_attrs_der, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SignatureInvalid("CMS signature does not verify with the leaf certificate") from None
    if signer.signing_time is None:
        raise SigningTimeOutOfWindow("signed signing-time attribute is missing")
    if abs(now - signer.signing_time) > signing_time_window:
        raise SigningTimeOutOfWindow(
            f"signing time {signer.signing_time.isoformat()} is more than "
            f"{int(signing_time_window.total_seconds())} s from now"
        )
    return signer.signing_time
