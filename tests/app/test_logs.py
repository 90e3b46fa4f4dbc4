"""``GET /logs`` and ``GET /logs/entity-types`` (spec, core document sections 2 Log, 4 Logs; cursor
pagination)."""

from __future__ import annotations

import base64
import datetime as dt
import json
from urllib.parse import urlencode

import pytest

from tests.helpers import assert_problem

pytestmark = pytest.mark.api


def get_logs(client, **query):
    answer = client.get("/logs?" + urlencode(query) if query else "/logs")
    assert answer.status == 200, answer
    return answer.json


def all_rows(client, **query) -> list[dict]:
    """Every row through the cursor, checking the page shapes on the way."""
    rows, start, pages = [], None, 0
    while True:
        params = dict(query)
        if start:
            params["start"] = start
        page = get_logs(client, **params)
        pages += 1
        assert page["pagination"]["page_size"] == int(query.get("size", 20))
        rows += page["data"]
        start = page["pagination"].get("next")
        if not start:
            return rows
        assert pages < 100


def make_application(tenant, name="app"):
    answer = tenant.client.post("/applications", {"name": name, "type": "server_to_server", "permissions": []})
    assert answer.status == 201
    return answer.json


def _key(row):
    return (row["created_at"], row["entity_type"], row["entity_id"], row["operation"])


def test_row_shape(api, tenant):
    created = make_application(tenant)
    page = get_logs(tenant.client)
    assert set(page["pagination"]) <= {"page_size", "next"}
    assert page["pagination"]["page_size"] == 20
    assert "next" not in page["pagination"]
    [row] = page["data"]
    assert row == {
        "tenant_id": str(tenant.id),
        "actor_id": str(tenant.application_id),
        "actor_type": "application",
        "entity_type": "application",
        "entity_id": created["id"],
        "operation": "create",
        "message": row["message"],
        "created_at": row["created_at"],
    }
    assert row["message"]
    dt.datetime.fromisoformat(row["created_at"])


def test_cursor_pages_through_all_rows_newest_first(api, tenant):
    for _ in range(23):
        assert tenant.client.get("/tenants/self").status == 200
    make_application(tenant, "last")

    everything = get_logs(tenant.client, size=100)
    assert "next" not in everything["pagination"]
    full = everything["data"]
    assert len(full) == 24
    assert full[0]["entity_type"] == "application"  # the newest first
    times = [dt.datetime.fromisoformat(r["created_at"]) for r in full]
    assert times == sorted(times, reverse=True)

    paged = all_rows(tenant.client, size=5)
    assert paged == full
    assert len({_key(r) for r in paged}) == len(paged) == 24

    # a size that divides the total exactly ends without an empty page
    first = get_logs(tenant.client, size=12)
    second = get_logs(tenant.client, size=12, start=first["pagination"]["next"])
    assert first["data"] + second["data"] == full
    if "next" in second["pagination"]:
        assert get_logs(tenant.client, size=12, start=second["pagination"]["next"])["data"] == []


def test_paging_is_stable_when_rows_are_added(api, tenant):
    for _ in range(6):
        tenant.client.get("/tenants/self")
    first = get_logs(tenant.client, size=3)
    make_application(tenant, "newer")  # newer than the cursor: must not appear on later pages
    rest = all_rows(tenant.client, size=3, start=first["pagination"]["next"])
    assert len(first["data"] + rest) == 6
    assert all(r["entity_type"] == "tenant" for r in first["data"] + rest)


def test_filter_entity_type_and_id(api, tenant):
    a = make_application(tenant, "a")
    b = make_application(tenant, "b")
    tenant.client.get(f"/applications/{a['id']}")
    tenant.client.get("/tenants/self")

    apps = get_logs(tenant.client, entity_type="application")["data"]
    assert len(apps) == 3 and {r["entity_type"] for r in apps} == {"application"}
    only_a = get_logs(tenant.client, entity_id=a["id"])["data"]
    assert [r["operation"] for r in only_a] == ["read", "create"]
    assert {r["entity_id"] for r in only_a} == {a["id"]}
    both = get_logs(tenant.client, entity_type="application", entity_id=b["id"])["data"]
    assert [(r["entity_id"], r["operation"]) for r in both] == [(b["id"], "create")]
    assert get_logs(tenant.client, entity_type="tenant", entity_id=a["id"])["data"] == []
    tenants = get_logs(tenant.client, entity_type="tenant")["data"]
    assert [r["entity_id"] for r in tenants] == [str(tenant.id)]
    assert get_logs(tenant.client, entity_type="nonexistent")["data"] == []


