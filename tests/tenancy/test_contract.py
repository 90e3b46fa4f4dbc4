"""The contract of every endpoint of this capability: its permission (403 without it), its OpenAPI
description, and the log rows it writes (core document sections 4, 5 and 7)."""

from __future__ import annotations

import os
import uuid

import pytest

from domain.tenancy import members
from tests.factories.documents import multipart
from tests.helpers import assert_problem

pytestmark = pytest.mark.api

ANY = str(uuid.uuid4())

#: (method, path, permission the table requires)
ENDPOINTS = [
    ("GET", "/tenants/self/security-contact", "tenant:read"),
    ("PUT", "/tenants/self/security-contact", "tenant:update"),
    ("GET", "/tenants/self/reports/usage", "report:read"),
    ("GET", "/tenants/self/members", "tenant:member:read"),
    ("DELETE", f"/tenants/self/members/{ANY}", "tenant:member:delete"),
    ("POST", "/tenants/self/invitations", "tenant:invitation:create"),
    ("GET", "/tenants/self/invitations", "tenant:invitation:read"),
    ("GET", f"/tenants/self/invitations/{ANY}", "tenant:invitation:read"),
    ("POST", f"/tenants/self/invitations/{ANY}/resend", "tenant:invitation:create"),
    ("DELETE", f"/tenants/self/invitations/{ANY}", "tenant:invitation:delete"),
    ("POST", "/keys", "keys:create"),
    ("GET", "/keys", "keys:read"),
    ("GET", f"/keys/{ANY}", "keys:read"),
    ("DELETE", f"/keys/{ANY}", "keys:delete"),
    ("POST", "/documents", "document:create"),
    ("GET", f"/documents/{ANY}", "document:read"),
    ("GET", f"/documents/{ANY}/data", "document:reveal"),
    ("DELETE", f"/documents/{ANY}", "document:delete"),
]


def _call(client, method: str, path: str):
    if path == "/documents" and method == "POST":
        body, ct = multipart(b"x")
        return client.request(method, path, raw=body, content_type=ct)
    body = {"email": "a@example.com"} if method in ("POST", "PUT") and "keys" not in path else None
    return client.request(method, path, {} if path == "/keys" and method == "POST" else body)


def test_every_endpoint_needs_its_permission(tenant, limited):
    unrelated = limited(tenant, ["log:read"])
    for method, path, permission in ENDPOINTS:
        body = assert_problem(_call(unrelated, method, path), 403)
        assert permission in body["detail"], (method, path, body)
        assert_problem(_call(tenant.client.with_key(None), method, path), 401)


def test_the_accept_endpoints_need_no_key(api):
    client = api.client()
    assert_problem(client.post("/invitations/accept", {"token": "inv_unknown"}), 404)
    assert_problem(client.get("/invitations/accept?token=inv_unknown"), 404)


def test_openapi_describes_every_endpoint(api):
    doc = api.client().get("/openapi.json").json
    for method, path, permission in ENDPOINTS:
        template = path.replace(ANY, "{id}")
        operation = doc["paths"][template][method.lower()]
        assert permission in operation["x-permission"], (method, template)
    for method in ("get", "post"):
        assert doc["paths"]["/invitations/accept"][method]["description"].startswith("No API key required.")
    upload = doc["paths"]["/documents"]["post"]
    schema = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert schema["required"] == ["document"]
    assert {"413", "429", "415"} <= set(upload["responses"])
    assert "application/octet-stream" in doc["paths"]["/documents/{id}/data"]["get"]["responses"]["200"]["content"]
    resend = doc["paths"]["/tenants/self/invitations/{id}/resend"]["post"]
    assert "tenant:invitation:create and tenant:invitation:update" in resend["x-permission"]
    members_list = doc["paths"]["/tenants/self/members"]["get"]
    size = next(p for p in members_list["parameters"] if p["name"] == "size")
    assert size["schema"]["maximum"] == 50
    user_id = next(p for p in members_list["parameters"] if p["name"] == "user_id")
    assert user_id["schema"]["type"] == "array"
    key = doc["components"]["schemas"]["KeyCreatedOut"]
    assert {"public_key_pem", "public_key_jwk"} <= set(key["properties"])


def test_log_rows_name_the_new_entities(tenant):
    email = f"log-{os.urandom(3).hex()}@example.com"
    invitation = tenant.client.post("/tenants/self/invitations", {"email": email}).json
    key = tenant.client.post("/keys", {}).json
    body, ct = multipart(b"doc")
    document = tenant.client.post("/documents", raw=body, content_type=ct).json
    expected = {
        "tenant_invitation": invitation["id"],
        "client_encryption_key": key["key_id"],
        "document": document["id"],
    }
    for entity_type, entity_id in expected.items():
        rows = tenant.client.get(f"/logs?entity_type={entity_type}").json["data"]
        assert [(r["entity_id"], r["operation"], r["actor_id"]) for r in rows] == [
            (entity_id, "create", str(tenant.application_id))
        ]
    assert tenant.client.delete(f"/tenants/self/invitations/{invitation['id']}").status == 204


def test_entity_types_are_listed(tenant):
    listed = {t["value"]: t["display_name"] for t in tenant.client.get("/logs/entity-types").json}
    assert {value: listed.get(value) for value in members.ENTITY_TYPES} == members.ENTITY_TYPES
