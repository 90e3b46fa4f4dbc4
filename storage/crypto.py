"""Encryption at rest: AES-256-GCM envelopes under per-tenant data keys.

Each tenant has one random 256-bit data key (DEK), stored only wrapped:

* by the **master key** (``TESSERA_MASTER_KEY``, base64 of 32 bytes, or the key file ``master.key``
  made in ``TESSERA_DATA_DIR`` on first start), with AES-256-GCM and the tenant id as associated
  data; or
* by **AWS KMS** when ``TESSERA_KMS_KEY_ID`` is set (``Encrypt``/``Decrypt`` with the encryption
  context ``{"tenant_id": ...}``).

Values are sealed with the DEK and bound to ``purpose:tenant_id:resource_id`` as associated data, so a
ciphertext moved to another row or tenant fails to open. Fingerprints and search indexes are keyed
HMAC-SHA256 digests under keys derived (HKDF) from the DEK: equal inputs match within a tenant only,
and a digest reveals nothing without the key.

Envelope layout: ``b"\\x01" || nonce (12 bytes) || ciphertext+tag``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import secrets
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlmodel import Session

from config.settings import Settings, get_settings
from storage.models import TenantDataKey

_VERSION = b"\x01"
_NONCE_BYTES = 12


class DecryptionError(Exception):
    """A ciphertext failed to open: wrong key, wrong associated data or tampered bytes."""


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """Encrypt ``plaintext`` with AES-256-GCM under ``key`` (32 bytes), binding ``aad``."""
    nonce = os.urandom(_NONCE_BYTES)
    return _VERSION + nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, envelope: bytes, aad: bytes) -> bytes:
    """Decrypt an envelope made by :func:`seal`; raises :class:`DecryptionError` on any mismatch."""
    if len(envelope) < 1 + _NONCE_BYTES + 16 or envelope[:1] != _VERSION:
        raise DecryptionError("malformed envelope")
    nonce, body = envelope[1 : 1 + _NONCE_BYTES], envelope[1 + _NONCE_BYTES :]
    try:
        return AESGCM(key).decrypt(nonce, body, aad)
    except InvalidTag as exc:
        raise DecryptionError("ciphertext does not authenticate") from exc


# ---- key wrapping --------------------------------------------------------------------------------


class MasterKeyWrapper:
    """Wraps data keys with a local 256-bit master key."""

    name = "master"

    def __init__(self, master_key: bytes):
        if len(master_key) != 32:
            raise ValueError("the master key must be 32 bytes")
        self._key = master_key

    def wrap(self, data_key: bytes, tenant_id: uuid.UUID) -> tuple[bytes, str | None]:
        """Return (wrapped key, KMS key id or None)."""
        return seal(self._key, data_key, b"tessera-dek:" + tenant_id.bytes), None

    def unwrap(self, wrapped: bytes, tenant_id: uuid.UUID, kms_key_id: str | None) -> bytes:
        """Return the plain data key; raises DecryptionError when the master key is not the one used."""
        return open_sealed(self._key, wrapped, b"tessera-dek:" + tenant_id.bytes)


class KmsWrapper:
    """Wraps data keys with AWS KMS ``Encrypt``/``Decrypt`` (tenant id as encryption context)."""

    name = "kms"

    def __init__(self, key_id: str, *, region: str, endpoint_url: str | None):
        import boto3

        self._key_id = key_id
        self._client = boto3.client("kms", region_name=region, endpoint_url=endpoint_url)

    def wrap(self, data_key: bytes, tenant_id: uuid.UUID) -> tuple[bytes, str | None]:
        """Return (ciphertext blob, KMS key id)."""
        answer = self._client.encrypt(
            KeyId=self._key_id, Plaintext=data_key, EncryptionContext={"tenant_id": str(tenant_id)}
        )
        return answer["CiphertextBlob"], answer.get("KeyId", self._key_id)

    def unwrap(self, wrapped: bytes, tenant_id: uuid.UUID, kms_key_id: str | None) -> bytes:
        """Return the plain data key; raises DecryptionError when KMS refuses."""
        try:
            answer = self._client.decrypt(CiphertextBlob=wrapped, EncryptionContext={"tenant_id": str(tenant_id)})
        except self._client.exceptions.InvalidCiphertextException as exc:
            raise DecryptionError("KMS refused the wrapped data key") from exc
        return answer["Plaintext"]


def load_master_key(settings: Settings) -> bytes:
    """The master key from ``TESSERA_MASTER_KEY``, else from (or newly into) ``data_dir/master.key``."""
    if settings.master_key is not None:
        key = base64.b64decode(settings.master_key.get_secret_value())
        if len(key) != 32:
            raise ValueError("TESSERA_MASTER_KEY must be the base64 of 32 bytes")
        return key
    path = Path(settings.data_dir) / "master.key"
    if not path.exists():
        _create_key_file(path)
    key = base64.b64decode(path.read_text().strip())
    if len(key) != 32:
        raise ValueError(f"{path} must hold the base64 of 32 bytes")
    return key


def _create_key_file(path: Path) -> None:
    """Write a new master key to ``path`` (mode 0600) unless another process got there first.

    The key is written to a private temporary file and linked into place, so a concurrent reader
    (the api and the worker starting together) never sees a partly written file, and the first
    process to link wins while the others use its key.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        temporary.unlink(missing_ok=True)


