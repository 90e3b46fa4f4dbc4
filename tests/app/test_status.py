"""``GET /status``: public, per region, ``{error}`` on a bad region (spec, core document sections 2
Status, 4 Status, 7 Errors)."""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.api


def test_no_key_needed(api):
    answer = api.client().get("/status")
    assert answer.status == 200, answer
    assert answer.headers["Content-Type"].startswith("application/json")
    assert answer.json == {"us": {"tokens": True}, "eu": {"tokens": True}}
    uuid.UUID(answer.headers[f"{api.prefix}-TRACE-ID"])


def test_a_bad_key_does_not_matter(api):
    answer = api.client("key_not-valid").get("/status")
    assert answer.status == 200
    assert answer.json == {"us": {"tokens": True}, "eu": {"tokens": True}}


@pytest.mark.parametrize("region", ["us", "eu"])
def test_region_filter(api, region):
    answer = api.client().get(f"/status?region={region}")
    assert answer.status == 200, answer
    assert answer.json == {region: {"tokens": True}}


@pytest.mark.parametrize("region", ["ap", "US", "", "us,eu", "../etc"])
def test_unknown_region_is_400_with_error(api, region):
    answer = api.client().get(f"/status?region={region}")
    assert answer.status == 400, answer
    body = answer.json
    assert list(body) == ["error"]
    assert isinstance(body["error"], str) and body["error"]


def test_status_in_openapi_needs_no_key(api):
    doc = api.client().get("/openapi.json").json
    operation = doc["paths"]["/status"]["get"]
    assert "security" not in operation
    assert {"200", "400", "503"} <= set(operation["responses"])
    region = next(p for p in operation["parameters"] if p["name"] == "region")
    assert region["in"] == "query" and region["schema"]["enum"] == ["us", "eu"]


def test_database_down_is_503_with_error(api, monkeypatch):
    from app.routes import status

    def down(session):
        raise ConnectionError("database unreachable")

    monkeypatch.setattr(status, "_database_up", down)
    answer = api.client().get("/status?region=eu")
    assert answer.status == 503, answer
    assert list(answer.json) == ["error"] and answer.json["error"]
    assert "unreachable" not in answer.json["error"], "internal details stay inside"
    monkeypatch.undo()
    assert api.client().get("/status").status == 200
