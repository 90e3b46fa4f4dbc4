"""Money after crashes: a mint whose worker died before the provider call, and one that died between
the provider's answer and its commit; the five-minute mint lease, the in-progress codes of the
allowance's operations, the expiry and reservation sweep, and the error codes that need a prepared
state.

A killed worker is represented by the state it leaves behind: the mint's reservation committed by
the API under its lease, its job recorded but never run by a worker (the message to the worker is
not sent: ``infra.jobs.enqueue_jobs_after_commit`` is replaced for that one request, and the request
does not wait for it: the only stand-ins here), and, for the second case, the provider's real mint
made through the adapter with the credential id as key, its outcome never written. The lease is then
made stale as five minutes would.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal

import pytest
import urllib3
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlmodel import select

from app.api import Call
from config.settings import get_settings
from domain.agentic import allowance_work, units
from infra import jobs as jobs_module
from infra.task import AttemptFailed
from storage.db import session_scope
from storage.models import Job
from storage.models_agentic import OperationLease
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from tasks.agentic import MintCredential, sweep_allowances
from tests.agentic.test_allowances_credentials import admin_count
from tests.conftest import SANDBOX_PORT
from tests.factories.agentic import AMEX, BASE, assert_problem, created
from tests.factories.allowances import (
    ALLOWANCES,
    CANCEL_FAILS_ONCE,
    MINT_FAILS,
    allowance,
    amounts,
    credential_rows,
    events_of,
    mint,
    read,
    usd,
    verify,
)

pytestmark = pytest.mark.api


def _reserve_without_worker(tenant, alw_id: str, value: str, monkeypatch) -> Job:
    """A mint the API recorded (amount reserved under the lease) whose worker never ran it."""
    monkeypatch.setattr(jobs_module, "enqueue_jobs_after_commit", lambda *args, **kwargs: None)

    async def no_wait(self, job_ids, *, timeout):  # nothing will run the job: the request stops waiting
        return {}

    monkeypatch.setattr(Call, "wait_for_jobs", no_wait)
    try:
        answer = mint(tenant.client, alw_id, value)
    finally:
        monkeypatch.undo()
    assert_problem(answer, 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS")  # the wait ended: the mint is running
    [row] = credential_rows(alw_id)
    assert row.state == "minting"
    with session_scope() as session:
        return session.get(Job, row.job_id)


def _stale_lease(alw_id: str) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with session_scope() as session:
        session.execute(update(OperationLease).where(OperationLease.resource_id == alw_id).values(expires_at=past))


def test_a_mint_whose_worker_died_before_the_call_is_settled_by_the_sweep(tenant, monkeypatch):
    alw = allowance(tenant.client, AMEX, "50.00")
    job = _reserve_without_worker(tenant, alw["id"], "10.00", monkeypatch)
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(40), Decimal(10), Decimal(0))
    # while its lease is live, the reservation holds and blocks the allowance's other operations
    assert_problem(mint(tenant.client, alw["id"], "1.00"), 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS")
    assert_problem(
        tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"description": "x"}), 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS"
    )
    assert_problem(tenant.client.delete(f"{ALLOWANCES}/{alw['id']}"), 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS")
    assert_problem(
        tenant.client.delete(f"{BASE}/{alw['payment_method_id']}"), 409, "PAYMENT_METHOD_OPERATION_IN_PROGRESS"
    )
    sweep_allowances()
    assert amounts(read(tenant.client, alw["id"]))[2] == Decimal(10)

    _stale_lease(alw["id"])
    sweep_allowances()

    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(40), Decimal(0), Decimal(10))
    assert credential_rows(alw["id"]) == []
    # the job, run late, finds its mint settled: no provider call, no amount moves
    MintCredential().run(str(job.id))
    assert admin_count(tenant, alw["id"]) == 0
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(40), Decimal(0), Decimal(10))
    answer = mint(tenant.client, alw["id"], "40.00")
    assert answer.status == 201, answer
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(0), Decimal(0), Decimal(50))


def test_a_mint_whose_worker_died_after_the_provider_answered_is_settled_by_the_next_mint(tenant, monkeypatch):
    alw = allowance(tenant.client, AMEX, "50.00")
    job = _reserve_without_worker(tenant, alw["id"], "10.00", monkeypatch)
    outcome = allowance_work.perform_mint(job, get_settings())  # the provider mints ...
    assert outcome.credential["id"].startswith("spt_")  # ... and the worker dies before writing it
    assert admin_count(tenant, alw["id"]) == 1
    _stale_lease(alw["id"])

    answer = mint(tenant.client, alw["id"], "5.00")

    assert answer.status == 201, answer
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(35), Decimal(0), Decimal(15))
    assert [r.state for r in credential_rows(alw["id"])] == ["issued"]
    assert admin_count(tenant, alw["id"]) == 2
    # the dead worker's job, redelivered, changes nothing more
    MintCredential().run(str(job.id))
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal(35), Decimal(0), Decimal(15))
    assert admin_count(tenant, alw["id"]) == 2


def test_a_stale_reservation_becomes_spent_on_update_cancellation_or_verification(tenant, monkeypatch):
    for operation in ("update", "cancel", "verify"):
        alw = allowance(tenant.client, "4242424242424242", "30.00")
        _reserve_without_worker(tenant, alw["id"], "7.00", monkeypatch)
        _stale_lease(alw["id"])
        if operation == "update":
            answer = tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"description": "after"})
            assert answer.status == 200, answer
        elif operation == "cancel":
            assert tenant.client.delete(f"{ALLOWANCES}/{alw['id']}").status == 204
        else:
            assert verify(tenant.client, alw["id"], "start").status == 200
        assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(23), Decimal(0), Decimal(7)), operation


def _lease(alw_id: str, tenant_id, operation: str) -> None:
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        session.add(
            OperationLease(
                resource_id=alw_id,
                tenant_id=tenant_id,
                operation=operation,
                owner="op_someone",
                acquired_at=now,
                expires_at=now + dt.timedelta(seconds=60),
            )
        )


def test_the_in_progress_codes_of_each_operation(tenant):
    codes = {
        "update": "ALLOWANCE_UPDATE_IN_PROGRESS",
        "setup": "ALLOWANCE_UPDATE_IN_PROGRESS",
        "verify": "ALLOWANCE_VERIFICATION_IN_PROGRESS",
        "cancel": "ALLOWANCE_DELETE_IN_PROGRESS",
    }
    for operation, code in codes.items():
        alw = allowance(tenant.client)
        _lease(alw["id"], tenant.id, operation)
        assert_problem(tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"description": "x"}), 409, code)
        assert_problem(verify(tenant.client, alw["id"], "start"), 409, code)
        assert_problem(tenant.client.delete(f"{ALLOWANCES}/{alw['id']}"), 409, code)
        assert_problem(mint(tenant.client, alw["id"], "1.00"), 409, code)
        assert amounts(read(tenant.client, alw["id"])) == (Decimal(100), Decimal(100), Decimal(0), Decimal(0))


def test_expiry_is_terminal_and_swept(tenant):
    alw = allowance(tenant.client, AMEX, "20.00")
    with session_scope() as session:
        session.execute(
            update(Allowance)
            .where(Allowance.id == alw["id"])
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
    assert read(tenant.client, alw["id"])["status"] == "expired"
    assert_problem(mint(tenant.client, alw["id"], "1.00"), 400, "ALLOWANCE_EXPIRED")
    assert_problem(tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"description": "x"}), 400, "ALLOWANCE_EXPIRED")
    assert tenant.client.delete(f"{ALLOWANCES}/{alw['id']}").status == 204
    sweep_allowances()
    with session_scope() as session:
        assert session.get(Allowance, alw["id"]).status == "expired"
    assert {"allowance": {"id": alw["id"], "status": "expired"}} in events_of(tenant.id, "agentic.allowance.updated")
    listed = tenant.client.get(f"{ALLOWANCES}?status=expired&payment_method_id={alw['payment_method_id']}")
    assert [a["id"] for a in listed.json["data"]] == [alw["id"]]


def test_a_provider_refusing_an_update_leaves_the_allowance_unchanged(tenant):
    alw = allowance(tenant.client, AMEX, "20.00", description="kept")
    with session_scope() as session:
        [rail] = session.exec(select(AllowanceRail).where(AllowanceRail.allowance_id == alw["id"])).all()
    # the provider cancelled its allowance on its side: it refuses every update
    answer = urllib3.request(
        "POST",
        f"http://127.0.0.1:{SANDBOX_PORT}/agentic/psp/allowances/{rail.provider_allowance_id}/cancel",
        body=b"{}",
        headers={"Content-Type": "application/json", "Idempotency-Key": str(uuid.uuid4())},
    )
    assert answer.status == 200, answer.data
    refused = tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"amount": usd("30.00"), "description": "new"})
    assert_problem(refused, 422, "PROVIDER_ALLOWANCE_UPDATE_FAILED")
    now = read(tenant.client, alw["id"])
    assert now["amount"] == usd("20.00") and now["description"] == "kept"
    assert now["updated_at"] == alw["updated_at"]
    errors = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/errors").json["data"]
    assert [(e["code"], e["operation"]) for e in errors] == [("PROVIDER_ALLOWANCE_UPDATE_FAILED", "allowance_update")]


def test_a_lost_create_commit_is_terminal_for_its_key(tenant, monkeypatch):
    pm = created(tenant.client, AMEX)
    real_commit = units.commit

    def lossy(session):
        real_commit(session)
        raise ConnectionError("the server closed the connection unexpectedly")

    monkeypatch.setattr(units, "commit", lossy)
    body = {"payment_method_id": pm["id"], "amount": usd("9.00")}
    headers = {"TS-IDEMPOTENCY-KEY": "alw-lost"}
    assert_problem(tenant.client.post(ALLOWANCES, body, headers=headers), 409, "CREATE_OUTCOME_UNKNOWN")
    monkeypatch.setattr(units, "commit", real_commit)
    assert_problem(tenant.client.post(ALLOWANCES, body, headers=headers), 409, "CREATE_OUTCOME_UNKNOWN")
    listed = tenant.client.get(f"{ALLOWANCES}?payment_method_id={pm['id']}").json["data"]
    assert len(listed) == 1
    assert json.dumps(listed[0]["amount"]) == json.dumps(usd("9.00"))


def test_a_key_held_by_a_running_mint_answers_in_progress_and_then_its_outcome(tenant, monkeypatch):
    alw = allowance(tenant.client, MINT_FAILS, "30.00")
    headers_key = "mint-running"

    async def no_wait(self, job_ids, *, timeout):  # the request stops waiting before the worker ends
        return {}

    monkeypatch.setattr(Call, "wait_for_jobs", no_wait)
    monkeypatch.setattr(jobs_module, "enqueue_jobs_after_commit", lambda *args, **kwargs: None)
    first = mint(tenant.client, alw["id"], "5.00", key=headers_key)
    monkeypatch.undo()
    assert_problem(first, 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS")
    assert_problem(mint(tenant.client, alw["id"], "5.00", key=headers_key), 409, "IDEMPOTENCY_IN_PROGRESS")
    [pending] = credential_rows(alw["id"])
    with pytest.raises(AttemptFailed):  # the worker ends it: a conclusive failure, reported as FAILURE
        MintCredential().run(str(pending.job_id))
    assert_problem(mint(tenant.client, alw["id"], "5.00", key=headers_key), 422, "PROVIDER_CREDENTIALS_FAILED")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(30), Decimal(0), Decimal(0))


def test_a_key_whose_mint_succeeded_after_its_request_stopped_waiting_answers_payload_unavailable(tenant, monkeypatch):
    alw = allowance(tenant.client, AMEX, "30.00")

    async def no_wait(self, job_ids, *, timeout):
        return {}

    monkeypatch.setattr(Call, "wait_for_jobs", no_wait)
    monkeypatch.setattr(jobs_module, "enqueue_jobs_after_commit", lambda *args, **kwargs: None)
    assert_problem(mint(tenant.client, alw["id"], "5.00", key="late"), 409, "ALLOWANCE_CREDENTIAL_IN_PROGRESS")
    monkeypatch.undo()
    [pending] = credential_rows(alw["id"])
    MintCredential().run(str(pending.job_id))
    assert_problem(mint(tenant.client, alw["id"], "5.00", key="late"), 409, "CREDENTIAL_PAYLOAD_UNAVAILABLE")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(25), Decimal(0), Decimal(5))
    shown = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/credentials/{pending.id}")
    assert shown.status == 200 and "credential" not in shown.json
    [issued] = credential_rows(alw["id"])
    assert issued.sealed is not None and b"spt_" not in issued.sealed  # encrypted while it waits
    with session_scope() as session:  # nobody takes it: ten minutes on, the sweep destroys it
        session.execute(
            update(PaymentCredential)
            .where(PaymentCredential.id == pending.id)
            .values(created_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=11))
        )
    sweep_allowances()
    assert [r.sealed for r in credential_rows(alw["id"])] == [None]


def test_a_stopped_payment_method_delete_blocks_minting_and_resumes(tenant):
    alw = allowance(tenant.client, CANCEL_FAILS_ONCE, "30.00")
    pm_path = f"{BASE}/{alw['payment_method_id']}"
    assert_problem(tenant.client.delete(pm_path), 500, "PROVIDER_ALLOWANCE_CANCEL_FAILED")
    assert read(tenant.client, alw["id"])["status"] == "pending_verification"
    assert_problem(mint(tenant.client, alw["id"], "1.00"), 400, "PAYMENT_METHOD_DELETED")
    assert_problem(verify(tenant.client, alw["id"], "start"), 400, "PAYMENT_METHOD_DELETED")
    assert_problem(
        tenant.client.post(ALLOWANCES, {"payment_method_id": alw["payment_method_id"], "amount": usd("1.00")}),
        400,
        "PAYMENT_METHOD_DELETED",
    )
    # the repeated DELETE resumes and succeeds
    assert tenant.client.delete(pm_path).status == 204
    assert read(tenant.client, alw["id"])["status"] == "cancelled"
    assert tenant.client.get(pm_path).json["status"] == "deleted"
    codes = [e["code"] for e in tenant.client.get(f"{ALLOWANCES}/{alw['id']}/errors").json["data"]]
    assert codes == ["PROVIDER_ALLOWANCE_CANCEL_FAILED"]


def test_the_database_refuses_amounts_that_do_not_add_up(tenant):
    alw = allowance(tenant.client, AMEX, "10.00")
    for values in ({"amount_spent": Decimal(1)}, {"amount_available": Decimal(-1), "amount_spent": Decimal(11)}):
        with pytest.raises(IntegrityError), session_scope() as session:
            session.execute(update(Allowance).where(Allowance.id == alw["id"]).values(**values))
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(10), Decimal(10), Decimal(0), Decimal(0))


def test_deleting_the_payment_method_leaves_an_expired_allowance_expired(tenant):
    alw = allowance(tenant.client, AMEX, "20.00")
    live = tenant.client.post(ALLOWANCES, {"payment_method_id": alw["payment_method_id"], "amount": usd("5.00")}).json
    with session_scope() as session:
        session.execute(
            update(Allowance)
            .where(Allowance.id == alw["id"])
            .values(expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
    assert tenant.client.delete(f"{BASE}/{alw['payment_method_id']}").status == 204
    assert read(tenant.client, alw["id"])["status"] == "expired"
    assert read(tenant.client, live["id"])["status"] == "cancelled"
