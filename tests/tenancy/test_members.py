"""Members, the security contact and the usage report (core document sections 2 and 4: Tenants, Tenant
members)."""

from __future__ import annotations

import datetime as dt
import os

import pytest
from sqlmodel import select

from domain.tenancy import usage
from storage.db import session_scope
from storage.models import Tenant, TenantMember, User
from storage.models_tenancy import TokenActivity
from tests.factories.tokens import bank, card, create
from tests.helpers import assert_problem

pytestmark = pytest.mark.api


def _add_member(tenant, role: str = "ADMIN", email: str | None = None) -> tuple[str, str]:
    """A member made directly in the database (as an accepted invitation would); ``(member id, user id)``."""
    with session_scope() as session:
        user = User(email=email or f"m-{os.urandom(4).hex()}@example.com", first_name="Mem")
        session.add(user)
        session.flush()
        member = TenantMember(tenant_id=tenant.id, user_id=user.id, role=role)
        session.add(member)
        return str(member.id), str(user.id)


def _owner_email(tenant) -> str:
    with session_scope() as session:
        return session.get(User, session.get(Tenant, tenant.id).owner_id).email


def test_the_owner_is_the_first_member(tenant):
    answer = tenant.client.get("/tenants/self/members")
    assert answer.status == 200, answer
    [owner] = answer.json["data"]
    assert owner["role"] == "OWNER"
    assert owner["tenant_id"] == str(tenant.id)
    assert owner["user"]["email"] == _owner_email(tenant)
    assert set(owner["user"]) == {"id", "email", "first_name", "last_name", "picture"}
    assert owner["created_at"]
    assert answer.json["pagination"] == {"total_items": 1, "page_number": 1, "page_size": 20, "total_pages": 1}


def test_filter_by_user_and_pages(tenant):
    added = [_add_member(tenant, role) for role in ("ADMIN", "READ_ONLY", "ADMIN")]
    everyone = tenant.client.get("/tenants/self/members").json
    assert everyone["pagination"]["total_items"] == 4
    assert [m["id"] for m in everyone["data"][1:]] == [member_id for member_id, _ in added]

    query = "&".join(f"user_id={user_id}" for _, user_id in added[:2])
    filtered = tenant.client.get(f"/tenants/self/members?{query}").json
    assert [m["id"] for m in filtered["data"]] == [added[0][0], added[1][0]]
    assert [m["role"] for m in filtered["data"]] == ["ADMIN", "READ_ONLY"]
    assert filtered["pagination"]["total_items"] == 2

    second = tenant.client.get("/tenants/self/members?page=2&size=3").json
    assert [m["id"] for m in second["data"]] == [added[2][0]]
    assert second["pagination"] == {"total_items": 4, "page_number": 2, "page_size": 3, "total_pages": 2}
    assert tenant.client.get("/tenants/self/members?size=50").status == 200


@pytest.mark.parametrize(("query", "field"), [("size=51", "size"), ("page=0", "page"), ("user_id=nope", "user_id[0]")])
def test_invalid_member_queries(tenant, query, field):
    body = assert_problem(tenant.client.get(f"/tenants/self/members?{query}"), 400)
    assert field in body["errors"]


def test_remove_a_member_but_never_the_owner(tenant, other_tenant, limited):
    member_id, user_id = _add_member(tenant)
    owner_id = tenant.client.get("/tenants/self/members").json["data"][0]["id"]

    refused = assert_problem(tenant.client.delete(f"/tenants/self/members/{owner_id}"), 422)
    assert "OWNER" in refused["detail"]
    reader = limited(tenant, ["tenant:member:read"])
    assert_problem(reader.delete(f"/tenants/self/members/{member_id}"), 403)
    assert_problem(other_tenant.client.delete(f"/tenants/self/members/{member_id}"), 404)
    assert_problem(tenant.client.delete("/tenants/self/members/not-a-uuid"), 404)

    assert tenant.client.delete(f"/tenants/self/members/{member_id}").status == 204
    assert tenant.client.get(f"/tenants/self/members?user_id={user_id}").json["data"] == []
    assert_problem(tenant.client.delete(f"/tenants/self/members/{member_id}"), 404)
    with session_scope() as session:
        assert session.get(TenantMember, member_id) is None
    [log] = tenant.client.get("/logs?entity_type=tenant_member").json["data"]
    assert (log["entity_id"], log["operation"], log["actor_id"]) == (member_id, "delete", str(tenant.application_id))


