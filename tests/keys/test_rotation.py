"""Key rotation on the real test database, worker and S3 (moto): a tenant's data key rotated with
every kind of sealed value re-encrypted and read back unchanged, the retiring version destroyed,
fingerprints and search still matching; a pass interrupted half-way resumed with nothing lost or
sealed twice; every wrapped key moved under a new master key while the old one is a previous key;
a deleted tenant crypto-shredded; and every binary column of the models accounted for."""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import LargeBinary
from sqlmodel import SQLModel, select

from domain.keys import inventory, service
from storage.crypto import DecryptionError, get_keyring
from storage.db import session_scope
from storage.models import AuditLog, Job, KeyRotation, Tenant, TenantDataKey, TenantIndexKey, Token
from storage.sealed import version_head
from tests.factories.documents import upload
from tests.helpers import wait_until

CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}


def test_every_binary_column_is_known_to_the_rotation():
    sealed = {spec.name for spec in inventory.SEALED}
    for table in SQLModel.metadata.sorted_tables:
        for column in table.columns:
            if isinstance(column.type, LargeBinary):
                name = f"{table.name}.{column.name}"
                assert name in sealed or name in inventory.NOT_SEALED_BY_TENANT_KEYS, name


def _populate(tenant) -> dict:
    """A token (with a fingerprint and a search index), a document, a webhook (the tenant's signing
    secret) and a proxy with a sealed configuration."""
    c = tenant.client
    token = c.post("/tokens", {"type": "card", "data": CARD, "search_indexes": ["{{ data.number | last4 }}"]})
    assert token.status == 201, token
    twin = c.post("/tokens", {"type": "card", "data": CARD, "deduplicate_token": True})
    assert twin.status in (200, 201), twin
    document = upload(c, os.urandom(300_000))
    assert document.status == 201, document
    proxy = c.post(
        "/proxies", {"name": "p", "destination_url": "https://api.example.com", "configuration": {"SECRET": "s3cr3t"}}
    )
    assert proxy.status == 201, proxy
    return {
        "token": token.json,
        "document": document.json,
        "proxy": proxy.json,
        "secret": c.get("/webhooks/signing-key").json,
    }


def _read_back(tenant, made: dict) -> dict:
    c = tenant.client
    return {
        "token": c.get(f"/tokens/{made['token']['id']}").json["data"],
        "document": c.get(f"/documents/{made['document']['id']}/data").raw,
        "proxy": c.get(f"/proxies/{made['proxy']['id']}").json["configuration"],
        "secret": c.get("/webhooks/signing-key").json,
        "twin": c.post("/tokens", {"type": "card", "data": CARD, "deduplicate_token": True}).json["id"],
    }


def _status(tenant_id) -> dict:
    with session_scope() as session:
        return service.tenant_status(session, tenant_id)


def test_a_rotation_re_encrypts_every_value_and_destroys_the_old_version(tenant):
    made = _populate(tenant)
    before = _read_back(tenant, made)
    assert before["twin"] == made["token"]["id"]  # deduplicated by fingerprint
    with session_scope() as session:
        rotation = service.start_rotation(session, tenant.id)
        assert rotation.version == 2 and rotation.total == 4  # token, document, proxy configuration, signing secret
    done = wait_until(
        lambda: (s := _status(tenant.id))["rotation"]["status"] == "completed" and s, timeout=90, interval=0.2
    )
    assert done["active_version"] == 2
    (v1,) = [v for v in done["versions"] if v["version"] == 1]
    (v2,) = [v for v in done["versions"] if v["version"] == 2]
    assert v1["state"] == "destroyed" and v1["values"] == 0 and v1["destroyed_at"]
    assert v2["state"] == "active" and v2["values"] == 4
    assert done["rotation"]["done"] == done["rotation"]["total"]
    with session_scope() as session:
        row = session.get(TenantDataKey, (tenant.id, 1))
        assert row.wrapped_key is None  # the key bytes are gone, not only flagged
        token = session.exec(select(Token).where(Token.tenant_id == tenant.id, Token.id == made["token"]["id"])).one()
        assert token.data_ct[:5] == version_head(2)
        events = [
            (a.entity_id, a.operation)
            for a in session.exec(
                select(AuditLog).where(AuditLog.tenant_id == tenant.id, AuditLog.entity_type == "key")
            ).all()
        ]
    assert ("data-key-v2", "create") in events and ("data-key-v1", "delete") in events
    get_keyring().forget(tenant.id)  # as a new process would: nothing cached
    after = _read_back(tenant, made)
    assert after == before  # every value reads back unchanged; the fingerprint still matches


