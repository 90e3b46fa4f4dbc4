"""``POST /enrichments/bank-account-verify`` over real HTTP, with a real worker calling the sandbox's
bank verification provider (``sandbox/README.md``, "Bank account verification")."""

from __future__ import annotations

import pytest
from sqlmodel import select

from storage.db import session_scope
from storage.models import AuditLog, Job
from tests.conftest import make_tenant

pytestmark = pytest.mark.api

PATH = "/enrichments/bank-account-verify"


def bank_token(client, account: str, routing: str = "021000021") -> str:
    answer = client.post("/tokens", {"type": "bank", "data": {"routing_number": routing, "account_number": account}})
    assert answer.status == 201, answer
    return answer.json["id"]


@pytest.mark.parametrize(
    "routing, account, status",
    [
        ("021000021", "00001", "enabled"),
        ("021000021", "00002", "disabled"),
        ("021000021", "00003", "error"),
        ("011000015", "00001", "error"),
    ],
)
def test_the_sandbox_answers_each_documented_outcome_through_a_job(tenant, routing, account, status):
    token_id = bank_token(tenant.client, account, routing)
    answer = tenant.client.post(PATH, {"token_id": token_id})
    assert (answer.status, answer.json) == (200, {"status": status}), answer
    with session_scope() as session:
        job = session.exec(
            select(Job).where(Job.tenant_id == tenant.id, Job.kind == "enrichments.bank_account_verify")
        ).one()
        assert (job.status, job.subject_id, job.result) == ("succeeded", token_id, {"status": status})
        used = session.exec(select(AuditLog).where(AuditLog.tenant_id == tenant.id, AuditLog.operation == "use")).one()
        assert used.entity_id == token_id


def test_only_bank_tokens_of_the_tenant_are_verified(tenant, other_tenant):
    card = tenant.client.post("/tokens", {"type": "card", "data": {"number": "4242424242424242"}})
    assert card.status == 201, card
    refused = tenant.client.post(PATH, {"token_id": card.json["id"]})
    assert refused.status == 400, refused
    assert "token_id" in refused.json["errors"]
    assert tenant.client.post(PATH, {"token_id": "missing"}).status == 404
    assert other_tenant.client.post(PATH, {"token_id": bank_token(tenant.client, "00001")}).status == 404
    assert tenant.client.post(PATH, {}).status == 400


def test_the_permission_is_the_bank_use_right(tenant, limited):
    token_id = bank_token(tenant.client, "00001")
    without = limited(tenant, ["token:bank:read:high"]).post(PATH, {"token_id": token_id})
    assert without.status == 403, without
    assert "token:bank:use:proxy" in without.json["detail"]
    holding = limited(tenant, ["token:bank:use:proxy"]).post(PATH, {"token_id": token_id})
    assert (holding.status, holding.json) == (200, {"status": "enabled"}), holding


def test_a_production_tenant_without_a_provider_gets_422(api):
    production = make_tenant(api, type="production", name="live")
    token_id = bank_token(production.client, "00001")
    answer = production.client.post(PATH, {"token_id": token_id})
    assert answer.status == 422, answer
    with session_scope() as session:
        assert session.exec(select(Job).where(Job.tenant_id == production.id)).all() == []
