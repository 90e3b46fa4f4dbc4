"""``/applications``: create, list, read, update, delete, keys and their rotation (spec, core document
sections 2 Application, 4 Applications, 5 Authentication, 9 regenerate)."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import assert_problem

pytestmark = pytest.mark.api


def create(client, *, name="app", type="server_to_server", permissions=None):
    answer = client.post("/applications", {"name": name, "type": type, "permissions": permissions or []})
    assert answer.status == 201, answer
    return answer.json


def log_rows(tenant, **filters) -> list[dict]:
    query = "&".join(f"{k}={v}" for k, v in {"size": 100, **filters}.items())
    answer = tenant.client.get(f"/logs?{query}")
    assert answer.status == 200, answer
    return answer.json["data"]


# ---- create ------------------------------------------------------------------------------------------


def test_create_returns_the_key_once(api, tenant):
    created = create(tenant.client, name="backend", permissions=["application:read", "log:read"])
    assert created["name"] == "backend"
    assert created["type"] == "server_to_server"
    assert created["tenant_id"] == str(tenant.id)
    assert sorted(created["permissions"]) == ["application:read", "log:read"]
    assert created["created_by"] == str(tenant.application_id)
    assert created["created_at"]
    key = created["key"]
    assert isinstance(key, str) and len(key) >= 40

    # the key works and belongs to the new application
    own = tenant.client.with_key(key).get("/applications/key")
    assert own.status == 200, own
    assert own.json["id"] == created["id"]

    # it is never shown again
    fetched = tenant.client.get(f"/applications/{created['id']}")
    assert fetched.status == 200
    assert "key" not in fetched.json or fetched.json["key"] is None
    listed = tenant.client.get("/applications").json["data"]
    assert all(a.get("key") is None for a in listed)
    assert key not in tenant.client.get("/applications").raw.decode()
    assert key not in tenant.client.get(f"/applications/{created['id']}/keys").raw.decode()


@pytest.mark.parametrize("app_type", ["server_to_server", "management", "private"])
def test_create_each_server_type(api, tenant, app_type):
    created = create(tenant.client, type=app_type, permissions=["tenant:read"])
    assert created["type"] == app_type
    assert tenant.client.with_key(created["key"]).get("/tenants/self").status == 200


def test_permissions_default_to_none(api, tenant):
    answer = tenant.client.post("/applications", {"name": "bare", "type": "server_to_server"})
    assert answer.status == 201, answer
    assert answer.json["permissions"] == []
    bare = tenant.client.with_key(answer.json["key"])
    assert_problem(bare.get("/tenants/self"), 403)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"type": "public"}, "name"),
        ({"name": "x"}, "type"),
        ({"name": "", "type": "public"}, "name"),
        ({"name": "n" * 201, "type": "public"}, "name"),
        ({"name": "x", "type": "robot"}, "type"),
        ({"name": "x", "type": "public", "permissions": "token:general:create"}, "permissions"),
        ({"name": "x", "type": "public", "permissions": [1]}, "permissions[0]"),
        ({"name": "nul\u0000byte", "type": "public"}, "name"),
    ],
)
def test_create_validation(api, tenant, body, field):
    body_ = assert_problem(tenant.client.post("/applications", body), 400)
    assert field in body_["errors"], body_


def test_name_of_200_characters_is_accepted(api, tenant):
    assert create(tenant.client, name="n" * 200)["name"] == "n" * 200


@pytest.mark.parametrize(
    ("legacy", "replacement"),
    [
        ("token:create", "token:general:create"),
        ("token:read", "token:general:read:low"),
        ("token:decrypt", "token:general:read:high"),
        ("token:use", "token:general:use:proxy"),
        ("card:read", "token:pci:read:low"),
        ("bank:decrypt", "token:bank:read:high"),
    ],
)
def test_legacy_permission_names_are_mapped_to_their_replacement(api, tenant, legacy, replacement):
    """A new grant naming a legacy permission (section 5.4) stores and returns the granular name, and
    the answer says the legacy name is deprecated (RFC 9745)."""
    answer = tenant.client.post(
        "/applications", {"name": "old", "type": "server_to_server", "permissions": [legacy, replacement]}
    )
    assert answer.status == 201, answer
    assert answer.json["permissions"] == [replacement]
    assert answer.headers["Deprecation"] == "@1641168000"
    stored = tenant.client.get(f"/applications/{answer.json['id']}")
    assert stored.json["permissions"] == [replacement]
    assert "Deprecation" not in stored.headers
    plain = tenant.client.post(
        "/applications", {"name": "new", "type": "server_to_server", "permissions": [replacement]}
    )
    assert plain.status == 201 and "Deprecation" not in plain.headers


def test_card_decrypt_never_existed(api, tenant):
    answer = tenant.client.post(
        "/applications", {"name": "old", "type": "server_to_server", "permissions": ["card:decrypt"]}
    )
    body = assert_problem(answer, 400)
    assert "card:decrypt" in " ".join(body["errors"]["permissions"])


def test_unknown_permission_is_refused(api, tenant):
    answer = tenant.client.post(
        "/applications",
        {"name": "x", "type": "server_to_server", "permissions": ["log:read", "everything:please"]},
    )
    body = assert_problem(answer, 400)
    assert list(body["errors"]) == ["permissions"]
    messages = body["errors"]["permissions"]
    assert len(messages) == 1 and "everything:please" in messages[0]
    names = [a["name"] for a in tenant.client.get("/applications").json["data"]]
    assert "x" not in names


@pytest.mark.parametrize("app_type", ["public", "elements"])
def test_client_side_applications_hold_create_permissions_only(api, tenant, app_type):
    created = create(tenant.client, type=app_type, permissions=["token:pci:create", "token:general:create"])
    assert created["type"] == app_type
    for refused in ["token:pci:read:low", "application:read", "token:general:use:proxy", "log:read"]:
        answer = tenant.client.post(
            "/applications",
            {"name": "browser", "type": app_type, "permissions": ["token:general:create", refused]},
        )
        body = assert_problem(answer, 400)
        assert refused in " ".join(body["errors"]["permissions"])
    # and an update cannot widen them either
    answer = tenant.client.put(f"/applications/{created['id']}", {"name": "browser", "permissions": ["tenant:read"]})
    assert_problem(answer, 400)
    assert tenant.client.get(f"/applications/{created['id']}").json["permissions"] == sorted(
        ["token:pci:create", "token:general:create"]
    )


# ---- list ----------------------------------------------------------------------------------------------


def test_list_offset_pagination(api, tenant):
    made = [create(tenant.client, name=f"app-{i}")["id"] for i in range(4)]
    everyone = {str(tenant.application_id), *made}

    first = tenant.client.get("/applications?size=2")
    assert first.status == 200, first
    assert first.json["pagination"] == {"total_items": 5, "page_number": 1, "page_size": 2, "total_pages": 3}
    seen = [a["id"] for a in first.json["data"]]
    for page in (2, 3):
        answer = tenant.client.get(f"/applications?size=2&page={page}")
        assert answer.json["pagination"]["page_number"] == page
        seen += [a["id"] for a in answer.json["data"]]
    assert len(seen) == 5 and set(seen) == everyone
    past = tenant.client.get("/applications?size=2&page=4").json
    assert past["data"] == [] and past["pagination"]["total_items"] == 5

    default = tenant.client.get("/applications").json
    assert default["pagination"]["page_size"] == 20 and default["pagination"]["page_number"] == 1
    assert len(default["data"]) == 5
    for item in default["data"]:
        assert {"id", "tenant_id", "name", "type", "permissions", "created_at"} <= set(item)


def test_list_filters_by_id(api, tenant, other_tenant):
    a, b, _ = (create(tenant.client, name=n)["id"] for n in "abc")
    foreign = create(other_tenant.client, name="foreign")["id"]
    answer = tenant.client.get(f"/applications?id={a}&id={b}&id={foreign}")
    assert answer.status == 200
    assert {x["id"] for x in answer.json["data"]} == {a, b}
    assert answer.json["pagination"]["total_items"] == 2
    one = tenant.client.get(f"/applications?id={a}").json
    assert [x["id"] for x in one["data"]] == [a]


@pytest.mark.parametrize(
    "query",
    ["size=0", "size=101", "page=0", "page=x", "id=not-a-uuid", "page=1000000000000000000", "page=" + "9" * 30],
)
def test_list_bad_query_is_400(api, tenant, query):
    assert_problem(tenant.client.get(f"/applications?{query}"), 400)


def test_list_shows_only_own_tenant(api, tenant, other_tenant):
    create(other_tenant.client, name="foreign")
    ids = {a["id"] for a in tenant.client.get("/applications").json["data"]}
    assert ids == {str(tenant.application_id)}


# ---- read ----------------------------------------------------------------------------------------------


def test_get_by_id(api, tenant):
    created = create(tenant.client, name="reader", permissions=["log:read"])
    answer = tenant.client.get(f"/applications/{created['id']}")
    assert answer.status == 200
    expected = {k: v for k, v in created.items() if k != "key"}
    assert {k: answer.json.get(k) for k in expected} == expected


def test_get_of_the_calling_key(api, tenant, limited):
    answer = tenant.client.get("/applications/key")
    assert answer.status == 200
    assert answer.json["id"] == str(tenant.application_id)
    assert answer.json["type"] == "management"
    assert "key" not in answer.json or answer.json["key"] is None
    reader = limited(tenant, ["application:read"])
    mine = reader.get("/applications/key").json
    assert mine["id"] != str(tenant.application_id) and mine["permissions"] == ["application:read"]


def test_unknown_application_is_404(api, tenant):
    assert_problem(tenant.client.get(f"/applications/{uuid.uuid4()}"), 404)
    assert_problem(tenant.client.get("/applications/not-a-uuid"), 404)


def test_other_tenants_application_is_404(api, tenant, other_tenant):
    foreign = create(other_tenant.client, name="foreign", permissions=["tenant:read"])
    path = f"/applications/{foreign['id']}"
    missing = tenant.client.get(f"/applications/{uuid.uuid4()}").json
    for answer in (
        tenant.client.get(path),
        tenant.client.put(path, {"name": "mine now", "permissions": []}),
        tenant.client.delete(path),
        tenant.client.post(f"{path}/keys"),
        tenant.client.get(f"{path}/keys"),
    ):
        body = assert_problem(answer, 404)
        assert body["detail"] == missing["detail"], "answered exactly like a missing one"
    # untouched and still working
    still = other_tenant.client.get(path).json
    assert still["name"] == "foreign" and still["permissions"] == ["tenant:read"]
    assert other_tenant.client.with_key(foreign["key"]).get("/tenants/self").status == 200


# ---- update and delete ---------------------------------------------------------------------------------


def test_update_replaces_name_and_permissions(api, tenant):
    created = create(tenant.client, name="before", permissions=["tenant:read"])
    client = tenant.client.with_key(created["key"])
    assert client.get("/tenants/self").status == 200
    assert_problem(client.get("/logs"), 403)

    answer = tenant.client.put(f"/applications/{created['id']}", {"name": "after", "permissions": ["log:read"]})
    assert answer.status == 200, answer
    assert answer.json["name"] == "after"
    assert answer.json["permissions"] == ["log:read"]
    assert answer.json["type"] == created["type"]
    assert answer.json["modified_by"] == str(tenant.application_id)
    assert answer.json["modified_at"] >= created["created_at"]
    assert "key" not in answer.json or answer.json["key"] is None

    assert tenant.client.get(f"/applications/{created['id']}").json["name"] == "after"
    # the key's permissions changed at once
    assert client.get("/logs").status == 200
    assert_problem(client.get("/tenants/self"), 403)


def test_update_validation(api, tenant):
    created = create(tenant.client, name="keep", permissions=["tenant:read"])
    path = f"/applications/{created['id']}"
    assert_problem(tenant.client.put(path, {"name": "x", "permissions": ["card:decrypt"]}), 400)
    assert_problem(tenant.client.put(path, {"name": "x", "permissions": ["nope"]}), 400)
    body = assert_problem(tenant.client.put(path, {"name": "x", "type": "public"}), 400)
    assert "type" in body["errors"]
    assert_problem(tenant.client.put(path, {"permissions": []}), 400)
    body = assert_problem(tenant.client.put(path, {"name": "a\u0000b", "permissions": []}), 400)
    assert "name" in body["errors"]
    unchanged = tenant.client.get(path).json
    assert unchanged["name"] == "keep" and unchanged["permissions"] == ["tenant:read"]
    # a legacy name is mapped to its replacement (not refused)
    legacy = tenant.client.put(path, {"name": "keep", "permissions": ["token:create"]})
    assert legacy.status == 200 and legacy.json["permissions"] == ["token:general:create"], legacy
    assert legacy.headers["Deprecation"] == "@1641168000"


def test_delete_stops_its_key(api, tenant):
    created = create(tenant.client, name="doomed", permissions=["tenant:read"])
    client = tenant.client.with_key(created["key"])
    assert client.get("/tenants/self").status == 200
    answer = tenant.client.delete(f"/applications/{created['id']}")
    assert answer.status == 204, answer
    assert answer.raw == b""
    assert_problem(client.get("/tenants/self"), 401)
    assert_problem(tenant.client.get(f"/applications/{created['id']}"), 404)
    assert_problem(tenant.client.delete(f"/applications/{created['id']}"), 404)
    # the caller's own key is unaffected
    assert tenant.client.get("/tenants/self").status == 200


def test_delete_stops_every_key(api, tenant):
    created = create(tenant.client, name="doomed", permissions=["tenant:read"])
    second = tenant.client.post(f"/applications/{created['id']}/keys").json["key"]
    assert tenant.client.delete(f"/applications/{created['id']}").status == 204
    for key in (created["key"], second):
        assert_problem(tenant.client.with_key(key).get("/tenants/self"), 401)


# ---- several keys ---------------------------------------------------------------------------------------


def test_key_rotation(api, tenant):
    created = create(tenant.client, name="rotating", permissions=["tenant:read"])
    first = tenant.client.with_key(created["key"])

    answer = tenant.client.post(f"/applications/{created['id']}/keys")
    assert answer.status == 201, answer
    new_key = answer.json
    assert new_key["application_id"] == created["id"]
    assert new_key["key"] != created["key"]
    second = tenant.client.with_key(new_key["key"])

    # both work
    assert first.get("/tenants/self").status == 200
    assert second.get("/tenants/self").status == 200

    keys = tenant.client.get(f"/applications/{created['id']}/keys")
    assert keys.status == 200
    assert len(keys.json) == 2
    assert all(k.get("key") is None for k in keys.json)
    first_id = next(k["id"] for k in keys.json if k["id"] != new_key["id"])

    assert tenant.client.delete(f"/applications/{created['id']}/keys/{first_id}").status == 204
    assert_problem(first.get("/tenants/self"), 401)
    assert second.get("/tenants/self").status == 200
    assert [k["id"] for k in tenant.client.get(f"/applications/{created['id']}/keys").json] == [new_key["id"]]
    assert_problem(tenant.client.delete(f"/applications/{created['id']}/keys/{first_id}"), 404)


def test_key_of_another_application_cannot_be_deleted_through_this_one(api, tenant):
    a = create(tenant.client, name="a", permissions=["tenant:read"])
    b = create(tenant.client, name="b", permissions=["tenant:read"])
    b_key_id = tenant.client.get(f"/applications/{b['id']}/keys").json[0]["id"]
    assert_problem(tenant.client.delete(f"/applications/{a['id']}/keys/{b_key_id}"), 404)
    assert_problem(tenant.client.delete(f"/applications/{a['id']}/keys/not-a-uuid"), 404)
    assert tenant.client.with_key(b["key"]).get("/tenants/self").status == 200


def test_regenerate_is_gone(api, tenant):
    created = create(tenant.client, name="old-style")
    answer = tenant.client.post(f"/applications/{created['id']}/regenerate")
    body = assert_problem(answer, 410)
    assert "/keys" in body["detail"]
    # the original key was not replaced
    assert tenant.client.with_key(created["key"]).get("/tenants/self").status in (200, 403)
    assert len(tenant.client.get(f"/applications/{created['id']}/keys").json) == 1


# ---- permissions ----------------------------------------------------------------------------------------


def test_403_without_application_permissions(api, tenant, limited):
    target = create(tenant.client, name="target")
    client = limited(tenant, ["tenant:read", "log:read"])
    path = f"/applications/{target['id']}"
    cases = [
        (client.post("/applications", {"name": "x", "type": "public"}), "application:create"),
        (client.get("/applications"), "application:read"),
        (client.get("/applications/key"), "application:read"),
        (client.get(path), "application:read"),
        (client.put(path, {"name": "x", "permissions": []}), "application:update"),
        (client.delete(path), "application:delete"),
        (client.post(f"{path}/keys"), "application:update"),
        (client.get(f"{path}/keys"), "application:read"),
    ]
    for answer, permission in cases:
        body = assert_problem(answer, 403)
        assert permission in body["detail"]
    assert tenant.client.get(path).json["name"] == "target"


def test_read_permission_does_not_allow_writes(api, tenant, limited):
    client = limited(tenant, ["application:read"])
    assert client.get("/applications").status == 200
    assert_problem(client.post("/applications", {"name": "x", "type": "public"}), 403)


# ---- log rows -------------------------------------------------------------------------------------------


def test_log_rows_for_create_read_update_delete(api, tenant):
    created = create(tenant.client, name="audited")
    tenant.client.get(f"/applications/{created['id']}")
    tenant.client.put(f"/applications/{created['id']}", {"name": "audited2", "permissions": []})
    tenant.client.delete(f"/applications/{created['id']}")
    rows = log_rows(tenant, entity_type="application", entity_id=created["id"])
    assert [r["operation"] for r in rows] == ["delete", "update", "read", "create"]
    for row in rows:
        assert row["tenant_id"] == str(tenant.id)
        assert row["actor_id"] == str(tenant.application_id)
        assert row["actor_type"] == "application"
        assert row["entity_type"] == "application"
        assert row["message"]
        assert created["key"] not in str(row)
