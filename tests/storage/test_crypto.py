"""Encryption at rest (``storage/crypto.py``): envelopes, per-tenant data keys wrapped by the master
key or by AWS KMS (moto), associated data, and keyed fingerprints (ARCHITECTURE.md, security model)."""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import threading
import uuid
from pathlib import Path

import pytest
from sqlmodel import Session, SQLModel

from config.settings import Settings
from storage.crypto import (
    DecryptionError,
    Keyring,
    MasterKeyWrapper,
    TenantKeys,
    load_master_key,
    open_sealed,
    seal,
)
from storage.db import make_engine
from storage.models import Tenant, TenantDataKey

pytestmark = pytest.mark.unit

CARD = b'{"number":"4242424242424242","expiration_month":12,"expiration_year":2030}'


@pytest.fixture
def session(tmp_path):
    """A session on a fresh SQLite database with the platform's tables."""
    engine = make_engine(f"sqlite:///{tmp_path / 'crypto.db'}")
    SQLModel.metadata.create_all(engine)
    with Session(engine, expire_on_commit=False) as session:
        yield session
    engine.dispose()


@pytest.fixture(autouse=True)
def _no_master_key_env(monkeypatch):
    monkeypatch.delenv("TESSERA_MASTER_KEY", raising=False)
    monkeypatch.delenv("TESSERA_KMS_KEY_ID", raising=False)


def settings_for(data_dir: Path, **overrides) -> Settings:
    # the embedded default: the only case where a process makes a key file of its own
    overrides.setdefault("database_url", f"sqlite:///{data_dir / 'tessera.db'}")
    if "kms_key_id" in overrides:  # KMS is moto's server on loopback (see the kms fixture)
        overrides.setdefault("kms_endpoint_url", os.environ["TESSERA_S3_ENDPOINT_URL"])
    return Settings(data_dir=data_dir, **overrides)


def new_tenant(session: Session) -> uuid.UUID:
    tenant = Tenant(name="t", type="test", settings={})
    session.add(tenant)
    session.commit()
    return tenant.id


# ---- envelopes ------------------------------------------------------------------------------------------


def test_seal_round_trip_and_fresh_nonces():
    key = os.urandom(32)
    first, second = seal(key, CARD, b"aad"), seal(key, CARD, b"aad")
    assert first != second, "a fresh nonce every time"
    assert CARD not in first
    assert open_sealed(key, first, b"aad") == CARD == open_sealed(key, second, b"aad")


def test_wrong_key_or_associated_data_fails():
    key = os.urandom(32)
    envelope = seal(key, CARD, b"card:tenant-a:tok_1")
    with pytest.raises(DecryptionError):
        open_sealed(os.urandom(32), envelope, b"card:tenant-a:tok_1")
    with pytest.raises(DecryptionError):
        open_sealed(key, envelope, b"card:tenant-a:tok_2")
    with pytest.raises(DecryptionError):
        open_sealed(key, envelope, b"")


@pytest.mark.parametrize("position", [0, 1, 12, 13, -1, -16])
def test_tampering_fails(position):
    key = os.urandom(32)
    envelope = bytearray(seal(key, CARD, b"aad"))
    envelope[position] ^= 0x01
    with pytest.raises(DecryptionError):
        open_sealed(key, bytes(envelope), b"aad")


@pytest.mark.parametrize("cut", [0, 1, 13, 28])
def test_truncated_envelope_fails(cut):
    key = os.urandom(32)
    with pytest.raises(DecryptionError):
        open_sealed(key, seal(key, CARD, b"aad")[:cut], b"aad")


# ---- master-key wrapping -------------------------------------------------------------------------------


def test_master_key_wrap_unwrap_round_trip():
    wrapper = MasterKeyWrapper(os.urandom(32))
    data_key, tenant = os.urandom(32), uuid.uuid4()
    wrapped, kms_key_id = wrapper.wrap(data_key, tenant)
    assert kms_key_id is None
    assert data_key not in wrapped
    assert wrapper.unwrap(wrapped, tenant, None) == data_key
    # bound to the tenant and to the master key
    with pytest.raises(DecryptionError):
        wrapper.unwrap(wrapped, uuid.uuid4(), None)
    with pytest.raises(DecryptionError):
        MasterKeyWrapper(os.urandom(32)).unwrap(wrapped, tenant, None)
    with pytest.raises(ValueError):
        MasterKeyWrapper(os.urandom(16))


