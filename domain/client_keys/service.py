"""Client encryption keys and the decryption of client-encrypted payloads (core document sections 2 and 4:
Client encryption keys; section 4 Proxy rule 8).

A key is an X25519 key pair for JWE ``ECDH-ES`` (direct key agreement) with ``A256GCM`` content
encryption. ``POST /keys`` returns the public key once, as a SubjectPublicKeyInfo PEM and as a JWK;
the private key is sealed under the tenant's data key (``storage.crypto``) and never leaves the
platform. A key lives until ``expires_at`` (default ``TESSERA_CLIENT_KEY_DEFAULT_DAYS``, 182 days; at
most one year after creation); after that, and at once when it is deleted, its private key material is
destroyed (``client_keys.destroy_client_keys`` sweeps expired ones), so payloads encrypted with it
can no longer be read.

Clients encrypt a token request payload (a JSON object with ``data`` and optionally ``metadata``,
``containers`` ...) into a JWE in compact serialization whose protected header carries
``"alg": "ECDH-ES"``, ``"enc": "A256GCM"`` and ``"kid": <key_id>``. :func:`decrypt_encrypted_header`
opens the ``<prefix>-ENCRYPTED`` proxy header value in its single form ``{type, encrypted}`` or its
multiple form ``{name: {type, encrypted}, ...}`` (base64 of the JSON). Refused, each with a clear
400 problem: a malformed value, a JWE over :data:`MAX_JWE_BYTES`, any ``alg``/``enc`` outside
:data:`ALLOWED_ALGORITHMS`, compression (``zip``), an unknown ``kid`` (another tenant's keys are
unknown), an expired or deleted key, a ciphertext that does not authenticate, a plaintext that is not
a JSON object with ``data``.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import uuid
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from joserfc import jwe
from joserfc.errors import JoseError
from joserfc.jwk import OKPKey
from sqlmodel import Session, col, select

from domain.client_keys.errors import EncryptedPayloadError
from domain.client_keys.views import key_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra.errors import Problem, validation_problem
from infra.lookup import get_owned
from storage.crypto import DecryptionError, get_keyring
from storage.models_client_keys import ClientEncryptionKey
from storage.types import utcnow

KEY = "client_encryption_key"
PURPOSE = "client-encryption-key"
ALG, ENC = "ECDH-ES", "A256GCM"
#: The only JWE algorithms accepted: key agreement ECDH-ES, content encryption A256GCM, no ``zip``.
ALLOWED_ALGORITHMS = (ALG, ENC)
#: The JWE registry used to decrypt: an explicit allow-list, strict header checks, one recipient.
REGISTRY = jwe.JWERegistry(algorithms=list(ALLOWED_ALGORITHMS), strict_check_header=True, max_recipients=1)
#: Largest JWE (compact serialization, characters) accepted.
MAX_JWE_BYTES = 64 * 1024
#: Largest ``<prefix>-ENCRYPTED`` header value (base64 characters) and most entries of the multiple form.
MAX_HEADER_BYTES = 256 * 1024
MAX_ENTRIES = 20
PAYLOAD_TYPES = ("card", "bank", "token")


def _add_years(moment: dt.datetime, years: int) -> dt.datetime:
    try:
        return moment.replace(year=moment.year + years)
    except ValueError:  # 29 February
        return moment.replace(year=moment.year + years, day=28)


def create_key(
    session: Session,
    caller: Caller,
    *,
    expires_at: dt.datetime | None,
    default_days: int,
    now: dt.datetime | None = None,
) -> dict:
    """``POST /keys``: a new X25519 key pair; returns the key with ``public_key_pem`` and ``public_key_jwk``.

    ``expires_at`` defaults to ``default_days`` after now; it must be in the future and at most one
    year after now (400 naming ``expires_at`` otherwise).
    """
    now = now or utcnow()
    if expires_at is None:
        expires_at = now + dt.timedelta(days=default_days)
    elif expires_at <= now:
        raise validation_problem({"expires_at": ["Must be in the future."]})
    elif expires_at > _add_years(now, 1):
        raise validation_problem({"expires_at": ["Must be at most 1 year after the key's creation."]})
    private = X25519PrivateKey.generate()
    key = ClientEncryptionKey(
        tenant_id=caller.tenant_id, expires_at=expires_at, created_by=caller.application_id, created_at=now
    )
    raw = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    key.private_key_ct = get_keyring().encrypt(session, caller.tenant_id, PURPOSE, str(key.id), raw)
    session.add(key)
    audit.record(session, caller, entity_type=KEY, entity_id=key.id, operation="create")
    public = private.public_key()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    x = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    jwk = {
        "kty": "OKP",
        "crv": "X25519",
        "x": base64.urlsafe_b64encode(x).rstrip(b"=").decode(),
        "kid": str(key.id),
        "use": "enc",
        "alg": ALG,
    }
    return {**key_view(key), "public_key_pem": pem, "public_key_jwk": jwk}


def get_key(session: Session, caller: Caller, key_id: uuid.UUID) -> ClientEncryptionKey:
    """The tenant's key (not deleted), else 404."""
    return get_owned(
        session,
        ClientEncryptionKey,
        key_id,
        caller.tenant_id,
        what="client encryption key",
        where=lambda key: key.deleted_at is None,
    )