# ---- the keyring ---------------------------------------------------------------------------------


def hkdf(key_material: bytes, info: bytes) -> bytes:
    """A 32-byte key derived from ``key_material`` for the purpose ``info`` (HKDF-SHA256, no salt)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key_material)


@dataclass(frozen=True)
class TenantKeys:
    """A tenant's plain data key and the HMAC keys derived from it."""

    data_key: bytes
    fingerprint_key: bytes
    index_key: bytes

    @classmethod
    def derive(cls, data_key: bytes) -> TenantKeys:
        """Derive the HMAC keys from the data key with HKDF-SHA256."""
        return cls(data_key, hkdf(data_key, b"tessera fingerprint v1"), hkdf(data_key, b"tessera search index v1"))


class Keyring:
    """Creates, unwraps and caches tenants' data keys; seals and opens values for them."""

    def __init__(self, settings: Settings):
        self._settings = settings
        self._cache: dict[uuid.UUID, TenantKeys] = {}
        self._lock = threading.Lock()

    @functools.cached_property
    def _wrapper(self) -> MasterKeyWrapper | KmsWrapper:
        if self._settings.kms_key_id:
            return KmsWrapper(
                self._settings.kms_key_id,
                region=self._settings.aws_region,
                endpoint_url=self._settings.kms_endpoint_url,
            )
        return MasterKeyWrapper(load_master_key(self._settings))

    @functools.cached_property
    def _master(self) -> MasterKeyWrapper:
        return MasterKeyWrapper(load_master_key(self._settings))

    @functools.cached_property
    def _platform_keys(self) -> dict[bytes, bytes]:
        return {}

    def platform_key(self, info: bytes) -> bytes:
        """A 32-byte platform-wide key for the purpose ``info`` (for example ``b"tessera cursor v1"``),
        derived with HKDF-SHA256 from the master key material (``TESSERA_MASTER_KEY`` or ``master.key``);
        the same in every process sharing that material. Cached per process."""
        key = self._platform_keys.get(info)
        if key is None:
            key = self._platform_keys[info] = hkdf(load_master_key(self._settings), info)
        return key

    def create_tenant_key(self, session: Session, tenant_id: uuid.UUID) -> None:
        """Make and store a new wrapped data key for a new tenant (in the caller's transaction)."""
        data_key = secrets.token_bytes(32)
        wrapped, kms_key_id = self._wrapper.wrap(data_key, tenant_id)
        session.add(
            TenantDataKey(tenant_id=tenant_id, wrapped_key=wrapped, wrapping=self._wrapper.name, kms_key_id=kms_key_id)
        )
        with self._lock:
            self._cache[tenant_id] = TenantKeys.derive(data_key)

    def keys(self, session: Session, tenant_id: uuid.UUID) -> TenantKeys:
        """The tenant's keys, unwrapped once per process. Raises LookupError for an unknown tenant."""
        cached = self._cache.get(tenant_id)
        if cached is not None:
            return cached
        row = session.get(TenantDataKey, tenant_id)
        if row is None:
            raise LookupError(f"no data key for tenant {tenant_id}")
        if row.wrapping == MasterKeyWrapper.name:
            wrapper: MasterKeyWrapper | KmsWrapper = self._master
        elif row.wrapping == KmsWrapper.name and isinstance(self._wrapper, KmsWrapper):
            wrapper = self._wrapper
        else:
            raise DecryptionError(
                f"the data key of tenant {tenant_id} is wrapped by {row.wrapping!r}, which is not configured"
            )
        keys = TenantKeys.derive(wrapper.unwrap(row.wrapped_key, tenant_id, row.kms_key_id))
        with self._lock:
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[tenant_id] = keys
        return keys

    def encrypt(
        self, session: Session, tenant_id: uuid.UUID, purpose: str, resource_id: str, plaintext: bytes
    ) -> bytes:
        """Seal ``plaintext`` for one resource of a tenant (``purpose`` names the kind of value)."""
        key = self.keys(session, tenant_id).data_key
        return seal(key, plaintext, _aad(purpose, tenant_id, resource_id))

    def decrypt(self, session: Session, tenant_id: uuid.UUID, purpose: str, resource_id: str, envelope: bytes) -> bytes:
        """Open a value sealed by :meth:`encrypt`; raises :class:`DecryptionError` on mismatch."""
        key = self.keys(session, tenant_id).data_key
        return open_sealed(key, envelope, _aad(purpose, tenant_id, resource_id))

    def fingerprint(self, session: Session, tenant_id: uuid.UUID, value: str) -> str:
        """A keyed fingerprint of ``value``: 43 characters of base64url HMAC-SHA256."""
        key = self.keys(session, tenant_id).fingerprint_key
        return _b64(hmac.new(key, value.encode(), hashlib.sha256).digest())

    def blind_index(self, session: Session, tenant_id: uuid.UUID, value: str) -> str:
        """The keyed digest stored for a search-index value (hex, 64 characters)."""
        key = self.keys(session, tenant_id).index_key
        return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()


def _aad(purpose: str, tenant_id: uuid.UUID, resource_id: str) -> bytes:
    return f"{purpose}:{tenant_id}:{resource_id}".encode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@functools.cache
def get_keyring() -> Keyring:
    """The process's keyring for the current settings."""
    return Keyring(get_settings())