def test_master_key_file_is_created_0600_and_reused(tmp_path):
    data_dir = tmp_path / "data"
    path = data_dir / "master.key"
    previous = os.umask(0)  # even a permissive umask must not widen the file's mode
    try:
        key = load_master_key(settings_for(data_dir))
    finally:
        os.umask(previous)
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    content = path.read_bytes()
    assert load_master_key(settings_for(data_dir)) == key
    assert path.read_bytes() == content
    assert [p.name for p in data_dir.iterdir()] == ["master.key"], "no temporary files left behind"


def test_master_key_file_created_once_under_concurrency(tmp_path):
    """Processes starting together (api, worker) all end up with one and the same key."""
    for round_ in range(20):
        data_dir = tmp_path / f"race-{round_}"
        keys, errors = [], []
        barrier = threading.Barrier(16)

        def load(data_dir=data_dir, keys=keys, errors=errors, barrier=barrier):
            barrier.wait()
            try:
                keys.append(load_master_key(settings_for(data_dir)))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert len(keys) == 16 and len(set(keys)) == 1
        assert base64.b64decode((data_dir / "master.key").read_text()) == keys[0]
        assert [p.name for p in data_dir.iterdir()] == ["master.key"]


def test_keyring_uses_and_reuses_the_master_key_file(tmp_path, session):
    data_dir = tmp_path / "data"
    tenant = new_tenant(session)
    first = Keyring(settings_for(data_dir))
    first.create_tenant_key(session, tenant)
    session.commit()
    envelope = first.encrypt(session, tenant, "token-data", "tok_1", CARD)
    assert stat.S_IMODE((data_dir / "master.key").stat().st_mode) == 0o600

    row = session.get(TenantDataKey, (tenant, 1))
    assert row.wrapping == "master" and row.kms_key_id is None
    master = load_master_key(settings_for(data_dir))
    assert len(MasterKeyWrapper(master).unwrap(row.wrapped_key, tenant, None)) == 32

    # a new process (empty cache) finds the same master key and opens the value
    second = Keyring(settings_for(data_dir))
    assert second.decrypt(session, tenant, "token-data", "tok_1", envelope) == CARD
    # with another master key the data key cannot be unwrapped
    elsewhere = Keyring(settings_for(tmp_path / "elsewhere"))
    with pytest.raises(DecryptionError):
        elsewhere.decrypt(session, tenant, "token-data", "tok_1", envelope)


