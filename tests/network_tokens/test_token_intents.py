"""Token intents over the real HTTP API: create, read (masked), delete, expiry, conversion to a card
token, use as a network token source, permissions, tenant isolation and encryption at rest."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from sqlmodel import select

from domain.network_tokens import records
from infra.celery import celery_app
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import AuditLog
from storage.models_network_tokens import TokenIntent
from tests.helpers import wait_until

pytestmark = pytest.mark.api

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
YEAR = dt.datetime.now(dt.UTC).year + 2


def _intent(client, number: str = VISA, **data):
    body = {"number": number, "expiration_month": 5, "expiration_year": YEAR, **data}
    return client.post("/token-intents", {"type": "card", "data": body})


def _created(client, number: str = VISA, **data) -> dict:
    answer = _intent(client, number, **data)
    assert answer.status == 201, answer
    return answer.json


def _row(intent_id: str) -> TokenIntent | None:
    with session_scope() as session:
        return session.get(TokenIntent, uuid.UUID(intent_id))


def _plain(row: TokenIntent) -> dict:
    with session_scope() as session:
        raw = get_keyring().decrypt(session, row.tenant_id, "token-intent", str(row.id), row.data_ct)
    return json.loads(raw)


def test_create_read_delete_masked_and_encrypted(tenant):
    created = _created(tenant.client, cvc="123", name="Ada Lovelace")
    assert created["type"] == "card"
    assert created["tenant_id"] == str(tenant.id)
    assert created["data"] == {"number": "424242XXXXXX4242", "expiration_month": 5, "expiration_year": YEAR}
    assert created["token_id"] is None and created["converted_at"] is None
    lifetime = dt.datetime.fromisoformat(created["expires_at"]) - dt.datetime.fromisoformat(created["created_at"])
    assert lifetime == dt.timedelta(hours=24)
    assert created["created_by"] == str(tenant.application_id)

    read = tenant.client.get(f"/token-intents/{created['id']}")
    assert read.status == 200, read
    assert read.json == created

    row = _row(created["id"])
    assert VISA.encode() not in row.data_ct and b"Ada" not in row.data_ct
    assert _plain(row) == {
        "number": VISA,
        "expiration_month": 5,
        "expiration_year": YEAR,
        "cvc": "123",
        "name": "Ada Lovelace",
    }

    assert tenant.client.delete(f"/token-intents/{created['id']}").status == 204
    assert tenant.client.get(f"/token-intents/{created['id']}").status == 404
    assert tenant.client.delete(f"/token-intents/{created['id']}").status == 404
    assert _row(created["id"]) is None
    with session_scope() as session:
        logs = session.exec(select(AuditLog).where(AuditLog.entity_id == created["id"])).all()
    assert sorted(log.operation for log in logs) == ["create", "delete", "read"]
    assert {log.entity_type for log in logs} == {"token-intent"}


def test_the_fingerprint_matches_a_card_token_of_the_same_number(tenant):
    intent = _created(tenant.client)
    token = tenant.client.post("/tokens", {"type": "card", "data": {"number": VISA}}).json
    assert intent["fingerprint"] == token["fingerprint"]
    assert _created(tenant.client, MASTERCARD)["fingerprint"] != token["fingerprint"]


def test_an_expired_card_is_accepted_as_tokens_accept_it(tenant):
    expired = {"number": VISA, "expiration_month": 1, "expiration_year": 2020}
    token = tenant.client.post("/tokens", {"type": "card", "data": expired})
    intent = tenant.client.post("/token-intents", {"type": "card", "data": expired})
    assert token.status == intent.status == 201, (token, intent)
    assert intent.json["data"]["expiration_month"] == 1 and intent.json["data"]["expiration_year"] == 2020
    assert intent.json["fingerprint"] == token.json["fingerprint"]


def test_validation(tenant):
    wrong_type = tenant.client.post("/token-intents", {"type": "bank", "data": {"number": VISA}})
    assert wrong_type.status == 400 and "type" in wrong_type.json["errors"]
    bad_number = _intent(tenant.client, "4242424242424241")
    assert bad_number.status == 400 and set(bad_number.json["errors"]) == {"data.number"}
    impossible = tenant.client.post(
        "/token-intents", {"type": "card", "data": {"number": VISA, "expiration_month": 13, "expiration_year": 2020}}
    )
    assert impossible.status == 400 and set(impossible.json["errors"]) == {"data.expiration_month"}
    extra = tenant.client.post("/token-intents", {"type": "card", "data": {"number": VISA, "pin": "1"}})
    assert extra.status == 400 and "data.pin" in extra.json["errors"]
    assert tenant.client.post("/token-intents", {"type": "card"}).status == 400
    assert tenant.client.get("/token-intents/not-a-uuid").status == 404


def test_permissions_and_isolation(tenant, other_tenant, limited):
    creator = limited(tenant, ["token-intent:create"])
    reader = limited(tenant, ["token-intent:read"])
    deleter = limited(tenant, ["token-intent:delete"])
    created = _created(creator)
    path = f"/token-intents/{created['id']}"
    assert reader.get(path).status == 200
    assert creator.get(path).status == 403
    assert deleter.get(path).status == 403
    assert _intent(reader).status == 403
    assert _intent(deleter).status == 403
    assert reader.delete(path).status == 403
    assert creator.delete(path).status == 403
    for answer in (
        other_tenant.client.get(path),
        other_tenant.client.delete(path),
        other_tenant.client.post(f"{path}/convert", {}),
    ):
        assert answer.status == 404, answer
    refused = other_tenant.client.post("/network-tokens", {"token_intent_id": created["id"]})
    assert refused.status == 400 and "token_intent_id" in refused.json["errors"]
    assert deleter.delete(path).status == 204


def test_an_intent_expires_after_24_hours_and_the_sweep_removes_it(tenant):
    created = _intent(tenant.client, cvc="999").json
    keep = _created(tenant.client, cvc="321")
    with session_scope() as session:
        row = session.get(TokenIntent, uuid.UUID(created["id"]))
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        kept = session.get(TokenIntent, uuid.UUID(keep["id"]))
        kept.cvc_expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    assert tenant.client.get(f"/token-intents/{created['id']}").status == 404
    assert tenant.client.post("/network-tokens", {"token_intent_id": created["id"]}).status == 400
    assert "cvc" in _plain(_row(keep["id"]))

    celery_app.send_task(records.EXPIRE_INTENTS_TASK)  # what beat sends every minute
    wait_until(lambda: _row(created["id"]) is None)
    wait_until(lambda: _row(keep["id"]).cvc_expires_at is None)
    assert _plain(_row(keep["id"])) == {"number": VISA, "expiration_month": 5, "expiration_year": YEAR}
    assert tenant.client.get(f"/token-intents/{keep['id']}").status == 200


def test_convert_makes_a_card_token_once_and_links_network_tokens(tenant, sandbox):
    intent = _created(tenant.client, cvc="123")
    network_token = tenant.client.post("/network-tokens", {"token_intent_id": intent["id"]})
    assert network_token.status == 201, network_token
    assert network_token.json["token_intent_id"] == intent["id"]
    assert network_token.json["token_id"] is None
    assert network_token.json["card"]["last4"] == "4242"

    converted = tenant.client.post(f"/token-intents/{intent['id']}/convert", {"metadata": {"source": "intent"}})
    assert converted.status == 201, converted
    token = converted.json
    assert token["type"] == "card"
    assert token["data"] == {"number": VISA, "expiration_month": 5, "expiration_year": YEAR}  # never the cvc
    assert token["metadata"] == {"source": "intent"}
    assert tenant.client.get(f"/tokens/{token['id']}").json["data"]["number"] == VISA

    after = tenant.client.get(f"/token-intents/{intent['id']}").json
    assert after["token_id"] == token["id"] and after["converted_at"] is not None
    again = tenant.client.post(f"/token-intents/{intent['id']}/convert", {})
    assert again.status == 409
    assert again.json["token_id"] == token["id"]

    linked = tenant.client.get(f"/network-tokens/{network_token.json['id']}").json
    assert linked["token_id"] == token["id"]
    assert linked["token_intent_id"] == intent["id"]
    later = tenant.client.post("/network-tokens", {"token_intent_id": intent["id"]})  # made after the conversion
    assert later.status == 201, later
    assert later.json["token_intent_id"] == intent["id"] and later.json["token_id"] == token["id"]


def test_convert_always_updates_an_existing_duplicate(tenant):
    settings = {"deduplicate_tokens": "true", "token_deduplication_behavior": "read_existing"}
    updated = tenant.client.put("/tenants/self", {"name": "acme", "settings": settings})
    assert updated.status == 200, updated
    existing = tenant.client.post(
        "/tokens", {"type": "card", "data": {"number": VISA, "expiration_month": 1, "expiration_year": YEAR}}
    ).json
    intent = _created(tenant.client)  # the same number, another expiration
    converted = tenant.client.post(f"/token-intents/{intent['id']}/convert", {})
    assert converted.status == 201, converted
    assert converted.json["id"] == existing["id"]
    assert converted.json["data"]["expiration_month"] == 5  # update_existing despite read_existing
    assert tenant.client.get(f"/tokens/{existing['id']}").json["data"]["expiration_month"] == 5


def test_convert_rules_and_permissions(tenant, limited):
    intent = _created(tenant.client)
    path = f"/token-intents/{intent['id']}/convert"
    refused = tenant.client.post(path, {"type": "bank", "data": {}, "color": "red"})
    assert refused.status == 400
    assert refused.json["errors"] == {
        "type": ["comes from the token intent"],
        "data": ["comes from the token intent"],
        "color": ["This property is not allowed."],
    }
    assert tenant.client.post(path, ["not", "an", "object"]).status == 400
    assert limited(tenant, ["token-intent:read"]).post(path, {}).status == 403
    assert limited(tenant, ["token:pci:create"]).post(path, {}).status == 403
    both = limited(tenant, ["token-intent:read", "token:pci:create"]).post(path, {})
    assert both.status == 201, both
    assert "data" not in both.json  # no read permission on pci tokens: no data
    assert tenant.client.post(f"/token-intents/{uuid.uuid4()}/convert", {}).status == 404


def test_an_intent_without_expiration_sources_a_network_token_with_overrides(tenant, sandbox):
    answer = tenant.client.post("/token-intents", {"type": "card", "data": {"number": MASTERCARD}})
    assert answer.status == 201, answer
    intent = answer.json
    assert intent["data"]["expiration_month"] is None
    missing = tenant.client.post("/network-tokens", {"token_intent_id": intent["id"]})
    assert missing.status == 400 and set(missing.json["errors"]) == {"expiration_month", "expiration_year"}
    created = tenant.client.post(
        "/network-tokens", {"token_intent_id": intent["id"], "expiration_month": 9, "expiration_year": YEAR}
    )
    assert created.status == 201, created
    assert created.json["card"] == {
        "brand": "mastercard",
        "bin": "555555",
        "last4": "4444",
        "expiration_month": 9,
        "expiration_year": YEAR,
    }
    assert created.json["status"] == "active"
