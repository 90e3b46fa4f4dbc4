"""``/tenants/self``: read, update (name and string-valued settings), delete (spec, core document
sections 2 Tenant and 4 Tenants)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_problem

pytestmark = pytest.mark.api

DEFAULTS = {
    "fingerprint_tokens": "false",
    "disable_ephemeral_proxy": "false",
    "deduplicate_tokens": "false",
    "token_deduplication_behavior": "update_existing",
}


def test_get_self(api, tenant):
    answer = tenant.client.get("/tenants/self")
    assert answer.status == 200, answer
    body = answer.json
    assert body["id"] == str(tenant.id)
    assert body["name"] == "acme"
    assert body["type"] == "test"
    assert body["owner_id"]
    assert body["settings"] == DEFAULTS
    assert body["created_at"]


def test_each_key_sees_its_own_tenant(api, tenant, other_tenant):
    assert tenant.client.get("/tenants/self").json["id"] == str(tenant.id)
    assert other_tenant.client.get("/tenants/self").json["id"] == str(other_tenant.id)


def test_put_name_and_settings(api, tenant):
    answer = tenant.client.put(
        "/tenants/self",
        {
            "name": "renamed",
            "settings": {"fingerprint_tokens": "true", "token_deduplication_behavior": "read_existing"},
        },
    )
    assert answer.status == 200, answer
    expected = {**DEFAULTS, "fingerprint_tokens": "true", "token_deduplication_behavior": "read_existing"}
    assert answer.json["name"] == "renamed"
    assert answer.json["settings"] == expected
    assert answer.json["modified_by"] == str(tenant.application_id)
    assert answer.json["modified_at"]

    again = tenant.client.get("/tenants/self").json
    assert again["name"] == "renamed" and again["settings"] == expected

    # settings not sent keep their values; a value can be set back to 'false'
    answer = tenant.client.put(
        "/tenants/self", {"name": "renamed", "settings": {"fingerprint_tokens": "false", "deduplicate_tokens": "true"}}
    )
    assert answer.json["settings"] == {**expected, "fingerprint_tokens": "false", "deduplicate_tokens": "true"}
    # a PUT without settings keeps them all
    answer = tenant.client.put("/tenants/self", {"name": "third"})
    assert answer.status == 200
    assert answer.json["name"] == "third"
    assert answer.json["settings"]["deduplicate_tokens"] == "true"


def test_every_setting_accepts_its_strings(api, tenant):
    for name in ("fingerprint_tokens", "disable_ephemeral_proxy", "deduplicate_tokens"):
        for value in ("true", "false"):
            answer = tenant.client.put("/tenants/self", {"name": "acme", "settings": {name: value}})
            assert answer.status == 200, answer
            assert answer.json["settings"][name] == value
    for value in ("read_existing", "update_existing"):
        answer = tenant.client.put(
            "/tenants/self", {"name": "acme", "settings": {"token_deduplication_behavior": value}}
        )
        assert answer.json["settings"]["token_deduplication_behavior"] == value


@pytest.mark.parametrize(
    ("settings", "bad"),
    [
        ({"fingerprint_tokens": True}, ["settings.fingerprint_tokens"]),
        (
            {"disable_ephemeral_proxy": False, "deduplicate_tokens": True},
            ["settings.disable_ephemeral_proxy", "settings.deduplicate_tokens"],
        ),
        ({"fingerprint_tokens": 1}, ["settings.fingerprint_tokens"]),
        ({"fingerprint_tokens": "yes"}, ["settings.fingerprint_tokens"]),
        ({"fingerprint_tokens": "TRUE"}, ["settings.fingerprint_tokens"]),
        ({"token_deduplication_behavior": "merge"}, ["settings.token_deduplication_behavior"]),
        ({"colour": "blue"}, ["settings.colour"]),
        ({"fingerprint_tokens": "true", "colour": "blue"}, ["settings.colour"]),
        ({"fingerprint_tokens": None}, ["settings.fingerprint_tokens"]),
    ],
)
def test_bad_settings_are_400_per_field_and_change_nothing(api, tenant, settings, bad):
    before = tenant.client.get("/tenants/self").json
    answer = tenant.client.put("/tenants/self", {"name": "should not stick", "settings": settings})
    body = assert_problem(answer, 400)
    assert sorted(body["errors"]) == sorted(bad), body
    for field in bad:
        assert body["errors"][field] and all(isinstance(m, str) for m in body["errors"][field])
    after = tenant.client.get("/tenants/self").json
    assert after["name"] == before["name"] == "acme"
    assert after["settings"] == before["settings"]
    assert after.get("modified_at") == before.get("modified_at")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "n" * 201}, "name"),
        ({"name": "nul\u0000byte"}, "name"),
        ({"name": "ok", "settings": ["fingerprint_tokens"]}, "settings"),
        ({"name": "ok", "type": "production"}, "type"),
        ({"name": "ok", "owner_id": "00000000-0000-0000-0000-000000000000"}, "owner_id"),
    ],
)
def test_put_validation(api, tenant, body, field):
    problem = assert_problem(tenant.client.put("/tenants/self", body), 400)
    assert field in problem["errors"], problem
    after = tenant.client.get("/tenants/self").json
    assert after["name"] == "acme" and after["type"] == "test"


def test_name_of_200_characters(api, tenant):
    answer = tenant.client.put("/tenants/self", {"name": "n" * 200})
    assert answer.status == 200 and answer.json["name"] == "n" * 200


def test_permissions(api, tenant, limited):
    reader = limited(tenant, ["tenant:read"])
    assert reader.get("/tenants/self").status == 200
    body = assert_problem(reader.put("/tenants/self", {"name": "x"}), 403)
    assert "tenant:update" in body["detail"]
    body = assert_problem(reader.delete("/tenants/self"), 403)
    assert "tenant:delete" in body["detail"]
    writer = limited(tenant, ["tenant:update"])
    body = assert_problem(writer.get("/tenants/self"), 403)
    assert "tenant:read" in body["detail"]
    assert writer.put("/tenants/self", {"name": "by writer"}).status == 200
    assert tenant.client.get("/tenants/self").json["name"] == "by writer"


def test_update_and_read_are_logged(api, tenant):
    tenant.client.get("/tenants/self")
    tenant.client.put("/tenants/self", {"name": "logged"})
    rows = tenant.client.get(f"/logs?entity_type=tenant&entity_id={tenant.id}").json["data"]
    assert [r["operation"] for r in rows] == ["update", "read"]


def test_delete_stops_every_key(api, tenant, other_tenant, limited):
    second_app = tenant.client.post(
        "/applications", {"name": "second", "type": "server_to_server", "permissions": ["tenant:read"]}
    ).json
    extra_key = tenant.client.post(f"/applications/{second_app['id']}/keys").json["key"]
    reader = limited(tenant, ["log:read"])
    keys = [tenant.api_key, second_app["key"], extra_key, reader.api_key]
    for key in keys:
        assert tenant.client.with_key(key).get("/applications/key").status in (200, 403)

    answer = tenant.client.delete("/tenants/self")
    assert answer.status == 204, answer
    assert answer.raw == b""

    for key in keys:
        client = tenant.client.with_key(key)
        assert_problem(client.get("/tenants/self"), 401)
        assert_problem(client.get("/logs"), 401)
    # another tenant is not affected
    assert other_tenant.client.get("/tenants/self").status == 200
