"""Client encryption keys over HTTP and the decryption service the proxy uses, with JWEs made by joserfc
from the returned public key (core document section 4: Client encryption keys; Proxy rule 8)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid

import pytest
from cryptography.hazmat.primitives import serialization
from joserfc import jwe
from joserfc.jwk import OKPKey
from sqlmodel import select

from domain.client_keys import service as client_keys
from domain.client_keys.errors import EncryptedPayloadError
from storage.db import session_scope
from storage.models import AuditLog
from storage.models_client_keys import ClientEncryptionKey
from tests.helpers import assert_problem

pytestmark = pytest.mark.api

CARD = {"data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2030}}


def _key(tenant, **body) -> dict:
    answer = tenant.client.post("/keys", body)
    assert answer.status == 201, answer
    return answer.json


def _encrypt(key: dict, payload, *, header: dict | None = None, algorithms=("ECDH-ES", "A256GCM")) -> str:
    """A compact JWE made by joserfc from the PEM the API returned."""
    public = OKPKey.import_key(key["public_key_pem"])
    protected = {"alg": "ECDH-ES", "enc": "A256GCM", "kid": key["key_id"], **(header or {})}
    plaintext = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    registry = jwe.JWERegistry(algorithms=list(algorithms))
    registry.max_ciphertext_length = 1 << 22  # let the test make oversized JWEs
    return jwe.encrypt_compact(protected, plaintext, public, registry=registry)


def _header(value) -> str:
    return base64.b64encode(json.dumps(value).encode()).decode()


def _decrypt(tenant, value: str, **kw):
    with session_scope() as session:
        return client_keys.decrypt_encrypted_header(session, tenant.id, value, **kw)


def _refused(tenant, value: str) -> dict:
    with pytest.raises(EncryptedPayloadError) as caught:
        _decrypt(tenant, value)
    problem = caught.value
    assert problem.status == 400
    return problem.body()


# ---- the key endpoints ---------------------------------------------------------------------------


def test_create_returns_the_public_key_once(tenant):
    before = dt.datetime.now(dt.UTC)
    key = _key(tenant)
    assert set(key) == {"key_id", "expires_at", "created_by", "created_at", "public_key_pem", "public_key_jwk"}
    uuid.UUID(key["key_id"])
    assert key["created_by"] == str(tenant.application_id)
    life = dt.datetime.fromisoformat(key["expires_at"]) - before
    assert dt.timedelta(days=181, hours=23) < life < dt.timedelta(days=182, minutes=5)  # about 6 months

    public = serialization.load_pem_public_key(key["public_key_pem"].encode())
    assert key["public_key_pem"].startswith("-----BEGIN PUBLIC KEY-----")
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    jwk = key["public_key_jwk"]
    assert jwk == {
        "kty": "OKP",
        "crv": "X25519",
        "x": base64.urlsafe_b64encode(raw).rstrip(b"=").decode(),
        "kid": key["key_id"],
        "use": "enc",
        "alg": "ECDH-ES",
    }

    read = tenant.client.get(f"/keys/{key['key_id']}")
    assert read.status == 200
    assert read.json == {k: key[k] for k in ("key_id", "expires_at", "created_by", "created_at")}
    listed = tenant.client.get("/keys")
    assert listed.status == 200
    assert listed.json == [read.json]
    assert "PUBLIC KEY" not in listed.raw.decode() + read.raw.decode()


def test_the_private_key_is_sealed_at_rest(tenant):
    key = _key(tenant)
    with session_scope() as session:
        row = session.get(ClientEncryptionKey, uuid.UUID(key["key_id"]))
        # the envelope: layout byte, data key version, nonce, the 32-byte key sealed, the tag
        assert row.private_key_ct is not None and len(row.private_key_ct) == 1 + 4 + 12 + 32 + 16
        moved = ClientEncryptionKey(
            tenant_id=row.tenant_id, expires_at=row.expires_at, private_key_ct=row.private_key_ct
        )
        session.add(moved)
    # a sealed key copied to another row does not open (the key id is bound in)
    token = _encrypt({**key, "key_id": str(moved.id)}, CARD)
    with session_scope() as session, pytest.raises(client_keys.Problem) as caught:
        client_keys.decrypt_jwe(session, tenant.id, token)
    assert caught.value.status == 500


def test_explicit_expiry_and_its_bounds(tenant):
    now = dt.datetime.now(dt.UTC)
    at = (now + dt.timedelta(days=30)).replace(microsecond=0)
    assert dt.datetime.fromisoformat(_key(tenant, expires_at=at.isoformat())["expires_at"]) == at
    year = (now + dt.timedelta(days=364)).replace(tzinfo=None).isoformat()  # no offset: UTC
    assert _key(tenant, expires_at=year)["expires_at"].startswith(year[:16])
    for value, message in [
        ((now + dt.timedelta(days=367)).isoformat(), "1 year"),
        ((now - dt.timedelta(minutes=1)).isoformat(), "future"),
        ("next tuesday", "ISO 8601 date-time"),
    ]:
        body = assert_problem(tenant.client.post("/keys", {"expires_at": value}), 400)
        assert message in " ".join(body["errors"]["expires_at"])
    assert "kty" in assert_problem(tenant.client.post("/keys", {"kty": "RSA"}), 400)["errors"]
    assert len(tenant.client.get("/keys").json) == 2


def test_delete_and_tenant_isolation(tenant, other_tenant, limited):
    key = _key(tenant)
    path = f"/keys/{key['key_id']}"
    assert_problem(other_tenant.client.get(path), 404)
    assert_problem(other_tenant.client.delete(path), 404)
    assert other_tenant.client.get("/keys").json == []
    assert_problem(tenant.client.get("/keys/not-a-uuid"), 404)

    reader = limited(tenant, ["keys:read"])
    assert_problem(reader.post("/keys", {}), 403)
    assert_problem(reader.delete(path), 403)
    assert reader.get(path).status == 200 and reader.get("/keys").status == 200
    creator = limited(tenant, ["keys:create"])
    assert creator.post("/keys", {}).status == 201
    assert_problem(creator.get("/keys"), 403)
    assert_problem(creator.get(path), 403)
    assert_problem(limited(tenant, ["keys:create", "keys:read"]).delete(path), 403)

    assert limited(tenant, ["keys:delete"]).delete(path).status == 204
    assert_problem(tenant.client.get(path), 404)
    assert_problem(tenant.client.delete(path), 404)
    assert key["key_id"] not in [k["key_id"] for k in tenant.client.get("/keys").json]
    with session_scope() as session:
        row = session.get(ClientEncryptionKey, uuid.UUID(key["key_id"]))
        assert row.private_key_ct is None and row.deleted_at is not None
        operations = session.exec(
            select(AuditLog.operation).where(
                AuditLog.entity_type == "client_encryption_key", AuditLog.entity_id == key["key_id"]
            )
        ).all()
        assert sorted(operations) == ["create", "delete", "read"]  # the one successful GET /keys/{id}


# ---- decryption ----------------------------------------------------------------------------------


def test_single_form_round_trip(tenant):
    key = _key(tenant)
    value = _header({"type": "card", "encrypted": _encrypt(key, {**CARD, "metadata": {"m": "1"}})})
    opened = _decrypt(tenant, value)
    assert opened.form == "single"
    assert opened.value == {"type": "card", **CARD, "metadata": {"m": "1"}}
    # URL-safe base64 without padding is accepted too
    url_safe = base64.urlsafe_b64encode(base64.b64decode(value)).rstrip(b"=").decode()
    assert _decrypt(tenant, url_safe).value == opened.value


def test_multiple_form_round_trip(tenant):
    first, second = _key(tenant), _key(tenant)
    value = _header(
        {
            "card": {"type": "card", "encrypted": _encrypt(first, CARD)},
            "account": {"type": "bank", "encrypted": _encrypt(second, {"data": {"account_number": "123"}})},
        }
    )
    opened = _decrypt(tenant, value)
    assert opened.form == "multiple"
    assert opened.value == {
        "card": {"type": "card", **CARD},
        "account": {"type": "bank", "data": {"account_number": "123"}},
    }


def test_an_expired_key_is_refused(tenant):
    key = _key(tenant)
    value = _header({"type": "card", "encrypted": _encrypt(key, CARD)})
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=183)
    with pytest.raises(EncryptedPayloadError) as caught:
        _decrypt(tenant, value, now=later)
    assert caught.value.extra["code"] == "key_expired"
    assert "expired" in caught.value.detail
    with session_scope() as session:
        row = session.get(ClientEncryptionKey, uuid.UUID(key["key_id"]))
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(row)
    assert _refused(tenant, value)["code"] == "key_expired"


def test_a_deleted_key_is_refused(tenant):
    key = _key(tenant)
    value = _header({"type": "card", "encrypted": _encrypt(key, CARD)})
    assert tenant.client.delete(f"/keys/{key['key_id']}").status == 204
    body = _refused(tenant, value)
    assert body["code"] == "key_deleted" and "deleted" in body["detail"]


def test_unknown_kid_and_another_tenants_key_are_refused(tenant, other_tenant):
    mine = _key(tenant)
    theirs = _key(other_tenant)
    for kid in (str(uuid.uuid4()), "not-a-uuid"):
        body = _refused(tenant, _header({"type": "card", "encrypted": _encrypt({**mine, "key_id": kid}, CARD)}))
        assert body["code"] == "unknown_key"
        assert kid in body["detail"]
    body = _refused(tenant, _header({"type": "card", "encrypted": _encrypt(theirs, CARD)}))
    assert body["code"] == "unknown_key"


@pytest.mark.parametrize(
    ("header", "algorithms"),
    [
        ({"alg": "ECDH-ES+A256KW"}, ("ECDH-ES+A256KW", "A256GCM")),
        ({"enc": "A128GCM"}, ("ECDH-ES", "A128GCM")),
        ({"enc": "A256CBC-HS512"}, ("ECDH-ES", "A256CBC-HS512")),
    ],
)
def test_algorithms_outside_the_allow_list_are_refused(tenant, header, algorithms):
    key = _key(tenant)
    body = _refused(
        tenant, _header({"type": "card", "encrypted": _encrypt(key, CARD, header=header, algorithms=algorithms)})
    )
    assert body["code"] == "algorithm_not_allowed"
    assert "ECDH-ES" in body["detail"] and "A256GCM" in body["detail"]


def test_a_forged_none_or_symmetric_header_is_refused(tenant):
    key = _key(tenant)
    genuine = _encrypt(key, CARD).split(".")
    for alg in ("none", "dir", "A256KW"):
        forged = {"alg": alg, "enc": "A256GCM", "kid": key["key_id"]}
        genuine[0] = base64.urlsafe_b64encode(json.dumps(forged).encode()).rstrip(b"=").decode()
        body = _refused(tenant, _header({"type": "card", "encrypted": ".".join(genuine)}))
        assert body["code"] == "algorithm_not_allowed"


def test_compressed_jwes_are_refused(tenant):
    key = _key(tenant)
    token = _encrypt(key, CARD, header={"zip": "DEF"}, algorithms=("ECDH-ES", "A256GCM", "DEF"))
    body = _refused(tenant, _header({"type": "card", "encrypted": token}))
    assert body["code"] == "compression_not_allowed"
    assert "zip" in body["detail"]


def test_oversized_jwes_and_headers_are_refused(tenant):
    key = _key(tenant)
    big = {"data": {"blob": "x" * (client_keys.MAX_JWE_BYTES)}}
    body = _refused(tenant, _header({"type": "token", "encrypted": _encrypt(key, big)}))
    assert body["code"] == "encrypted_payload_too_large"
    assert str(client_keys.MAX_JWE_BYTES) in body["detail"]
    body = _refused(tenant, "A" * (client_keys.MAX_HEADER_BYTES + 1))
    assert body["code"] == "encrypted_payload_too_large"
    many = {f"n{i}": {"type": "token", "encrypted": "a.b.c.d.e"} for i in range(client_keys.MAX_ENTRIES + 1)}
    assert "At most" in _refused(tenant, _header(many))["detail"]


def test_tampered_and_malformed_values_are_refused(tenant):
    key = _key(tenant)
    token = _encrypt(key, CARD)
    parts = token.split(".")
    parts[3] = ("B" if parts[3][0] != "B" else "C") + parts[3][1:]
    assert _refused(tenant, _header({"type": "card", "encrypted": ".".join(parts)}))["code"] == "decryption_failed"
    assert "not base64" in _refused(tenant, "%%%")["detail"]
    assert "five" in _refused(tenant, _header({"type": "card", "encrypted": "abc"}))["detail"]
    assert "type" in _refused(tenant, _header({"type": "pdf", "encrypted": token}))["errors"]
    body = _refused(tenant, _header({"type": "card", "encrypted": _encrypt(key, ["not", "an", "object"])}))
    assert "data" in body["detail"]
    body = _refused(tenant, _header({"type": "card", "encrypted": _encrypt(key, {"type": "bank", "data": {}})}))
    assert "bank" in body["detail"]
    body = _refused(tenant, _header({"x": {"type": "card", "encrypted": token, "extra": 1}}))
    assert "extra" in body["detail"] and "x" in body["errors"]


def test_create_takes_no_body_at_all(tenant):
    answer = tenant.client.request("POST", "/keys")  # no body, no content type: every field is optional
    assert answer.status == 201, answer
    created = dt.datetime.fromisoformat(answer.json["created_at"])
    expires = dt.datetime.fromisoformat(answer.json["expires_at"])
    assert 180 <= (expires - created).days <= 184
    assert answer.json["public_key_pem"].startswith("-----BEGIN PUBLIC KEY-----")
    assert_problem(tenant.client.post("/keys", raw=b"{bad", content_type="application/json"), 400)