def test_master_key_from_environment(tmp_path, session, monkeypatch):
    master = os.urandom(32)
    monkeypatch.setenv("TESSERA_MASTER_KEY", base64.b64encode(master).decode())
    data_dir = tmp_path / "data"
    assert load_master_key(settings_for(data_dir)) == master
    tenant = new_tenant(session)
    keyring = Keyring(settings_for(data_dir))
    keyring.create_tenant_key(session, tenant)
    session.commit()
    assert not (data_dir / "master.key").exists(), "no key file when the key is given"
    row = session.get(TenantDataKey, (tenant, 1))
    assert len(MasterKeyWrapper(master).unwrap(row.wrapped_key, tenant, None)) == 32

    monkeypatch.setenv("TESSERA_MASTER_KEY", base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(ValueError):
        load_master_key(settings_for(data_dir))


# ---- the keyring: associated data ------------------------------------------------------------------------


@pytest.fixture
def keyring(tmp_path):
    return Keyring(settings_for(tmp_path / "data"))


def test_round_trip(keyring, session):
    tenant = new_tenant(session)
    keyring.create_tenant_key(session, tenant)
    session.commit()
    envelope = keyring.encrypt(session, tenant, "token-data", "tok_1", CARD)
    assert CARD not in envelope
    assert keyring.decrypt(session, tenant, "token-data", "tok_1", envelope) == CARD


def test_decrypt_many_opens_what_decrypt_opens_and_leaves_out_the_rest(keyring, session):
    tenant = new_tenant(session)
    keyring.create_tenant_key(session, tenant)
    session.commit()
    sealed = {
        f"tok_{n}": keyring.encrypt(session, tenant, "token-data", f"tok_{n}", CARD + bytes([n])) for n in range(3)
    }
    moved = keyring.encrypt(session, tenant, "token-data", "elsewhere", CARD)
    pairs = [*sealed.items(), ("tok_moved", moved), ("tok_garbage", b"\x07not an envelope")]
    opened = keyring.decrypt_many(session, tenant, "token-data", pairs)
    assert opened == {name: keyring.decrypt(session, tenant, "token-data", name, e) for name, e in sealed.items()}
    assert keyring.decrypt_many(session, tenant, "document", sealed.items()) == {}


def test_ciphertext_moved_to_another_resource_or_tenant_fails(keyring, session):
    a, b = new_tenant(session), new_tenant(session)
    keyring.create_tenant_key(session, a)
    keyring.create_tenant_key(session, b)
    session.commit()
    envelope = keyring.encrypt(session, a, "token-data", "tok_1", CARD)
    with pytest.raises(DecryptionError):
        keyring.decrypt(session, a, "token-data", "tok_2", envelope)  # another row
    with pytest.raises(DecryptionError):
        keyring.decrypt(session, a, "document", "tok_1", envelope)  # another kind of value
    with pytest.raises(DecryptionError):
        keyring.decrypt(session, b, "token-data", "tok_1", envelope)  # another tenant


def test_associated_data_binds_the_tenant_even_under_one_key(keyring, session):
    """Apart from the tenants' different keys, the tenant id itself is bound in."""
    a, b = new_tenant(session), new_tenant(session)
    keyring.create_tenant_key(session, a)
    session.commit()
    # give tenant b the very same data key, as a copied row would
    keyring._data_keys[(b, 1)] = keyring.data_key(session, a, 1)
    envelope = keyring.encrypt(session, a, "token-data", "tok_1", CARD)
    with pytest.raises(DecryptionError):
        keyring.decrypt(session, b, "token-data", "tok_1", envelope)


def test_each_tenant_has_its_own_data_key(keyring, session):
    a, b = new_tenant(session), new_tenant(session)
    keyring.create_tenant_key(session, a)
    keyring.create_tenant_key(session, b)
    session.commit()
    assert keyring.keys(session, a).data_key != keyring.keys(session, b).data_key
    rows = [session.get(TenantDataKey, (t, 1)).wrapped_key for t in (a, b)]
    assert keyring.keys(session, a).data_key not in rows[0]


def test_without_a_session_the_keyring_opens_values_with_cached_keys_only(keyring, session):
    """``session`` None asks the caches only (what the event loop may do): a key not cached raises
    KeyNotCached, a LookupError, without reading anything; once a read cached it, the value opens."""
    from storage.crypto import KeyNotCached

    tenant = new_tenant(session)
    keyring.create_tenant_key(session, tenant)
    session.commit()
    envelope = keyring.encrypt(session, tenant, "token-data", "tok_1", CARD)
    keyring._data_keys.clear()
    with pytest.raises(KeyNotCached) as raised:
        keyring.decrypt(None, tenant, "token-data", "tok_1", envelope)
    assert isinstance(raised.value, LookupError)
    assert keyring.decrypt(session, tenant, "token-data", "tok_1", envelope) == CARD
    assert keyring.decrypt(None, tenant, "token-data", "tok_1", envelope) == CARD


def test_unknown_tenant(keyring, session):
    with pytest.raises(LookupError):
        keyring.encrypt(session, uuid.uuid4(), "token-data", "tok_1", CARD)


# ---- fingerprints ---------------------------------------------------------------------------------------


def test_fingerprints_are_keyed_per_tenant(keyring, session):
    a, b = new_tenant(session), new_tenant(session)
    keyring.create_tenant_key(session, a)
    keyring.create_tenant_key(session, b)
    session.commit()
    value = "4242424242424242"
    in_a = keyring.fingerprint(session, a, value)
    assert in_a == keyring.fingerprint(session, a, value)
    assert in_a != keyring.fingerprint(session, a, "4000056655665556")
    assert in_a != keyring.fingerprint(session, b, value)

    digest = hashlib.sha256(value.encode()).digest()
    plain = {
        digest.hex(),
        base64.urlsafe_b64encode(digest).rstrip(b"=").decode(),
        base64.b64encode(digest).decode(),
    }
    assert in_a not in plain
    assert value not in in_a

    # a new process (empty cache) computes the same fingerprint from the stored key
    fresh = Keyring(keyring._settings)
    assert fresh.fingerprint(session, a, value) == in_a

    # search indexes are keyed too, and with another key than fingerprints
    index = keyring.blind_index(session, a, value)
    assert index == keyring.blind_index(session, a, value)
    assert index != keyring.blind_index(session, b, value)
    assert index not in plain and index != in_a


def test_derived_keys_differ_from_the_data_key():
    keys = TenantKeys.derive(os.urandom(32))
    assert len({keys.data_key, keys.fingerprint_key, keys.index_key}) == 3


# ---- AWS KMS (moto) -----------------------------------------------------------------------------------------


@pytest.fixture
def kms(s3_server):
    """A KMS key on moto's server over real HTTP (the same server as S3; an in-process ``mock_aws``
    would reset that server's state when it ends)."""
    import boto3

    client = boto3.client("kms", region_name="us-east-1", endpoint_url=s3_server)
    key_id = client.create_key(Description="tessera test")["KeyMetadata"]["KeyId"]
    return client, key_id


def test_kms_wrapped_tenant_keys_round_trip(tmp_path, session, kms):
    client, key_id = kms
    settings = settings_for(tmp_path / "data", kms_key_id=key_id, aws_region="us-east-1")
    keyring = Keyring(settings)
    tenant = new_tenant(session)
    keyring.create_tenant_key(session, tenant)
    session.commit()

    row = session.get(TenantDataKey, (tenant, 1))
    assert row.wrapping == "kms"
    assert row.kms_key_id and key_id in row.kms_key_id
    plain = client.decrypt(CiphertextBlob=row.wrapped_key, EncryptionContext={"tenant_id": str(tenant)})
    assert plain["Plaintext"] == keyring.keys(session, tenant).data_key

    envelope = keyring.encrypt(session, tenant, "token-data", "tok_1", CARD)
    fresh = Keyring(settings)  # a new process: unwraps through KMS
    assert fresh.decrypt(session, tenant, "token-data", "tok_1", envelope) == CARD
    assert fresh.fingerprint(session, tenant, "x") == keyring.fingerprint(session, tenant, "x")
    assert not (tmp_path / "data" / "master.key").exists(), "KMS needs no master key file"


def test_kms_wrapping_is_bound_to_the_tenant(tmp_path, session, kms):
    _, key_id = kms
    settings = settings_for(tmp_path / "data", kms_key_id=key_id, aws_region="us-east-1")
    keyring = Keyring(settings)
    a, b = new_tenant(session), new_tenant(session)
    keyring.create_tenant_key(session, a)
    session.commit()
    # copy tenant a's wrapped key onto tenant b: KMS refuses it (encryption context)
    row = session.get(TenantDataKey, (a, 1))
    session.add(TenantDataKey(tenant_id=b, wrapped_key=row.wrapped_key, wrapping="kms", kms_key_id=row.kms_key_id))
    session.commit()
    with pytest.raises(DecryptionError):
        Keyring(settings).keys(session, b)


def test_master_wrapped_keys_still_open_after_moving_to_kms(tmp_path, session, kms):
    _, key_id = kms
    data_dir = tmp_path / "data"
    before = Keyring(settings_for(data_dir))
    old_tenant = new_tenant(session)
    before.create_tenant_key(session, old_tenant)
    session.commit()
    envelope = before.encrypt(session, old_tenant, "token-data", "tok_1", CARD)

    after = Keyring(settings_for(data_dir, kms_key_id=key_id, aws_region="us-east-1"))
    assert after.decrypt(session, old_tenant, "token-data", "tok_1", envelope) == CARD
    new = new_tenant(session)
    after.create_tenant_key(session, new)
    session.commit()
    assert session.get(TenantDataKey, (new, 1)).wrapping == "kms"

    # and a KMS-wrapped key cannot be opened by a deployment without KMS
    with pytest.raises(DecryptionError):
        Keyring(settings_for(data_dir)).keys(session, new)