def test_an_interrupted_pass_resumes_with_nothing_lost_or_sealed_twice(tenant):
    c = tenant.client
    ids = [c.post("/tokens", {"type": "token", "data": {"n": n}}).json["id"] for n in range(30)]
    saved = service.CHUNK
    service.CHUNK = 7  # several chunks, so a pass can stop between two of them
    try:
        with session_scope() as session:
            start = service.start_rotation(session, tenant.id)
            rotation_id = start.id
            job_id = start.job_id
        # a pass cut short, as a worker killed after a few chunks would leave it
        with session_scope() as session:
            job = session.get(Job, job_id)
            session.expunge(job)
        partial = service.rotate_pass(job, budget_seconds=0.0)
        assert partial is not None and partial.remaining
        done = wait_until(
            lambda: (s := _status(tenant.id))["rotation"]["status"] == "completed" and s, timeout=90, interval=0.2
        )
    finally:
        service.CHUNK = saved
    with session_scope() as session:
        rotation = session.get(KeyRotation, rotation_id)
        assert rotation.done == rotation.total  # each value counted once: none sealed twice
    assert done["versions"][0]["values"] == 0
    get_keyring().forget(tenant.id)
    assert [c.get(f"/tokens/{i}").json["data"] for i in ids] == [{"n": n} for n in range(30)]


def test_rewrap_moves_every_wrapped_key_under_the_new_master_key(tenant, new_master_key, rewrap):
    use, old, new = new_master_key
    c = tenant.client
    token = c.post("/tokens", {"type": "token", "data": {"kept": True}}).json["id"]
    assert c.get(f"/tokens/{token}").json["data"] == {"kept": True}  # served with the old key as previous
    with session_scope() as session:
        assert service.status(session)["data_keys_under_previous"] > 0
    report = rewrap()
    assert report["key_check"] == "ok" and report["wrapping"] == "master"
    use(new, None)  # the previous key removed from the settings
    with session_scope() as session:
        assert service.status(session) | {"wrapped_by": None} == {
            "wrapping": "master",
            "wrapped_by": None,
            "key_check": "ok",
            "data_keys_under_previous": 0,
        }
        rows = session.exec(select(TenantIndexKey.wrapped_by).where(TenantIndexKey.tenant_id == tenant.id)).all()
    assert rows == [get_keyring().current.wrapped_by]
    assert c.get(f"/tokens/{token}").json["data"] == {"kept": True}
    use(new, old)  # for the fixture's way back


def test_deleting_a_tenant_shreds_its_keys_then_purges_it(tenant):
    c = tenant.client
    token = c.post("/tokens", {"type": "token", "data": {"secret": "gone"}}).json["id"]
    assert upload(c, b"x" * 1000).status == 201
    with session_scope() as session:
        sealed = session.exec(select(Token.data_ct).where(Token.tenant_id == tenant.id, Token.id == token)).one()
    assert c.delete("/tenants/self").status == 204
    with session_scope() as session:
        rows = session.exec(select(TenantDataKey).where(TenantDataKey.tenant_id == tenant.id)).all()
        assert rows == [] or all(r.wrapped_key is None and r.state == "destroyed" for r in rows)
        assert session.get(TenantIndexKey, tenant.id) is None
    get_keyring().forget(tenant.id)
    with session_scope() as session, pytest.raises((DecryptionError, LookupError)):
        get_keyring().decrypt(session, tenant.id, "token", token, sealed)  # the master key is still here
    wait_until(lambda: _gone(tenant.id), timeout=60, interval=0.2)


def _gone(tenant_id: uuid.UUID) -> bool:
    with session_scope() as session:
        return session.get(Tenant, tenant_id) is None


def test_rotation_status_of_an_unknown_tenant_is_refused():
    with session_scope() as session, pytest.raises(LookupError):
        service.tenant_status(session, uuid.uuid4())