def test_members_are_per_tenant(tenant, other_tenant, limited):
    _add_member(other_tenant)
    assert tenant.client.get("/tenants/self/members").json["pagination"]["total_items"] == 1
    assert_problem(limited(tenant, ["tenant:read"]).get("/tenants/self/members"), 403)
    assert limited(tenant, ["tenant:member:read"]).get("/tenants/self/members").status == 200


# ---- security contact ----------------------------------------------------------------------------


def test_security_contact_falls_back_to_the_owner(tenant, limited):
    answer = tenant.client.get("/tenants/self/security-contact")
    assert answer.status == 200, answer
    assert answer.json == {"email": _owner_email(tenant)}

    updated = tenant.client.put("/tenants/self/security-contact", {"email": "security@example.com"})
    assert updated.status == 200, updated
    assert updated.json == {"email": "security@example.com"}
    assert tenant.client.get("/tenants/self/security-contact").json == {"email": "security@example.com"}

    reader = limited(tenant, ["tenant:read"])
    assert reader.get("/tenants/self/security-contact").status == 200
    assert_problem(reader.put("/tenants/self/security-contact", {"email": "x@example.com"}), 403)
    assert_problem(limited(tenant, ["tenant:update"]).get("/tenants/self/security-contact"), 403)


@pytest.mark.parametrize(
    "body",
    [{}, {"email": "nope"}, {"email": "a" * 190 + "@example.com"}, {"email": "x@example.com", "name": "n"}],
)
def test_invalid_security_contacts(tenant, body):
    answer = assert_problem(tenant.client.put("/tenants/self/security-contact", body), 400)
    assert set(answer["errors"]) & {"email", "name"}
    assert tenant.client.get("/tenants/self/security-contact").json == {"email": _owner_email(tenant)}


def test_a_200_character_contact_is_accepted(tenant):
    email = "a" * (200 - len("@example.com")) + "@example.com"
    assert tenant.client.put("/tenants/self/security-contact", {"email": email}).json == {"email": email}


# ---- usage report --------------------------------------------------------------------------------


def test_usage_report_counts_tokens_by_type(tenant, other_tenant, limited):
    empty = tenant.client.get("/tenants/self/reports/usage")
    assert empty.status == 200, empty
    assert empty.json == {
        "token_report": {
            "metrics_by_type": {},
            "included_monthly_active_tokens": 10_000,
            "monthly_active_tokens": 0,
        }
    }
    cards = [create(tenant.client, card()) for _ in range(2)]
    create(tenant.client, bank())
    create(other_tenant.client, card())

    report = tenant.client.get("/tenants/self/reports/usage").json["token_report"]
    assert set(report["metrics_by_type"]) == {"card", "bank"}
    assert report["metrics_by_type"]["card"]["count"] == 2
    assert report["metrics_by_type"]["bank"]["count"] == 1
    newest = max(dt.datetime.fromisoformat(c["created_at"]) for c in cards)
    assert dt.datetime.fromisoformat(report["metrics_by_type"]["card"]["last_created_at"]) == newest

    assert_problem(limited(tenant, ["tenant:read"]).get("/tenants/self/reports/usage"), 403)
    assert limited(tenant, ["report:read"]).get("/tenants/self/reports/usage").status == 200


def test_monthly_active_tokens_are_counted_once_per_month(tenant):
    now = dt.datetime.now(dt.UTC)
    last_month = now.replace(day=1) - dt.timedelta(days=1)
    with session_scope() as session:
        usage.record_token_activity(session, tenant.id, ["t1", "t2", "t1"], now=now)
    with session_scope() as session:
        usage.record_token_activity(session, tenant.id, ["t2", "t3"], now=now)
        usage.record_token_activity(session, tenant.id, [], now=now)
        usage.record_token_activity(session, tenant.id, ["t4"], now=last_month)
    report = tenant.client.get("/tenants/self/reports/usage").json["token_report"]
    assert report["monthly_active_tokens"] == 3
    with session_scope() as session:
        assert usage.monthly_active_tokens(session, tenant.id, now=last_month) == 1
        rows = session.exec(select(TokenActivity).where(TokenActivity.tenant_id == tenant.id)).all()
        assert sorted((r.month.isoformat()[:7], r.token_id) for r in rows) == sorted(
            [(now.strftime("%Y-%m"), t) for t in ("t1", "t2", "t3")] + [(last_month.strftime("%Y-%m"), "t4")]
        )


def test_record_token_activity_in_large_batches(tenant):
    ids = [f"tok-{n}" for n in range(1200)]
    with session_scope() as session:
        usage.record_token_activity(session, tenant.id, ids)
        usage.record_token_activity(session, tenant.id, ids[:700])
    with session_scope() as session:
        assert usage.monthly_active_tokens(session, tenant.id) == 1200