def read_key(session: Session, caller: Caller, key_id: uuid.UUID) -> dict:
    """``GET /keys/{id}``: the key without its public key."""
    key = get_key(session, caller, key_id)
    audit.record(session, caller, entity_type=KEY, entity_id=key.id, operation="read")
    return key_view(key)


def list_keys(session: Session, caller: Caller) -> list[dict]:
    """``GET /keys``: every key of the tenant that was not deleted (expired ones too), oldest first."""
    rows = session.exec(
        select(ClientEncryptionKey)
        .where(col(ClientEncryptionKey.tenant_id) == caller.tenant_id, col(ClientEncryptionKey.deleted_at).is_(None))
        .order_by(col(ClientEncryptionKey.created_at), col(ClientEncryptionKey.id))
    ).all()
    return [key_view(key) for key in rows]


def delete_key(session: Session, caller: Caller, key_id: uuid.UUID) -> None:
    """``DELETE /keys/{id}``: the key disappears and its private key material is destroyed at once."""
    key = get_key(session, caller, key_id)
    now = utcnow()
    key.deleted_at = now
    key.private_key_ct = None
    key.destroyed_at = now
    session.add(key)
    audit.record(session, caller, entity_type=KEY, entity_id=key.id, operation="delete")


def destroy_expired_keys(session: Session, *, now: dt.datetime | None = None, batch: int = 500) -> int:
    """Destroy the private key material of up to ``batch`` expired keys (``SKIP LOCKED``); returns how many."""
    now = now or utcnow()
    rows = session.exec(
        select(ClientEncryptionKey)
        .where(col(ClientEncryptionKey.expires_at) <= now, col(ClientEncryptionKey.private_key_ct).is_not(None))
        .order_by(col(ClientEncryptionKey.expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for key in rows:
        key.private_key_ct = None
        key.destroyed_at = now
        session.add(key)
    return len(rows)


# ---- decryption (the outbound proxy) --------------------------------------------------------------


@dataclass(frozen=True)
class DecryptedPayloads:
    """What a ``<prefix>-ENCRYPTED`` header held, decrypted.

    ``form`` is ``single`` or ``multiple``. ``value`` is the expression context: for the single form
    the payload itself (``{{ encrypted | json: "$.data.number" }}``), for the multiple form a map of
    names to payloads (``{{ encrypted | json: "$.<name>.data.number" }}``). Every payload is the
    decrypted token request object with ``type`` set from the envelope.
    """

    form: str
    value: dict[str, Any]


def _b64_json(value: str) -> Any:
    """Base64 (standard or URL-safe alphabet, padding optional) of JSON, decoded."""
    compact = "".join(value.split()).translate(str.maketrans("-_", "+/"))
    try:
        return json.loads(base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise EncryptedPayloadError("The value is not base64 of a JSON object.", field="header") from None


def decrypt_encrypted_header(
    session: Session, tenant_id: uuid.UUID, value: str, *, now: dt.datetime | None = None
) -> DecryptedPayloads:
    """Open a ``<prefix>-ENCRYPTED`` header value (core document section 4, Proxy rule 8).

    Single form: base64 of ``{"type": "card"|"bank"|"token", "encrypted": "<JWE>"}``; multiple form:
    base64 of ``{"<name>": {"type", "encrypted"}, ...}`` (at most :data:`MAX_ENTRIES`). Raises
    :class:`EncryptedPayloadError` (400) for anything refused; see the module docstring.
    """
    now = now or utcnow()
    if len(value) > MAX_HEADER_BYTES:
        raise EncryptedPayloadError(
            f"The value is longer than {MAX_HEADER_BYTES} characters.",
            field="header",
            code="encrypted_payload_too_large",
        )
    envelope = _b64_json(value)
    if not isinstance(envelope, dict) or not envelope:
        raise EncryptedPayloadError("The value must be a JSON object.", field="header")
    if isinstance(envelope.get("encrypted"), str):
        return DecryptedPayloads("single", _open_entry(session, tenant_id, envelope, "", now))
    if len(envelope) > MAX_ENTRIES:
        raise EncryptedPayloadError(f"At most {MAX_ENTRIES} encrypted values per request.", field="header")
    opened = {}
    for name, entry in envelope.items():
        opened[name] = _open_entry(session, tenant_id, entry, f"{name}.", now)
    return DecryptedPayloads("multiple", opened)


def _open_entry(session: Session, tenant_id: uuid.UUID, entry: Any, path: str, now: dt.datetime) -> dict:
    if not isinstance(entry, dict) or not isinstance(entry.get("encrypted"), str):
        raise EncryptedPayloadError(
            "Expected an object {type, encrypted} with a JWE string.", field=path.rstrip(".") or "header"
        )
    kind = entry.get("type")
    if kind not in PAYLOAD_TYPES:
        raise EncryptedPayloadError(f"type must be one of {', '.join(PAYLOAD_TYPES)}.", field=f"{path}type")
    unknown = set(entry) - {"type", "encrypted"}
    if unknown:
        raise EncryptedPayloadError(
            f"Unknown properties: {', '.join(sorted(unknown))}.", field=path.rstrip(".") or "header"
        )
    payload = decrypt_jwe(session, tenant_id, entry["encrypted"], now=now, field=f"{path}encrypted")
    if not isinstance(payload, dict) or "data" not in payload:
        raise EncryptedPayloadError(
            "The decrypted payload must be a token request object with data.", field=f"{path}encrypted"
        )
    if payload.get("type", kind) != kind:
        raise EncryptedPayloadError(
            f"The decrypted payload's type {payload.get('type')!r} is not {kind!r}.", field=f"{path}type"
        )
    return {**payload, "type": kind}


def _protected_header(token: str, field: str) -> dict:
    parts = token.split(".")
    if len(parts) != 5:
        raise EncryptedPayloadError("Not a JWE in compact serialization (five base64url parts).", field=field)
    try:
        header = json.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise EncryptedPayloadError("The JWE protected header is not base64url JSON.", field=field) from None
    if not isinstance(header, dict):
        raise EncryptedPayloadError("The JWE protected header is not a JSON object.", field=field)
    return header


def decrypt_jwe(
    session: Session, tenant_id: uuid.UUID, token: str, *, now: dt.datetime | None = None, field: str = "encrypted"
) -> Any:
    """Decrypt one compact JWE made with one of the tenant's client encryption keys; returns the
    parsed JSON plaintext. Raises :class:`EncryptedPayloadError` (400) naming ``field``."""
    now = now or utcnow()
    if len(token) > MAX_JWE_BYTES:
        raise EncryptedPayloadError(
            f"The JWE is longer than {MAX_JWE_BYTES} characters.", field=field, code="encrypted_payload_too_large"
        )
    header = _protected_header(token, field)
    if "zip" in header:
        raise EncryptedPayloadError(
            "Compressed JWEs (zip) are not accepted.", field=field, code="compression_not_allowed"
        )
    if header.get("alg") != ALG or header.get("enc") != ENC:
        raise EncryptedPayloadError(
            f"Only alg {ALG} with enc {ENC} is accepted; got alg {header.get('alg')!r}, enc {header.get('enc')!r}.",
            field=field,
            code="algorithm_not_allowed",
        )
    try:
        key_id = uuid.UUID(str(header.get("kid")))
    except ValueError:
        key_id = None
    key = session.get(ClientEncryptionKey, key_id) if key_id else None
    if key is None or key.tenant_id != tenant_id:
        raise EncryptedPayloadError(
            f"No client encryption key has the kid {header.get('kid')!r}.", field=field, code="unknown_key"
        )
    if key.deleted_at is not None:
        raise EncryptedPayloadError(f"The client encryption key {key.id} was deleted.", field=field, code="key_deleted")
    if key.expires_at <= now or key.private_key_ct is None:
        raise EncryptedPayloadError(
            f"The client encryption key {key.id} expired at {key.expires_at.isoformat()}.",
            field=field,
            code="key_expired",
        )
    try:
        raw = get_keyring().decrypt(session, tenant_id, PURPOSE, str(key.id), key.private_key_ct)
    except DecryptionError:
        raise Problem(500, "A client encryption key could not be opened.") from None
    private = OKPKey.import_key(X25519PrivateKey.from_private_bytes(raw))
    try:
        plaintext = jwe.decrypt_compact(token, private, registry=REGISTRY).plaintext
    except (JoseError, ValueError, TypeError):
        raise EncryptedPayloadError(
            "The JWE does not decrypt with its key (tampered, or made for another key).",
            field=field,
            code="decryption_failed",
        ) from None
    assert plaintext is not None, "decrypt_compact sets the plaintext of what it decrypts"
    try:
        return json.loads(plaintext)
    except (ValueError, UnicodeDecodeError):
        raise EncryptedPayloadError("The decrypted payload is not JSON.", field=field) from None
