"""Idempotency keys of payment method creates: the whole table of spec 001 section 8, races, expiry."""

from __future__ import annotations

import datetime as dt
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import update
from sqlmodel import select

from domain.agentic import service, units
from storage.db import session_scope
from storage.models_agentic import IdempotencyRecord, PaymentMethod
from tests.factories.agentic import (
    AMEX,
    BASE,
    DISCOVER,
    HANGS,
    VISA,
    a_uuid,
    assert_problem,
    body,
    card_token,
    create,
    fresh_visa,
    key_header,
    outcome,
    provider_requests,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.api


def _consumer(consumer_id: str | None = None) -> dict:
    return {"email": "ada@example.com", "id": consumer_id or a_uuid()}


def _of_consumer(client, consumer_id: str) -> list[str]:
    answer = client.get(f"{BASE}?status=all&consumer_id={consumer_id}")
    assert answer.status == 200
    return [pm["id"] for pm in answer.json["data"]]


def _record(tenant_id, key: str) -> IdempotencyRecord | None:
    with session_scope() as session:
        return session.get(IdempotencyRecord, (tenant_id, "payment-method.create", key))


def test_same_key_and_body_after_success_returns_the_original_resource(tenant, sandbox):
    number = fresh_visa()
    token_id = card_token(tenant.client, number)
    consumer = _consumer()
    first = create(tenant.client, token_id, key="k-1", consumer=consumer)
    assert first.status == 201, first

    again = create(tenant.client, token_id, key="k-1", consumer=consumer)

    assert again.status == 201, again
    assert again.json == first.json
    assert _of_consumer(tenant.client, consumer["id"]) == [first.json["id"]]
    assert provider_requests(sandbox, "agentic.vic.enrollments.create", number) == 1  # no provider call


def test_the_replay_shows_the_resource_as_it_is_now(tenant):
    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    first = create(tenant.client, token_id, key="k-now", consumer=consumer).json
    assert tenant.client.delete(f"{BASE}/{first['id']}").status == 204
    again = create(tenant.client, token_id, key="k-now", consumer=consumer)
    assert again.status == 201 and again.json["id"] == first["id"] and again.json["status"] == "deleted"


def test_same_key_with_a_different_body_is_a_conflict(tenant):
    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    assert create(tenant.client, token_id, key="k-2", consumer=consumer).status == 201

    for changed in (
        {"consumer": {**consumer, "email": "eve@example.com"}},
        {"consumer": _consumer()},
        {"consumer": consumer, "agent_id": "agt_x"},
    ):
        assert_problem(create(tenant.client, token_id, key="k-2", **changed), 409, "IDEMPOTENCY_CONFLICT")
    other_token = card_token(tenant.client, VISA)
    assert_problem(create(tenant.client, other_token, key="k-2", consumer=consumer), 409, "IDEMPOTENCY_CONFLICT")
    assert len(_of_consumer(tenant.client, consumer["id"])) == 1


def test_same_key_while_running_is_in_progress(tenant):
    token_id = card_token(tenant.client, HANGS)  # vic hangs: the first request runs for 8 s
    consumer = _consumer()
    answers = {}
    thread = threading.Thread(
        target=lambda: answers.setdefault("first", create(tenant.client, token_id, key="k-3", consumer=consumer))
    )
    thread.start()
    wait_until(lambda: (record := _record(tenant.id, "k-3")) and record.resource_id, timeout=5)

    assert_problem(create(tenant.client, token_id, key="k-3", consumer=consumer), 409, "IDEMPOTENCY_IN_PROGRESS")
    assert_problem(create(tenant.client, token_id, key="k-3", consumer=_consumer()), 409, "IDEMPOTENCY_CONFLICT")
    thread.join(30)
    first = answers["first"]
    assert first.status == 201
    assert outcome(first.json) == {"vic": "PROVIDER_ENROLLMENT_FAILED", "psp": "enabled"}
    again = create(tenant.client, token_id, key="k-3", consumer=consumer)
    assert again.status == 201 and again.json["id"] == first.json["id"]


def test_a_conclusive_failure_replays_the_same_code_and_status(tenant):
    missing = a_uuid()
    consumer = _consumer()
    first = assert_problem(create(tenant.client, missing, key="k-4", consumer=consumer), 400, "INVALID_TOKEN")
    # the token now exists, but the key's answer is settled
    made = tenant.client.post(
        "/tokens",
        {
            "type": "card",
            "id": missing,
            "data": {"number": AMEX, "expiration_month": 12, "expiration_year": dt.date.today().year + 2},
        },
    )
    assert made.status == 201, made

    for _ in range(2):
        again = assert_problem(create(tenant.client, missing, key="k-4", consumer=consumer), 400, "INVALID_TOKEN")
        assert again == first
    assert _of_consumer(tenant.client, consumer["id"]) == []
    assert create(tenant.client, missing, key="k-4-new", consumer=consumer).status == 201

    assert_problem(create(tenant.client, card_token(tenant.client, DISCOVER), key="k-5"), 400, "UNSUPPORTED_PROVIDER")
    assert_problem(create(tenant.client, card_token(tenant.client, DISCOVER), key="k-5"), 409, "IDEMPOTENCY_CONFLICT")
    token_id = card_token(tenant.client, AMEX)
    assert_problem(create(tenant.client, token_id, key="k-6", agent_id="agt_none"), 404, "AGENT_NOT_FOUND")
    assert_problem(create(tenant.client, token_id, key="k-6", agent_id="agt_none"), 404, "AGENT_NOT_FOUND")


def test_an_unknown_outcome_is_terminal(tenant, monkeypatch):
    """The commit happened but its answer was lost: the answer, and every replay, is
    CREATE_OUTCOME_UNKNOWN; the payment method is found by its consumer."""
    real_commit = units.commit

    def lossy(session):
        real_commit(session)
        raise ConnectionError("the server closed the connection unexpectedly")

    monkeypatch.setattr(units, "commit", lossy)
    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    problem = assert_problem(
        create(tenant.client, token_id, key="k-7", consumer=consumer), 409, "CREATE_OUTCOME_UNKNOWN"
    )
    assert "consumer_id" in problem["detail"]
    monkeypatch.setattr(units, "commit", real_commit)

    for _ in range(3):
        assert_problem(create(tenant.client, token_id, key="k-7", consumer=consumer), 409, "CREATE_OUTCOME_UNKNOWN")
    assert len(_of_consumer(tenant.client, consumer["id"])) == 1
    assert create(tenant.client, token_id, key="k-7b", consumer=consumer).status == 201


def test_a_key_left_running_by_a_dead_request_is_settled_on_replay(tenant):
    token_id = card_token(tenant.client, AMEX)
    payload = body(token_id, consumer=_consumer())
    from domain.agentic.idempotency import request_hash

    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with session_scope() as session:  # died before its payment method was committed
        session.add(
            IdempotencyRecord(
                tenant_id=tenant.id,
                scope="payment-method.create",
                key="k-dead",
                request_hash=request_hash(payload),
                owner="op_dead",
                expires_at=past,
            )
        )
    for _ in range(2):
        assert_problem(tenant.client.post(BASE, payload, headers=key_header("k-dead")), 409, "CREATE_OUTCOME_UNKNOWN")

    committed = create(tenant.client, token_id, consumer=payload["consumer"]).json  # died after its commit
    with session_scope() as session:
        session.add(
            IdempotencyRecord(
                tenant_id=tenant.id,
                scope="payment-method.create",
                key="k-late",
                request_hash=request_hash(payload),
                owner="op_dead",
                expires_at=past,
                resource_id=committed["id"],
            )
        )
    replay = tenant.client.post(BASE, payload, headers=key_header("k-late"))
    assert replay.status == 201 and replay.json["id"] == committed["id"]
    assert _record(tenant.id, "k-late").state == "succeeded"


def test_an_internal_error_before_the_commit_frees_the_key(tenant, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    monkeypatch.setattr(service, "create_payment_method", broken)
    assert_problem(create(tenant.client, token_id, key="k-8", consumer=consumer), 500, "INTERNAL_ERROR")
    monkeypatch.undo()
    assert _record(tenant.id, "k-8") is None
    again = create(tenant.client, token_id, key="k-8", consumer=consumer)
    assert again.status == 201, again


def test_records_never_expire(tenant):
    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    first = create(tenant.client, token_id, key="k-9", consumer=consumer).json
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=3 * 365)
    with session_scope() as session:
        session.execute(
            update(IdempotencyRecord)
            .where(IdempotencyRecord.key == "k-9")
            .values(created_at=long_ago, completed_at=long_ago)
        )
    assert create(tenant.client, token_id, key="k-9", consumer=consumer).json["id"] == first["id"]
    assert_problem(create(tenant.client, token_id, key="k-9"), 409, "IDEMPOTENCY_CONFLICT")


def test_the_key_alone_defines_sameness(tenant, other_tenant):
    token_id = card_token(tenant.client, AMEX)
    consumer = _consumer()
    ids = {create(tenant.client, token_id, key=key, consumer=consumer).json["id"] for key in ("a", "b")}
    ids |= {create(tenant.client, token_id, consumer=consumer).json["id"] for _ in range(2)}  # no key: new each time
    assert len(ids) == 4
    assert sorted(_of_consumer(tenant.client, consumer["id"])) == sorted(ids)
    theirs = create(other_tenant.client, card_token(other_tenant.client, AMEX), key="a", consumer=consumer)
    assert theirs.status == 201 and theirs.json["id"] not in ids  # keys are per tenant


def test_twenty_concurrent_creates_with_one_key_make_one_payment_method(tenant, sandbox):
    number = fresh_visa()
    token_id = card_token(tenant.client, number)
    consumer = _consumer()
    barrier = threading.Barrier(20)

    def send(_):
        barrier.wait()
        return create(tenant.client, token_id, key="k-race", consumer=consumer)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(send, range(20)))

    statuses = sorted(a.status for a in answers)
    assert set(statuses) <= {201, 409}, statuses
    assert statuses.count(409) >= 1  # the race was real: some arrived while the first was running
    assert all(a.json["type"] == "IDEMPOTENCY_IN_PROGRESS" for a in answers if a.status == 409)
    created_ids = {a.json["id"] for a in answers if a.status == 201}
    assert len(created_ids) == 1
    assert _of_consumer(tenant.client, consumer["id"]) == list(created_ids)
    with session_scope() as session:
        rows = session.exec(
            select(PaymentMethod).where(PaymentMethod.tenant_id == tenant.id, PaymentMethod.idempotency_key == "k-race")
        ).all()
    assert [row.id for row in rows] == list(created_ids)
    assert provider_requests(sandbox, "agentic.vic.enrollments.create", number) == 1
    assert create(tenant.client, token_id, key="k-race", consumer=consumer).json["id"] in created_ids


def test_key_validation(tenant):
    token_id = card_token(tenant.client, AMEX)
    for bad in ("x" * 256, "caf\u00e9"):
        answer = tenant.client.post(
            BASE,
            body(token_id),
            headers=key_header(bad) if bad.isascii() else {"TS-IDEMPOTENCY-KEY": bad.encode().decode("latin-1")},
        )
        problem = assert_problem(answer, 400, "VALIDATION_ERROR")
        assert list(problem["errors"]) == ["TS-IDEMPOTENCY-KEY"]
    assert tenant.client.get(BASE).json["data"] == []
