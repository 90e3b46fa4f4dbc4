"""Delete (the cascade, repeats, resuming), operation leases and their sweep, the errors history and
its retention sweep."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import update
from sqlmodel import select

from domain.agentic.payment_methods import new_id
from providers import agentic_http as providers
from storage.db import session_scope
from storage.models_agentic import OperationLease, ProviderError
from tasks.agentic import purge_provider_errors_task, release_stale_operation_leases
from tests.factories.agentic import (
    BASE,
    HANGS,
    REJECTED,
    VISA,
    assert_problem,
    card_token,
    create,
    created,
    fresh_visa,
    get,
    jobs_of,
    later,
    outcome,
    pm_row,
    provider_enrollments,
    provider_requests,
    rail_rows,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.api


def retry(client, pm_id: str, rail: str = "agentic-token", provider: str = "vic"):
    return client.post(f"{BASE}/{pm_id}/rails/retry", {"rail": rail, "provider": provider})


def _lease(pm_id: str, tenant_id, operation: str, seconds: float) -> None:
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        session.add(
            OperationLease(
                resource_id=pm_id,
                tenant_id=tenant_id,
                operation=operation,
                owner="op_someone",
                acquired_at=now,
                expires_at=now + dt.timedelta(seconds=seconds),
            )
        )


def _leases(pm_id: str) -> list[OperationLease]:
    with session_scope() as session:
        return list(session.exec(select(OperationLease).where(OperationLease.resource_id == pm_id)).all())


# ---- delete ----------------------------------------------------------------------------------------


def test_delete_removes_the_provider_enrollments_then_the_payment_method(tenant, sandbox):
    number = fresh_visa()
    pm = created(tenant.client, number)
    enrollments = {r.provider: r.enrollment_id for r in rail_rows(pm["id"])}
    assert all(enrollments.values())

    answer = tenant.client.delete(f"{BASE}/{pm['id']}")

    assert answer.status == 204 and answer.raw == b""
    gone = get(tenant.client, pm["id"])
    assert gone["status"] == "deleted"
    assert later(gone, pm)
    assert gone["rails"] == pm["rails"]
    for provider in ("vic", "psp"):
        assert provider_enrollments(sandbox, provider, number) == []
        assert provider_requests(sandbox, f"agentic.{provider}.enrollments.delete", number) == 1
    assert _leases(pm["id"]) == []
    assert [j.kind for j in jobs_of(pm["id"]) if j.kind == "agentic.delete_payment_method"] == [
        "agentic.delete_payment_method"
    ]


def test_a_repeated_delete_succeeds_without_a_provider_call_and_keeps_updated_at(tenant, sandbox):
    number = fresh_visa()
    pm = created(tenant.client, number)
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204
    deleted = get(tenant.client, pm["id"])

    for _ in range(2):
        assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204

    assert get(tenant.client, pm["id"]) == deleted
    assert provider_requests(sandbox, "agentic.vic.enrollments.delete", number) == 1
    assert provider_requests(sandbox, "agentic.psp.enrollments.delete", number) == 1


def test_a_payment_method_with_nothing_enrolled_is_deleted_at_once(api):
    from tests.conftest import make_tenant

    production = make_tenant(api, type="production")
    pm = created(production.client, VISA)  # every rail PROVIDER_NOT_CONFIGURED
    assert production.client.delete(f"{BASE}/{pm['id']}").status == 204
    assert get(production.client, pm["id"])["status"] == "deleted"
    assert jobs_of(pm["id"]) == []


def test_delete_and_retry_are_409_while_an_enrollment_is_in_flight(tenant):
    token_id = card_token(tenant.client, HANGS)
    answers = {}
    thread = threading.Thread(target=lambda: answers.setdefault("create", create(tenant.client, token_id)))
    thread.start()
    listed = wait_until(lambda: (page := tenant.client.get(BASE).json["data"]) and page[0], timeout=5)
    pm = wait_until(
        lambda: (now := get(tenant.client, listed["id"])) and outcome(now)["psp"] == "enabled" and now, timeout=5
    )
    assert outcome(pm)["vic"] == "pending"  # its call hangs at the provider for 8 s

    assert_problem(tenant.client.delete(f"{BASE}/{pm['id']}"), 409, "PAYMENT_METHOD_OPERATION_IN_PROGRESS")
    assert_problem(retry(tenant.client, pm["id"]), 409, "PAYMENT_METHOD_OPERATION_IN_PROGRESS")
    assert [lease.operation for lease in _leases(pm["id"])] == ["enroll"]
    assert get(tenant.client, pm["id"])["updated_at"] == pm["updated_at"]  # refused calls change nothing

    thread.join(30)
    assert answers["create"].status == 201
    assert _leases(pm["id"]) == []  # the last enrollment job released it
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204


def test_a_cascade_stopped_half_way_resumes_on_the_next_delete(tenant, sandbox, monkeypatch):
    number = fresh_visa()
    pm = created(tenant.client, number)
    real_delete = providers.HttpAgenticProvider.delete_enrollment

    def psp_refuses(self, enrollment_id):
        if self.name == "psp":
            raise providers.EnrollmentFailed(
                "PROVIDER_ENROLLMENT_FAILED", "refused", provider_code="HTTP_403", correlation_id="corr_test"
            )
        return real_delete(self, enrollment_id)

    monkeypatch.setattr(providers.HttpAgenticProvider, "delete_enrollment", psp_refuses)
    problem = assert_problem(tenant.client.delete(f"{BASE}/{pm['id']}"), 500, "PROVIDER_ALLOWANCE_CANCEL_FAILED")
    assert "repeat" in problem["detail"].lower()

    halfway = get(tenant.client, pm["id"])
    assert halfway["status"] == "active" and halfway["updated_at"] == pm["updated_at"]
    assert provider_enrollments(sandbox, "vic", number) == []  # removed before psp refused
    assert len(provider_enrollments(sandbox, "psp", number)) == 1
    assert_problem(retry(tenant.client, pm["id"]), 409, "PAYMENT_METHOD_DELETE_INCOMPLETE")
    errors = tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    assert [(e["code"], e["operation"], e["provider"], e["provider_code"]) for e in errors] == [
        ("PROVIDER_ALLOWANCE_CANCEL_FAILED", "deletion", "psp", "HTTP_403")
    ]
    assert _leases(pm["id"]) == []

    monkeypatch.setattr(providers.HttpAgenticProvider, "delete_enrollment", real_delete)
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204

    assert get(tenant.client, pm["id"])["status"] == "deleted"
    assert provider_enrollments(sandbox, "psp", number) == []
    assert provider_requests(sandbox, "agentic.vic.enrollments.delete", number) == 1  # not repeated
    assert provider_requests(sandbox, "agentic.psp.enrollments.delete", number) == 1


def test_unknown_payment_method_is_404(tenant):
    assert_problem(tenant.client.delete(f"{BASE}/pm_nope"), 404, "PAYMENT_METHOD_NOT_FOUND")
    assert_problem(tenant.client.get(f"{BASE}/pm_nope"), 404, "PAYMENT_METHOD_NOT_FOUND")
    assert_problem(tenant.client.get(f"{BASE}/pm_nope/errors"), 404, "PAYMENT_METHOD_NOT_FOUND")


# ---- leases ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "code"),
    [("enroll", "PAYMENT_METHOD_OPERATION_IN_PROGRESS"), ("delete", "PAYMENT_METHOD_DELETE_IN_PROGRESS")],
)
def test_a_live_lease_answers_409_and_the_sweep_frees_a_dead_holders_lease(tenant, operation, code):
    pm = created(tenant.client, REJECTED)  # vic in error: retryable
    _lease(pm["id"], tenant.id, operation, seconds=300)

    assert_problem(tenant.client.delete(f"{BASE}/{pm['id']}"), 409, code)
    assert_problem(retry(tenant.client, pm["id"]), 409, code)
    release_stale_operation_leases()
    assert len(_leases(pm["id"])) == 1  # a live lease survives the sweep

    with session_scope() as session:  # its holder died: the lease runs out
        session.execute(
            update(OperationLease)
            .where(OperationLease.resource_id == pm["id"])
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
    assert release_stale_operation_leases() >= 1
    assert _leases(pm["id"]) == []
    assert_problem(retry(tenant.client, pm["id"]), 422, "CARD_REJECTED")
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204


def test_an_expired_lease_is_taken_over_even_before_the_sweep(tenant):
    pm = created(tenant.client, REJECTED)
    _lease(pm["id"], tenant.id, "enroll", seconds=-1)
    assert_problem(retry(tenant.client, pm["id"]), 422, "CARD_REJECTED")
    assert _leases(pm["id"]) == []


# ---- errors history --------------------------------------------------------------------------------


def test_errors_are_paginated_newest_first_without_provider_text(tenant):
    pm = created(tenant.client, REJECTED)
    for _ in range(3):
        assert_problem(retry(tenant.client, pm["id"]), 422, "CARD_REJECTED")

    seen, start, pages = [], None, 0
    while True:
        answer = tenant.client.get(f"{BASE}/{pm['id']}/errors?size=3" + (f"&start={start}" if start else ""))
        assert answer.status == 200
        pages += 1
        seen += answer.json["data"]
        start = answer.json["pagination"].get("next")
        if not start:
            break
    assert pages == 2 and len(seen) == 4
    times = [e["occurred_at"] for e in seen]
    assert times == sorted(times, reverse=True)
    for error in seen:
        assert error["id"].startswith("prv_")
        assert error["code"] == "CARD_REJECTED" and error["title"] == "Card rejected"
        assert error["provider"] == "vic" and error["rail"] == "agentic-token" and error["operation"] == "enrollment"
        assert error["provider_code"] == "CARD_REJECTED" and error["provider_correlation_id"].startswith("corr_")
        assert error["payment_method_id"] == pm["id"]
        assert error["allowance_id"] is None and error["payment_credential_id"] is None
    raw = tenant.client.get(f"{BASE}/{pm['id']}/errors?size=100").raw.decode()
    assert "issuer rejected" not in raw and REJECTED not in raw and "ada@example.com" not in raw
    for query in ("size=0", "size=101", "start=nope"):
        assert_problem(tenant.client.get(f"{BASE}/{pm['id']}/errors?{query}"), 400, "VALIDATION_ERROR")


def test_provider_errors_are_kept_90_days(tenant):
    pm = created(tenant.client, REJECTED)
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        for days in (91, 89):
            session.add(
                ProviderError(
                    id=new_id("prv_"),
                    tenant_id=tenant.id,
                    code="CARD_REJECTED",
                    title="t",
                    detail="d",
                    provider="vic",
                    operation="enrollment",
                    rail="agentic-token",
                    payment_method_id=pm["id"],
                    occurred_at=now - dt.timedelta(days=days),
                )
            )
    assert len(tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]) == 3

    assert purge_provider_errors_task() >= 1

    ages = [
        (now - dt.datetime.fromisoformat(e["occurred_at"])).days
        for e in tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    ]
    assert ages == [0, 89]
    assert pm_row(pm["id"]).status == "active"
