"""Encryption at rest: AES-256-GCM envelopes under versioned per-tenant data keys.

Each tenant has data keys in versions (random 256-bit keys), stored only wrapped:

* by the **master key** (``TESSERA_MASTER_KEY``, base64 of 32 bytes; in the embedded default only,
  the key file ``master.key`` made in ``TESSERA_DATA_DIR`` on first start), with AES-256-GCM and the
  tenant id as associated data; or
* by **AWS KMS** when ``TESSERA_KMS_KEY_ID`` is set (``Encrypt``/``Decrypt`` with the encryption
  context ``{"tenant_id": ...}``).

One version is ``active`` (new values are sealed with it); older ones are ``retiring`` while a
rotation re-encrypts their values, then ``destroyed`` (key bytes deleted). Every envelope names the
version that sealed it, so reads open any live version. Rotating the wrapping key:
``TESSERA_MASTER_KEY_PREVIOUS`` / ``TESSERA_KMS_KEY_ID_PREVIOUS`` list keys still accepted for
unwrapping while ``tessera keys rewrap`` moves every wrapped key under the current one (each row's
``wrapped_by`` names its wrapping key).

Values are sealed bound to ``purpose:tenant_id:resource_id`` as associated data, so a ciphertext
moved to another row or tenant fails to open. Fingerprints, search indexes and invitation links are
keyed HMAC-SHA256 digests under keys derived (HKDF) from the tenant's derivation key
(``tenant_index_keys``), which does not rotate with the data key: digests keep matching across a
rotation and reveal nothing without the key.

Envelope layouts: ``b"\\x02" || version (4 bytes, big-endian) || nonce (12) || ciphertext+tag``;
the earlier ``b"\\x01" || nonce || ciphertext+tag`` reads as version 1 (and seals what no tenant key
seals: wrapped keys, the key check).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import hmac
import os
import secrets
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from sqlalchemy import delete, select, update
from sqlmodel import Session, col

from config.settings import Settings, get_settings
from storage.models import TenantDataKey, TenantIndexKey
from storage.types import random_bytes, utcnow

_V1 = b"\x01"
_V2 = b"\x02"
_NONCE_BYTES = 12
_TAG_BYTES = 16
#: How long a process trusts the active version of a tenant's data key it read (seconds). A rotation
#: waits longer than this before it destroys a retiring version (no process seals with it any more).
ACTIVE_VERSION_TTL = 5.0
ACTIVE, RETIRING, DESTROYED = "active", "retiring", "destroyed"


class DecryptionError(Exception):
    """A ciphertext failed to open: wrong key, wrong associated data, tampered bytes, or a key
    version that was destroyed."""


class KeyNotCached(LookupError):
    """A key the keyring would read from the database, asked for without a session
    (:meth:`Keyring.data_key` with ``session`` None: the caches only, as on the event loop)."""


class KeyUnavailable(Exception):
    """The key service (AWS KMS) could not be reached or refused to work: nothing was changed, and
    the operation may be tried again (the api answers 503)."""


@functools.lru_cache(maxsize=4096)
def _cipher(key: bytes) -> AESGCM:
    """The AES-GCM object of a key, made once per process (its key schedule is not recomputed per value)."""
    return AESGCM(key)


def seal(key: bytes, plaintext: bytes, aad: bytes, version: int | None = None) -> bytes:
    """Encrypt ``plaintext`` with AES-256-GCM under ``key`` (32 bytes), binding ``aad``; the envelope
    names ``version`` (the tenant's data key version) when given."""
    nonce = random_bytes(_NONCE_BYTES)
    head = _V1 if version is None else _V2 + version.to_bytes(4, "big")
    return head + nonce + _cipher(key).encrypt(nonce, plaintext, aad)


def envelope_version(envelope: bytes) -> int:
    """The data key version an envelope names (1 for the first layout); raises DecryptionError for
    something that is no envelope."""
    if envelope[:1] == _V2 and len(envelope) >= 5:
        return int.from_bytes(envelope[1:5], "big")
    if envelope[:1] == _V1:
        return 1
    raise DecryptionError("malformed envelope")


def open_sealed(key: bytes, envelope: bytes, aad: bytes) -> bytes:
    """Decrypt an envelope made by :func:`seal`; raises :class:`DecryptionError` on any mismatch."""
    head = 5 if envelope[:1] == _V2 else 1
    if len(envelope) < head + _NONCE_BYTES + _TAG_BYTES or envelope[:1] not in (_V1, _V2):
        raise DecryptionError("malformed envelope")
    nonce, body = envelope[head : head + _NONCE_BYTES], envelope[head + _NONCE_BYTES :]
    try:
        return _cipher(key).decrypt(nonce, body, aad)
    except InvalidTag as exc:
        raise DecryptionError("ciphertext does not authenticate") from exc


def key_check_value(key: bytes) -> str:
    """A public name of a master key (16 hex digits of HMAC-SHA256 over a constant): equal for the
    same key, telling nothing of it."""
    return hmac.new(key, b"tessera key check v1", hashlib.sha256).hexdigest()[:16]


# ---- key wrapping --------------------------------------------------------------------------------


class MasterKeyWrapper:
    """Wraps data keys with a local 256-bit master key; ``wrapped_by`` is ``master:<key check>``."""

    name = "master"

    def __init__(self, master_key: bytes):
        if len(master_key) != 32:
            raise ValueError("the master key must be 32 bytes")
        self._key = master_key
        self.wrapped_by = f"master:{key_check_value(master_key)}"

    def wrap(self, data_key: bytes, tenant_id: uuid.UUID) -> tuple[bytes, str | None]:
        """Return (wrapped key, KMS key id or None)."""
        return seal(self._key, data_key, b"tessera-dek:" + tenant_id.bytes), None

    def unwrap(self, wrapped: bytes, tenant_id: uuid.UUID, kms_key_id: str | None) -> bytes:
        """Return the plain data key; raises DecryptionError when the master key is not the one used."""
        return open_sealed(self._key, wrapped, b"tessera-dek:" + tenant_id.bytes)


class KmsWrapper:
    """Wraps data keys with AWS KMS ``Encrypt``/``Decrypt`` (tenant id as encryption context);
    ``wrapped_by`` is ``kms:<key id>``. Raises :class:`KeyUnavailable` when KMS cannot be reached."""

    name = "kms"

    def __init__(self, key_id: str, *, region: str, endpoint_url: str | None):
        import boto3
        from botocore.config import Config

        self._key_id = key_id
        self.wrapped_by = f"kms:{key_id}"
        self._client = boto3.client(
            "kms",
            region_name=region,
            endpoint_url=endpoint_url,
            config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2}),
        )

    def wrap(self, data_key: bytes, tenant_id: uuid.UUID) -> tuple[bytes, str | None]:
        """Return (ciphertext blob, KMS key id)."""
        try:
            answer = self._client.encrypt(
                KeyId=self._key_id, Plaintext=data_key, EncryptionContext={"tenant_id": str(tenant_id)}
            )
        except (BotoCoreError, ClientError) as exc:  # unreachable, throttled, disabled key...
            raise KeyUnavailable(f"AWS KMS could not wrap a key: {type(exc).__name__}") from None
        return answer["CiphertextBlob"], answer.get("KeyId", self._key_id)

    def unwrap(self, wrapped: bytes, tenant_id: uuid.UUID, kms_key_id: str | None) -> bytes:
        """Return the plain data key; raises DecryptionError when KMS refuses it, KeyUnavailable when
        KMS cannot be reached."""
        try:
            answer = self._client.decrypt(CiphertextBlob=wrapped, EncryptionContext={"tenant_id": str(tenant_id)})
        except self._client.exceptions.InvalidCiphertextException as exc:
            raise DecryptionError("KMS refused the wrapped data key") from exc
        except (BotoCoreError, ClientError) as exc:  # unreachable, throttled, disabled key...
            raise KeyUnavailable(f"AWS KMS could not unwrap a key: {type(exc).__name__}") from None
        return answer["Plaintext"]