def test_filter_dates(api, tenant):
    for i in range(5):
        make_application(tenant, f"app-{i}")
    rows = get_logs(tenant.client)["data"]
    assert len(rows) == 5
    pivot = rows[2]["created_at"]  # the third newest

    since = get_logs(tenant.client, start_date=pivot)["data"]  # created_at >= pivot
    assert since == rows[:3]
    before = get_logs(tenant.client, end_date=pivot)["data"]  # created_at < pivot
    assert before == rows[3:]
    window = get_logs(tenant.client, start_date=rows[3]["created_at"], end_date=rows[1]["created_at"])["data"]
    assert window == rows[2:4]
    assert get_logs(tenant.client, start_date=pivot, end_date=pivot)["data"] == []

    # other zones name the same instant
    instant = dt.datetime.fromisoformat(pivot)
    shifted = instant.astimezone(dt.timezone(dt.timedelta(hours=5, minutes=30))).isoformat()
    assert get_logs(tenant.client, start_date=shifted)["data"] == rows[:3]
    # a naive timestamp is read as UTC
    naive = instant.astimezone(dt.UTC).replace(tzinfo=None).isoformat()
    assert get_logs(tenant.client, end_date=naive)["data"] == rows[3:]

    future = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    assert get_logs(tenant.client, start_date=future)["data"] == []
    assert get_logs(tenant.client, end_date=future)["data"] == rows
    # filters combine with the cursor
    first = get_logs(tenant.client, end_date=rows[0]["created_at"], size=2)
    assert first["data"] == rows[1:3]
    second = get_logs(tenant.client, end_date=rows[0]["created_at"], size=2, start=first["pagination"]["next"])
    assert second["data"] == rows[3:5]


def _cursor(position) -> str:
    return base64.urlsafe_b64encode(json.dumps(position).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "start",
    [
        "garbage",
        "!!!",
        _cursor({"x": 1}),
        _cursor([1, 2]),
        _cursor({"t": "not a time", "id": "00000000-0000-0000-0000-000000000000"}),
        _cursor({"t": "2026-01-01T00:00:00+00:00", "id": "not-a-uuid"}),
        _cursor({"t": 5, "id": 7}),
        _cursor({"t": None, "id": None}),
        base64.urlsafe_b64encode(b"\xff\xfe{").decode(),
    ],
)
def test_bad_cursor_is_400(api, tenant, start):
    make_application(tenant)
    answer = tenant.client.get("/logs?" + urlencode({"start": start}))
    body = assert_problem(answer, 400)
    assert "start" in body["errors"]


@pytest.mark.parametrize(
    "query",
    [
        "size=0",
        "size=101",
        "size=x",
        "start_date=yesterday",
        "end_date=2026-13-01",
        "entity_id=a%00b",
        "entity_type=%00",
    ],
)
def test_bad_query_is_400(api, tenant, query):
    assert_problem(tenant.client.get(f"/logs?{query}"), 400)


def test_entity_types(api, tenant):
    answer = tenant.client.get("/logs/entity-types")
    assert answer.status == 200
    types = answer.json
    assert isinstance(types, list) and types
    for item in types:
        assert set(item) == {"display_name", "value"}
        assert isinstance(item["display_name"], str) and item["display_name"]
        assert isinstance(item["value"], str) and item["value"]
    values = {item["value"] for item in types}
    assert {"application", "tenant", "token"} <= values
    assert len(values) == len(types)
    # every entity type that log rows name is listed
    make_application(tenant)
    tenant.client.get("/tenants/self")
    assert {r["entity_type"] for r in get_logs(tenant.client)["data"]} <= values


def test_403_without_log_read(api, tenant, limited):
    client = limited(tenant, ["tenant:read", "application:read"])
    for path in ("/logs", "/logs/entity-types"):
        body = assert_problem(client.get(path), 403)
        assert "log:read" in body["detail"]
    assert_problem(api.client().get("/logs"), 401)
    reader = limited(tenant, ["log:read"])
    assert reader.get("/logs").status == 200
    assert reader.get("/logs/entity-types").status == 200


def test_only_own_tenant(api, tenant, other_tenant):
    mine = make_application(tenant, "mine")
    theirs = make_application(other_tenant, "theirs")
    rows = get_logs(tenant.client, size=100)["data"]
    assert {r["tenant_id"] for r in rows} == {str(tenant.id)}
    assert theirs["id"] not in {r["entity_id"] for r in rows}
    assert get_logs(tenant.client, entity_id=theirs["id"])["data"] == []
    # another tenant's cursor shows nothing of this one's rows it should not
    their_rows = get_logs(other_tenant.client)["data"]
    assert mine["id"] not in {r["entity_id"] for r in their_rows}


def test_logs_never_contain_an_api_key(api, tenant):
    created = make_application(tenant, "secretive")
    extra = tenant.client.post(f"/applications/{created['id']}/keys").json["key"]
    tenant.client.get(f"/applications/{created['id']}")
    tenant.client.with_key(created["key"]).get("/tenants/self")  # 403, still a call with the key
    tenant.client.put(f"/applications/{created['id']}", {"name": "secretive", "permissions": ["tenant:read"]})
    tenant.client.with_key(extra).get("/tenants/self")
    raw = tenant.client.get("/logs?size=100").raw.decode()
    assert json.loads(raw)["data"], "there are rows to look at"
    for key in (created["key"], extra, tenant.api_key):
        assert key not in raw
        assert key.removeprefix("key_") not in raw
