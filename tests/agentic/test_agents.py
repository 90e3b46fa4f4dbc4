"""Agents (deprecated): create, get, patch, delete, validation, permissions, the Deprecation header."""

from __future__ import annotations

import pytest

from app.routes.agentic_common import DEPRECATION
from tests.factories.agentic import assert_problem

pytestmark = pytest.mark.api

AGENTS = "/agentic/agents"


def _deprecated(answer) -> None:
    assert answer.headers["Deprecation"] == DEPRECATION["Deprecation"]
    assert DEPRECATION["Deprecation"].startswith("@") and DEPRECATION["Deprecation"][1:].isdigit()  # RFC 9745
    assert "Sunset" not in answer.headers


def test_create_get_patch_delete(tenant):
    client = tenant.client
    details = {"ip_address": "192.0.2.10", "brand": "Acme", "type": "personal-assistant"}
    answer = client.post(AGENTS, {"name": "Shopper", "enrollment_ids": ["e1", "e2"], "instance_details": details})

    assert answer.status == 201, answer
    _deprecated(answer)
    agent = answer.json
    assert agent["id"].startswith("agt_") and len(agent["id"]) == 36
    assert agent["name"] == "Shopper" and agent["status"] == "active"
    assert agent["enrollment_ids"] == ["e1", "e2"] and agent["instance_details"] == details
    assert agent["created_at"]

    read = client.get(f"{AGENTS}/{agent['id']}")
    assert read.status == 200 and read.json == agent
    _deprecated(read)

    patched = client.patch(f"{AGENTS}/{agent['id']}", {"name": "Renamed", "instance_details": {"type": "other"}})
    assert patched.status == 200, patched
    _deprecated(patched)
    assert patched.json == {**agent, "name": "Renamed", "instance_details": {"type": "other"}}
    kept = client.patch(f"{AGENTS}/{agent['id']}", {"enrollment_ids": []}).json
    assert kept["name"] == "Renamed" and kept["enrollment_ids"] == [] and kept["instance_details"] == {"type": "other"}
    cleared = client.patch(f"{AGENTS}/{agent['id']}", {"instance_details": None}).json
    assert cleared["instance_details"] is None

    deleted = client.delete(f"{AGENTS}/{agent['id']}")
    assert deleted.status == 204
    _deprecated(deleted)
    missing = client.get(f"{AGENTS}/{agent['id']}")
    assert_problem(missing, 404, "AGENT_NOT_FOUND")
    _deprecated(missing)
    assert_problem(client.delete(f"{AGENTS}/{agent['id']}"), 404, "AGENT_NOT_FOUND")
    assert_problem(client.patch(f"{AGENTS}/{agent['id']}", {"name": "x"}), 404, "AGENT_NOT_FOUND")


def test_only_a_name_is_required(tenant):
    answer = tenant.client.post(AGENTS, {"name": "n"})
    assert answer.status == 201
    assert answer.json["enrollment_ids"] == [] and answer.json["instance_details"] is None


@pytest.mark.parametrize(
    ("payload", "fields"),
    [
        ({}, {"name"}),
        ({"name": ""}, {"name"}),
        ({"name": "x" * 256}, {"name"}),
        ({"name": "a", "enrollment_ids": [f"e{i}" for i in range(51)]}, {"enrollment_ids"}),
        ({"name": "a", "enrollment_ids": [""]}, {"enrollment_ids"}),
        ({"name": "a", "instance_details": {"ip_address": "999.1.1.1"}}, {"instance_details.ip_address"}),
        ({"name": "a", "instance_details": {"ip_address": "::1"}}, {"instance_details.ip_address"}),
        ({"name": "a", "instance_details": {"type": "robot"}}, {"instance_details.type"}),
        ({"name": "a", "instance_details": {"colour": "red"}}, {"instance_details.colour"}),
        ({"name": "", "enrollment_ids": "e1", "status": "x"}, {"name", "enrollment_ids", "status"}),
    ],
)
def test_create_validation(tenant, payload, fields):
    answer = tenant.client.post(AGENTS, payload)
    problem = assert_problem(answer, 400, "VALIDATION_ERROR")
    assert set(problem["errors"]) == fields
    _deprecated(answer)


def test_fifty_enrollment_ids_and_a_255_character_name_are_accepted(tenant):
    answer = tenant.client.post(AGENTS, {"name": "x" * 255, "enrollment_ids": [f"e{i}" for i in range(50)]})
    assert answer.status == 201 and len(answer.json["enrollment_ids"]) == 50


def test_patch_validation(tenant):
    agent = tenant.client.post(AGENTS, {"name": "n"}).json
    for payload, fields in (
        ({"name": None}, {"name"}),
        ({"enrollment_ids": None}, {"enrollment_ids"}),
        ({"name": ""}, {"name"}),
        ({"instance_details": {"ip_address": "1.2.3"}}, {"instance_details.ip_address"}),
    ):
        problem = assert_problem(tenant.client.patch(f"{AGENTS}/{agent['id']}", payload), 400, "VALIDATION_ERROR")
        assert set(problem["errors"]) == fields
    assert tenant.client.get(f"{AGENTS}/{agent['id']}").json == agent


def test_permissions_and_isolation(tenant, other_tenant, limited):
    agent = tenant.client.post(AGENTS, {"name": "n"}).json
    reader = limited(tenant, ["agent:get"])
    assert reader.get(f"{AGENTS}/{agent['id']}").status == 200
    for answer in (
        reader.post(AGENTS, {"name": "n"}),
        reader.patch(f"{AGENTS}/{agent['id']}", {"name": "m"}),
        reader.delete(f"{AGENTS}/{agent['id']}"),
    ):
        assert answer.status == 403  # raised before the handler: the Deprecation header comes with the hook
    assert_problem(other_tenant.client.get(f"{AGENTS}/{agent['id']}"), 404, "AGENT_NOT_FOUND")
    assert_problem(other_tenant.client.delete(f"{AGENTS}/{agent['id']}"), 404, "AGENT_NOT_FOUND")
    assert tenant.client.get(f"{AGENTS}/{agent['id']}").status == 200


def test_agents_are_deprecated_in_the_openapi_description(api):
    doc = api.client().get("/openapi.json").json
    for method in ("post",):
        assert doc["paths"][AGENTS][method]["deprecated"] is True
    for method in ("get", "patch", "delete"):
        assert doc["paths"][f"{AGENTS}/{{agent_id}}"][method]["deprecated"] is True
    create = doc["paths"]["/agentic/payment-methods"]["post"]
    assert "agentic.payment-method.rail.retried" in create["description"]
    schema = create["requestBody"]["content"]["application/json"]["schema"]
    schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    assert schema["properties"]["source"]
