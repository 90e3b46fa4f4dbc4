"""Pre-configured proxies in the real database: create, read, list, update, merge-patch, delete,
the key, the sealed configuration and the log rows."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from pydantic import ValidationError
from sqlmodel import select

from domain.proxy import service
from domain.proxy.models import TRANSFORM_TAGS, ProxyRequest
from infra.errors import Problem, validation_errors
from storage.db import session_scope
from storage.models import AuditLog
from storage.models_proxy import Proxy

BASE = {
    "name": "Payments PSP",
    "destination_url": "https://psp.example.com/v1/",
    "request_transforms": [{"type": "append_header", "location": "X-Psp", "value": "1"}],
    "configuration": {"PSP_SECRET": "sk_live_do_not_leak"},
}


def _create(vault, **changes) -> dict:
    with session_scope() as session:
        return service.create_proxy(session, vault.caller(), ProxyRequest.model_validate({**BASE, **changes}))


def test_create_shows_the_key_once_and_stores_its_digest_only(vault):
    created = _create(vault)
    assert created["key"].startswith("pxk_")
    assert created["destination_url"] == "https://psp.example.com/v1"
    assert created["require_auth"] is True and created["application"] is None
    assert created["response_transforms"] == []
    with session_scope() as session:
        row = session.get(Proxy, created["id"])
        assert row.key_digest == hashlib.sha256(created["key"].encode()).hexdigest()
        assert b"sk_live_do_not_leak" not in row.configuration_ct
        assert service.find_by_key(session, created["key"]).id == created["id"]
        assert service.find_by_key(session, created["key"] + "x") is None
        read = service.read_proxy(session, vault.caller("proxy:read"), created["id"])
    assert "key" not in read
    assert read["configuration"] == BASE["configuration"]


def test_deprecated_and_shut_down_fields():
    request = ProxyRequest.model_validate(
        {**BASE, "request_transforms": [], "response_transform": {"type": "append_text", "value": "x"}}
    )
    assert [t.type for t in request.response_transforms] == ["append_text"]
    with pytest.raises(ValidationError) as caught:
        ProxyRequest.model_validate({**BASE, "request_transform": {"type": "append_text", "value": "x"}})
    assert "request_transforms" in str(caught.value)
    with pytest.raises(ValidationError) as caught:
        ProxyRequest.model_validate(
            {
                **BASE,
                "request_reactor_id": str(uuid.uuid4()),
                "response_reactor_id": "r",
                "destination_url": "http://10.0.0.1",
                "name": " ",
                "unknown": 1,
            }
        )
    errors = validation_errors(caught.value, union_tags=TRANSFORM_TAGS)
    assert set(errors) == {"request_reactor_id", "response_reactor_id", "destination_url", "name", "unknown"}
    assert "March 31, 2023" in errors["request_reactor_id"][0]
    with pytest.raises(ValidationError) as caught:
        ProxyRequest.model_validate(
            {
                **BASE,
                "request_transforms": [],
                "request_transform": {"type": "mask", "matcher": "regex", "expression": "("},
            }
        )
    assert list(validation_errors(caught.value, union_tags=TRANSFORM_TAGS)) == ["request_transform.expression"]


def test_application_must_be_the_tenants(vault, other_vault):
    with pytest.raises(Problem) as caught:
        _create(vault, application={"id": str(other_vault.application_id)})
    assert caught.value.status == 400 and list(caught.value.errors) == ["application.id"]
    created = _create(vault, application={"id": str(vault.application_id)}, require_auth=False)
    assert created["application"] == {"id": vault.application_id} and created["require_auth"] is False


def test_permissions_and_tenant_isolation(vault, other_vault):
    created = _create(vault)
    with session_scope() as session:
        for call in (
            lambda c: service.create_proxy(session, c, ProxyRequest.model_validate(BASE)),
            lambda c: service.read_proxy(session, c, created["id"]),
            lambda c: service.list_proxies(session, c, size=10),
            lambda c: service.update_proxy(session, c, created["id"], ProxyRequest.model_validate(BASE)),
            lambda c: service.patch_proxy(session, c, created["id"], {"name": "x"}),
            lambda c: service.delete_proxy(session, c, created["id"]),
        ):
            with pytest.raises(Problem) as caught:
                call(vault.caller("proxy:invoke"))
            assert caught.value.status == 403
        with pytest.raises(Problem) as caught:
            service.read_proxy(session, other_vault.caller(), created["id"])
        assert caught.value.status == 404


def test_list_pages_and_name_filter(vault):
    made = [_create(vault, name=name)["id"] for name in ("Alpha 1", "beta", "ALPHA_2", "gamma")]
    with session_scope() as session:
        caller = vault.caller("proxy:read")
        first, position = service.list_proxies(session, caller, size=3)
        second, end = service.list_proxies(session, caller, size=3, after=position)
        assert [p["id"] for p in first + second] == list(reversed(made)) and end is None
        named, _ = service.list_proxies(session, caller, size=10, name="alpha")
        assert [p["name"] for p in named] == ["ALPHA_2", "Alpha 1"]
        assert service.list_proxies(session, caller, size=10, name="%")[0] == []
        with pytest.raises(Problem) as caught:
            service.list_proxies(session, caller, size=10, after={"t": "yesterday", "id": "x"})
        assert caught.value.status == 400


def test_update_patch_delete_and_log_rows(vault):
    created = _create(vault)
    with session_scope() as session:
        caller = vault.caller()
        replaced = service.update_proxy(
            session,
            caller,
            created["id"],
            ProxyRequest.model_validate({"name": "Replaced", "destination_url": "https://other.example.com"}),
        )
        assert replaced["request_transforms"] == [] and replaced["configuration"] == {}
        assert replaced["modified_at"] is not None
        patched = service.patch_proxy(
            session,
            caller,
            created["id"],
            {
                "configuration": {"A": "1"},
                "require_auth": False,
                "response_transform": {"type": "mask", "matcher": "regex", "expression": "\\d"},
            },
        )
        assert patched["name"] == "Replaced" and patched["configuration"] == {"A": "1"}
        assert patched["response_transforms"] == [
            {"type": "mask", "matcher": "regex", "expression": "\\d", "replacement": "*"}
        ]
        patched = service.patch_proxy(session, caller, created["id"], {"configuration": {"A": None, "B": "2"}})
        assert patched["configuration"] == {"B": "2"}
        with pytest.raises(Problem) as caught:
            service.patch_proxy(
                session,
                caller,
                created["id"],
                {"destination_url": "https://127.0.0.1", "request_transforms": [{"type": "x"}]},
            )
        assert caught.value.status == 400
        assert set(caught.value.errors) == {"destination_url", "request_transforms[0]"}
        assert service.read_proxy(session, caller, created["id"])["destination_url"] == "https://other.example.com"
        service.delete_proxy(session, caller, created["id"])
        with pytest.raises(Problem) as caught:
            service.read_proxy(session, caller, created["id"])
        assert caught.value.status == 404
    with session_scope() as session:
        rows = session.exec(
            select(AuditLog).where(AuditLog.entity_id == str(created["id"])).order_by(AuditLog.created_at)
        ).all()
    assert [r.operation for r in rows] == ["create", "update", "update", "update", "read", "delete"]
    assert {r.entity_type for r in rows} == {"proxy"}
    assert not any("sk_live" in r.message for r in rows)