Wrapper = MasterKeyWrapper | KmsWrapper


class MasterKeyMissing(RuntimeError):
    """No master key where one is needed: a shared database never gets a key file of its own."""


def _decode_key(text: str, setting: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{setting} must be the base64 of 32 bytes")
    return key


def load_master_key(settings: Settings) -> bytes:
    """The master key from ``TESSERA_MASTER_KEY``; in the embedded default only, from (or newly
    into) ``data_dir/master.key``. Raises :class:`MasterKeyMissing` when a shared (non-embedded)
    database has no key set: every host must be given the same key, never make its own."""
    if settings.master_key is not None:
        return _decode_key(settings.master_key.get_secret_value(), "TESSERA_MASTER_KEY")
    path = Path(settings.data_dir) / "master.key"
    if not settings.uses_embedded_database and not path.exists():
        raise MasterKeyMissing(
            "TESSERA_MASTER_KEY is not set: a process on a shared database never makes a key of its own; "
            "give every host the same key (or set TESSERA_KMS_KEY_ID)"
        )
    if not path.exists():
        _create_key_file(path)
    return _decode_key(path.read_text(), str(path))


def existing_master_key(settings: Settings) -> bytes | None:
    """The master key when one is set or its key file exists (never makes one); else None."""
    if settings.master_key is None and not (Path(settings.data_dir) / "master.key").exists():
        return None
    return load_master_key(settings)


def previous_master_keys(settings: Settings) -> list[bytes]:
    """The keys of ``TESSERA_MASTER_KEY_PREVIOUS`` (comma-separated base64)."""
    if settings.master_key_previous is None:
        return []
    return [
        _decode_key(part, "each key of TESSERA_MASTER_KEY_PREVIOUS")
        for part in settings.master_key_previous.get_secret_value().split(",")
        if part.strip()
    ]


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
    """A tenant's plain data key of one ``version`` and the HMAC keys derived from its derivation
    key (which does not rotate)."""

    data_key: bytes
    fingerprint_key: bytes
    index_key: bytes
    version: int = 1
    root: bytes = b""

    @classmethod
    def derive(cls, root: bytes, data_key: bytes | None = None, version: int = 1) -> TenantKeys:
        """The keys of a tenant whose derivation key is ``root`` (the HMAC keys derived with
        HKDF-SHA256) and whose data key of ``version`` is ``data_key`` (``root`` when omitted)."""
        return cls(
            data_key if data_key is not None else root,
            hkdf(root, b"tessera fingerprint v1"),
            hkdf(root, b"tessera search index v1"),
            version,
            root,
        )

    def derived(self, info: bytes) -> bytes:
        """A key for the purpose ``info`` derived from the derivation key (stable across rotations)."""
        return hkdf(self.root, info)


class Keyring:
    """Creates, unwraps and caches tenants' keys; seals and opens values for them. Thread-safe.

    Caches per process: the plain data key of each (tenant, version) and each tenant's derivation
    keys (for the life of the process, forgotten when a version is destroyed here), and each
    tenant's active version for :data:`ACTIVE_VERSION_TTL` seconds.
    """

    def __init__(self, settings: Settings):
        self._settings = settings
        self._data_keys: dict[tuple[uuid.UUID, int], bytes] = {}
        self._roots: dict[uuid.UUID, TenantKeys] = {}
        self._active: dict[uuid.UUID, tuple[int, float]] = {}
        self._lock = threading.Lock()

    # ---- wrapping keys ---------------------------------------------------------------------------

    @functools.cached_property
    def current(self) -> Wrapper:
        """The wrapping key new keys are wrapped with (KMS when ``TESSERA_KMS_KEY_ID`` is set)."""
        if self._settings.kms_key_id:
            return self._kms(self._settings.kms_key_id)
        return MasterKeyWrapper(load_master_key(self._settings))

    @functools.cached_property
    def accepted(self) -> dict[str, Wrapper]:
        """Every wrapping key this process may unwrap with, by ``wrapped_by``: the current one, the
        previous ones, and the master key when KMS is current but a master key is set."""
        found: dict[str, Wrapper] = {self.current.wrapped_by: self.current}
        for key in previous_master_keys(self._settings):
            wrapper = MasterKeyWrapper(key)
            found.setdefault(wrapper.wrapped_by, wrapper)
        for key_id in (self._settings.kms_key_id_previous or "").split(","):
            if key_id.strip():
                kms = self._kms(key_id.strip())
                found.setdefault(kms.wrapped_by, kms)
        if isinstance(self.current, KmsWrapper):  # moving from the master key to KMS
            existing = existing_master_key(self._settings)
            if existing is not None:
                master = MasterKeyWrapper(existing)
                found.setdefault(master.wrapped_by, master)
        return found

    def _kms(self, key_id: str) -> KmsWrapper:
        return KmsWrapper(key_id, region=self._settings.aws_region, endpoint_url=self._settings.kms_endpoint_url)

    def unwrap(
        self, tenant_id: uuid.UUID, wrapped: bytes, wrapping: str, kms_key_id: str | None, wrapped_by: str | None
    ) -> tuple[bytes, Wrapper]:
        """The plain key of a wrapped row and the wrapper that opened it. A row that names its
        wrapping key is opened by that key only; a row from before keys were named is tried with
        each accepted key of its kind. Raises DecryptionError naming the setting to fix."""
        if wrapped_by is not None:
            named = self.accepted.get(wrapped_by)
            if named is None:
                setting = "TESSERA_KMS_KEY_ID" if wrapped_by.startswith("kms:") else "TESSERA_MASTER_KEY"
                raise DecryptionError(
                    f"a key of tenant {tenant_id} is wrapped by {wrapped_by}, which is neither {setting} nor one "
                    f"of its _PREVIOUS keys"
                )
            return named.unwrap(wrapped, tenant_id, kms_key_id), named
        for candidate in self.accepted.values():
            if candidate.name == wrapping:
                try:
                    return candidate.unwrap(wrapped, tenant_id, kms_key_id), candidate
                except DecryptionError:
                    continue
        raise DecryptionError(f"no configured {wrapping} key opens the data key of tenant {tenant_id}")

    # ---- platform keys ---------------------------------------------------------------------------

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

    # ---- tenants' keys ---------------------------------------------------------------------------

    def create_tenant_key(self, session: Session, tenant_id: uuid.UUID) -> None:
        """Make and store a new tenant's data key (version 1, active) and derivation key, wrapped
        by the current wrapping key (in the caller's transaction)."""
        data_key, root = secrets.token_bytes(32), secrets.token_bytes(32)
        wrapper = self.current
        wrapped, kms_key_id = wrapper.wrap(data_key, tenant_id)
        wrapped_root, _ = wrapper.wrap(root, tenant_id)
        session.add(
            TenantDataKey(
                tenant_id=tenant_id,
                version=1,
                state=ACTIVE,
                wrapped_key=wrapped,
                wrapping=wrapper.name,
                kms_key_id=kms_key_id,
                wrapped_by=wrapper.wrapped_by,
            )
        )
        session.add(
            TenantIndexKey(
                tenant_id=tenant_id,
                wrapped_key=wrapped_root,
                wrapping=wrapper.name,
                kms_key_id=kms_key_id,
                wrapped_by=wrapper.wrapped_by,
            )
        )
        with self._lock:
            self._data_keys[(tenant_id, 1)] = data_key
            self._roots[tenant_id] = TenantKeys.derive(root)
            self._active[tenant_id] = (1, time.monotonic() + ACTIVE_VERSION_TTL)

    def add_version(self, session: Session, tenant_id: uuid.UUID) -> int:
        """Make the tenant's next data key version, active; the active one becomes ``retiring``
        (in the caller's transaction, which should hold the tenant's key rows locked). Returns it."""
        rows = (
            session.execute(select(TenantDataKey).where(col(TenantDataKey.tenant_id) == tenant_id).with_for_update())
            .scalars()
            .all()
        )
        if not rows:
            raise LookupError(f"no data key for tenant {tenant_id}")
        version = max(row.version for row in rows) + 1
        for row in rows:
            if row.state == ACTIVE:
                row.state = RETIRING
                session.add(row)
        data_key = secrets.token_bytes(32)
        wrapped, kms_key_id = self.current.wrap(data_key, tenant_id)
        session.add(
            TenantDataKey(
                tenant_id=tenant_id,
                version=version,
                state=ACTIVE,
                wrapped_key=wrapped,
                wrapping=self.current.name,
                kms_key_id=kms_key_id,
                wrapped_by=self.current.wrapped_by,
            )
        )
        with self._lock:
            self._data_keys[(tenant_id, version)] = data_key
            self._active.pop(tenant_id, None)
        return version

    def destroy_version(self, session: Session, tenant_id: uuid.UUID, version: int) -> None:
        """Delete the key bytes of one version (its row says ``destroyed``, with when); values still
        sealed under it can never be opened again. Forgotten by this process at once."""
        row = session.get(TenantDataKey, (tenant_id, version), with_for_update=True)
        if row is not None and row.state != DESTROYED:
            row.state, row.wrapped_key, row.destroyed_at = DESTROYED, None, utcnow()
            session.add(row)
        self.forget(tenant_id)

    def shred(self, session: Session, tenant_id: uuid.UUID) -> None:
        """Destroy every key of a tenant in the caller's transaction: each data key version's bytes
        deleted (rows say ``destroyed``), the derivation key row deleted. Nothing of the tenant can
        be opened again, from any copy of the database."""
        session.execute(
            update(TenantDataKey)
            .where(col(TenantDataKey.tenant_id) == tenant_id)
            .values(wrapped_key=None, state=DESTROYED, destroyed_at=utcnow())
        )
        session.execute(delete(TenantIndexKey).where(col(TenantIndexKey.tenant_id) == tenant_id))
        self.forget(tenant_id)

    def forget(self, tenant_id: uuid.UUID) -> None:
        """Drop this process's cached keys of a tenant (its versions changed or were destroyed), and
        the cipher objects of every key (they hold key schedules)."""
        _cipher.cache_clear()
        with self._lock:
            for cached in [k for k in self._data_keys if k[0] == tenant_id]:
                del self._data_keys[cached]
            self._roots.pop(tenant_id, None)
            self._active.pop(tenant_id, None)

    def active_version(self, session: Session, tenant_id: uuid.UUID) -> int:
        """The version new values of the tenant are sealed with (read again after
        :data:`ACTIVE_VERSION_TTL` seconds). Raises LookupError for an unknown tenant."""
        known = self._active.get(tenant_id)
        if known is not None and known[1] > time.monotonic():
            return known[0]
        version = session.execute(
            select(col(TenantDataKey.version)).where(
                col(TenantDataKey.tenant_id) == tenant_id, col(TenantDataKey.state) == ACTIVE
            )
        ).scalar()
        if version is None:
            raise LookupError(f"no data key for tenant {tenant_id}")
        with self._lock:
            self._active[tenant_id] = (version, time.monotonic() + ACTIVE_VERSION_TTL)
        return version

    def data_key(self, session: Session | None, tenant_id: uuid.UUID, version: int) -> bytes:
        """The plain data key of one version, unwrapped once per process. Raises LookupError for an
        unknown tenant or version, DecryptionError for a destroyed one; ``session`` None: the cache
        only, :class:`KeyNotCached` (a LookupError) when the key is not in it (no statement, no key
        service call: what the event loop may ask)."""
        cached = self._data_keys.get((tenant_id, version))
        if cached is not None:
            return cached
        if session is None:
            raise KeyNotCached(f"data key version {version} of tenant {tenant_id} is not cached")
        row = session.get(TenantDataKey, (tenant_id, version))
        if row is None:
            raise LookupError(f"no data key version {version} for tenant {tenant_id}")
        if row.state == DESTROYED or row.wrapped_key is None:
            raise DecryptionError(f"data key version {version} of tenant {tenant_id} was destroyed")
        plain, _ = self.unwrap(tenant_id, row.wrapped_key, row.wrapping, row.kms_key_id, row.wrapped_by)
        with self._lock:
            if len(self._data_keys) > 100_000:
                self._data_keys.clear()
            self._data_keys[(tenant_id, version)] = plain
        return plain

    def _root(self, session: Session, tenant_id: uuid.UUID) -> TenantKeys:
        cached = self._roots.get(tenant_id)
        if cached is not None:
            return cached
        row = session.get(TenantIndexKey, tenant_id)
        if row is None:
            raise LookupError(f"no data key for tenant {tenant_id}")
        plain, _ = self.unwrap(tenant_id, row.wrapped_key, row.wrapping, row.kms_key_id, row.wrapped_by)
        keys = TenantKeys.derive(plain)
        with self._lock:
            if len(self._roots) > 50_000:
                self._roots.clear()
            self._roots[tenant_id] = keys
        return keys

    def keys(self, session: Session, tenant_id: uuid.UUID, version: int | None = None) -> TenantKeys:
        """The tenant's keys: the data key of ``version`` (default: the active one) and the HMAC
        keys of its derivation key. Raises LookupError for an unknown tenant."""
        version = self.active_version(session, tenant_id) if version is None else version
        data_key = self.data_key(session, tenant_id, version)
        root = self._root(session, tenant_id)
        return TenantKeys(data_key, root.fingerprint_key, root.index_key, version, root.root)

    # ---- values ----------------------------------------------------------------------------------

    def encrypt(
        self, session: Session, tenant_id: uuid.UUID, purpose: str, resource_id: str, plaintext: bytes
    ) -> bytes:
        """Seal ``plaintext`` for one resource of a tenant (``purpose`` names the kind of value)
        with the tenant's active data key version."""
        version = self.active_version(session, tenant_id)
        return seal(
            self.data_key(session, tenant_id, version), plaintext, _aad(purpose, tenant_id, resource_id), version
        )

    def decrypt(
        self, session: Session | None, tenant_id: uuid.UUID, purpose: str, resource_id: str, envelope: bytes
    ) -> bytes:
        """Open a value sealed by :meth:`encrypt` with the version it names; raises
        :class:`DecryptionError` on mismatch or when that version was destroyed, LookupError as
        :meth:`data_key` (``session`` None: the cached keys only)."""
        key = self.data_key(session, tenant_id, envelope_version(envelope))
        return open_sealed(key, envelope, _aad(purpose, tenant_id, resource_id))

    def reseal(
        self, session: Session, tenant_id: uuid.UUID, purpose: str, resource_id: str, envelope: bytes, version: int
    ) -> bytes:
        """The same value sealed again under ``version`` (a rotation's step); raises like
        :meth:`decrypt`."""
        plain = self.decrypt(session, tenant_id, purpose, resource_id, envelope)
        return seal(self.data_key(session, tenant_id, version), plain, _aad(purpose, tenant_id, resource_id), version)

    def decrypt_many(
        self, session: Session, tenant_id: uuid.UUID, purpose: str, envelopes: Iterable[tuple[str, bytes]]
    ) -> dict[str, bytes]:
        """Open many values of one tenant and purpose sealed by :meth:`encrypt`: ``(resource id,
        envelope)`` pairs in, ``{resource id: plaintext}`` out, leaving out each value that does not
        open (what :meth:`decrypt` refuses with :class:`DecryptionError`). For bulk reads (an account
        updater chunk's thousands of tokens); each key version is unwrapped once per process, as always."""
        opened: dict[str, bytes] = {}
        for resource_id, envelope in envelopes:
            with contextlib.suppress(DecryptionError):
                opened[resource_id] = self.decrypt(session, tenant_id, purpose, resource_id, envelope)
        return opened

    def fingerprint(self, session: Session, tenant_id: uuid.UUID, value: str) -> str:
        """A keyed fingerprint of ``value``: 43 characters of base64url HMAC-SHA256."""
        key = self._root(session, tenant_id).fingerprint_key
        return _b64(hmac.new(key, value.encode(), hashlib.sha256).digest())

    def blind_index(self, session: Session, tenant_id: uuid.UUID, value: str) -> str:
        """The keyed digest stored for a search-index value (hex, 64 characters)."""
        key = self._root(session, tenant_id).index_key
        return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()

    def derived_key(self, session: Session, tenant_id: uuid.UUID, info: bytes) -> bytes:
        """A tenant key for the purpose ``info`` (HKDF of its derivation key; stable across data
        key rotations: for links and MACs the tenant hands out)."""
        return self._root(session, tenant_id).derived(info)


def _aad(purpose: str, tenant_id: uuid.UUID, resource_id: str) -> bytes:
    return f"{purpose}:{tenant_id}:{resource_id}".encode()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@functools.cache
def get_keyring() -> Keyring:
    """The process's keyring for the current settings."""
    return Keyring(get_settings())
