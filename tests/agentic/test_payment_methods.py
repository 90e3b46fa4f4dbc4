"""Payment methods over HTTP with a real worker and the sandbox: every SANDBOX.md payment-method row,
rails in parallel, pending rails and their event, retries, the card object, validation, permissions."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import threading
import time
import uuid

import pytest
from sqlalchemy import delete, update
from sqlmodel import col, select

from domain.webhooks.events import EVENT_TYPES
from providers import agentic_http as providers
from storage.db import session_scope
from storage.driver import PREFIX
from storage.models import Job, Token
from storage.models_agentic import OperationLease, PaymentMethod
from storage.models_tenancy import TokenActivity
from storage.states import JobStatus
from storage.types import utcnow
from tests.factories.agentic import (
    AMEX,
    BASE,
    DISCOVER,
    FAILS_ON_CREATE,
    HANGS,
    MASTERCARD,
    PENDING,
    RAIL_EVENT,
    REJECTED,
    VISA,
    a_uuid,
    assert_problem,
    body,
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
    rail_events,
    rail_rows,
    rails,
    settled,
    subscribe,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.api

# ---- SANDBOX.md, agentic providers: rails after create ---------------------------------------------


@pytest.mark.parametrize(
    ("number", "expected"),
    [
        (VISA, {"vic": "enabled", "psp": "enabled"}),
        (MASTERCARD, {"agentpay": "enabled", "psp": "enabled"}),
        (AMEX, {"psp": "enabled"}),
        (REJECTED, {"vic": "CARD_REJECTED", "psp": "enabled"}),
        (FAILS_ON_CREATE, {"vic": "PROVIDER_ENROLLMENT_FAILED", "psp": "enabled"}),
        (PENDING, {"vic": "pending", "psp": "enabled"}),
    ],
)
def test_rails_after_create_follow_the_sandbox_table(tenant, number, expected):
    answer = create(tenant.client, card_token(tenant.client, number))

    assert answer.status == 201, answer
    pm = answer.json
    assert outcome(pm) == expected
    assert [r["rail"] for r in pm["rails"]] == ["agentic-token" if p != "psp" else "spt" for p in expected]
    for rail in pm["rails"]:
        assert ("error" in rail) == (rail["status"] == "error")
        if rail["status"] == "enabled":
            assert rail["provider_ids"] and all(isinstance(v, str) and v for v in rail["provider_ids"].values())
    assert get(tenant.client, pm["id"])["rails"] == pm["rails"]


def test_a_visa_payment_method_in_full(tenant):
    token_id = card_token(tenant.client, VISA)
    answer = create(
        tenant.client, token_id, consumer={"email": "ada@example.com", "country_code": "gb", "language_code": "en-gb"}
    )

    assert answer.status == 201
    pm = answer.json
    assert pm["id"].startswith("pm_") and len(pm["id"]) == 35
    assert pm["status"] == "active"
    assert pm["source"] == {"type": "svc_card_token", "token_id": token_id}
    consumer = pm["consumer"]
    assert consumer["email"] == "ada@example.com"
    assert consumer["country_code"] == "GB" and consumer["language_code"] == "en-GB"
    assert str(uuid.UUID(consumer["id"])) == consumer["id"]  # generated
    assert "agent_id" not in pm
    card = pm["card"]
    assert card["type"] == "card" and card["brand"] == "visa" and card["last4"] == "4242"
    assert card["expiration_month"] == 12 and card["bin"] == "42424242" and card["funding"] == "credit"
    assert card["issuer"]["name"] and card["issuer_country"]["alpha2"] == "US"
    assert card["display"]["background_color"] == "#1A1F71" and card["display"]["art_url"]
    text = answer.raw.decode()
    assert VISA not in text and '"123"' not in text and "cvc" not in text  # no number, no security code
    assert dt.datetime.fromisoformat(pm["updated_at"]) >= dt.datetime.fromisoformat(pm["created_at"])
    assert rails(pm)[("agentic-token", "vic")]["provider_ids"].keys() == {"enrollment_reference", "token_reference"}
    assert rails(pm)[("spt", "psp")]["provider_ids"].keys() == {"payment_method"}


def test_the_card_number_and_code_are_never_stored_on_the_payment_method(tenant):
    pm = created(tenant.client, VISA)
    row = pm_row(pm["id"])
    rail_data = [(r.provider_ids, r.enrollment_id) for r in rail_rows(pm["id"])]
    stored = repr((row.source, row.consumer, row.card, rail_data))
    assert VISA not in stored and "'123'" not in stored and "cvc" not in stored


def test_each_rail_is_its_own_job_and_they_run_in_parallel(tenant):
    """The hanging card: vic never answers. psp is enabled long before vic's call times out, and the
    answer comes after one provider timeout (8 s), not later."""
    token_id = card_token(tenant.client, HANGS)
    answers = {}
    started = time.monotonic()
    thread = threading.Thread(target=lambda: answers.setdefault("create", create(tenant.client, token_id)))
    thread.start()
    listed = wait_until(lambda: (page := tenant.client.get(BASE).json["data"]) and page[0], timeout=5)
    seen = wait_until(
        lambda: (pm := get(tenant.client, listed["id"])) and outcome(pm)["psp"] == "enabled" and pm, timeout=5
    )
    assert outcome(seen)["vic"] == "pending"  # vic's call is still in flight on another worker
    thread.join(30)
    elapsed = time.monotonic() - started
    pm = answers["create"].json
    assert answers["create"].status == 201
    assert outcome(pm) == {"vic": "PROVIDER_ENROLLMENT_FAILED", "psp": "enabled"}
    assert 7 < elapsed < 12
    kinds = sorted(job.kind for job in jobs_of(pm["id"]))
    assert kinds == ["agentic.enroll_rail", "agentic.enroll_rail"]
    errors = tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    assert [(e["code"], e["provider"], e["provider_code"]) for e in errors] == [
        ("PROVIDER_ENROLLMENT_FAILED", "vic", None)
    ]
    assert "in time" in errors[0]["detail"]


def _recorded(monkeypatch, owner, name: str) -> list[tuple]:
    """The arguments of every call of ``owner.<name>`` from now on (the function still runs)."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def _inserted_tables(monkeypatch) -> list[list[str]]:
    """The tables of each one-statement insert of the payment method service from now on (the list
    fills as they run)."""
    from domain.agentic import service

    written: list[list[str]] = []

    def recorded(insert_rows):
        def insert(session, rows):
            written.append(sorted(table.name for (table, _), batch in rows.tables.items() if batch))
            insert_rows(session, rows)

        return insert

    for name in ("insert_rows", "insert_rows_last", "stage_inserts"):
        monkeypatch.setattr(service, name, recorded(getattr(service, name)))
    return written


def test_a_create_is_one_statement_and_both_rail_jobs_go_out_together(tenant, monkeypatch):
    """The payment method, its rails, both enrollment jobs, the enroll lease, the log row and the card
    token's activity of the month: one insert, the create's only write; both rail jobs go out in one
    message (``job_id`` and ``sibling_ids``, run side by side by one task run)."""
    from infra import dispatch

    token_id = card_token(tenant.client, VISA)
    written = _inserted_tables(monkeypatch)
    sent = []
    send_messages = dispatch.send_messages

    def send(messages):
        sent.append([(name, kwargs) for name, _, kwargs in messages])
        send_messages(messages)

    monkeypatch.setattr(dispatch, "send_messages", send)
    answer = create(tenant.client, token_id)
    assert answer.status == 201
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    assert written == [
        sorted(
            [
                "agentic_operation_leases",
                "agentic_payment_method_rails",
                "agentic_payment_methods",
                "audit_logs",
                "jobs",
                "token_activity",
            ]
        )
    ]
    enrollments = [batch for batch in sent if any(name == "agentic.enroll_rail" for name, _ in batch)]
    jobs = {str(job.id) for job in jobs_of(answer.json["id"])}
    assert len(enrollments) == 1 and len(enrollments[0]) == 1  # one message: the first job, its sibling
    ((_, kwargs),) = enrollments[0]
    assert {kwargs["job_id"], *kwargs["sibling_ids"]} == jobs and len(jobs) == 2


def test_both_rails_outcomes_are_written_in_one_statement(tenant):
    """Both enabled rails' outcomes (the jobs' locks, then the payment method's, each rail, the card
    merged once, the enroll lease released, both jobs completed) are one durable statement, no
    transaction around it (``domain.agentic.enrollment.enrolled_together``)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    token_id = card_token(tenant.client, VISA)
    seen: list[tuple[str, str]] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        seen.append((statement, str(parameters)))

    event.listen(Engine, "before_cursor_execute", record)  # every engine: the api's and the worker's
    try:
        answer = create(tenant.client, token_id)
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    assert answer.status == 201
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    job_ids = [str(job.id) for job in jobs_of(answer.json["id"])]
    assert len(job_ids) == 2
    for job_id in job_ids:  # other tests' jobs may still run beside it: its own
        mine = [(statement, parameters) for statement, parameters in seen if job_id in parameters]
        written = [(text, values) for text, values in mine if "UPDATE agentic_payment_method_rails" in text]
        assert len(written) == 1
        text, values = written[0]
        assert all(each in values for each in job_ids)  # the sibling's outcome in the same statement
        assert text.lstrip().startswith("WITH locked_jobs")  # the jobs locked first
        assert "DELETE FROM agentic_operation_leases" in text and "UPDATE jobs" in text
        assert not [statement for statement, _ in mine if statement.rstrip().endswith("FOR UPDATE")]
    with session_scope() as session:
        assert session.get(OperationLease, answer.json["id"]) is None  # the last rail released it


def _activity_writes(statements: list[str]) -> int:
    return sum(bool(re.search(r'INSERT INTO "?token_activity', statement)) for statement in statements)


def test_a_card_token_counted_this_month_is_not_counted_again_by_its_rail_jobs(tenant):
    """The create counts the card token's activity with its own rows; each rail job's lease reads
    that it counts already and writes nothing more (one statement fewer per rail)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    token_id = card_token(tenant.client, VISA)
    seen: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", record)  # every engine: the api's, the autocommit engine
    try:
        answer = create(tenant.client, token_id)
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    assert answer.status == 201
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    assert [job.status for job in jobs_of(answer.json["id"])] == ["succeeded", "succeeded"]
    assert _activity_writes(seen) == 1  # the create's, in its one statement


def test_a_rail_job_counts_a_card_token_not_yet_counted_this_month(tenant):
    """A retry in a month where the token was not yet counted (here: its rows removed): the rail job
    counts it."""
    pm = created(tenant.client, FAILS_ON_CREATE)
    tenant_id = rail_rows(pm["id"])[0].tenant_id
    with session_scope() as session:
        session.execute(delete(TokenActivity).where(col(TokenActivity.tenant_id) == tenant_id))
    answer = retry(tenant.client, pm["id"])
    assert answer.status == 200, answer
    with session_scope() as session:
        counted = session.exec(select(TokenActivity).where(TokenActivity.tenant_id == tenant_id)).all()
    assert [(row.token_id, row.month) for row in counted] == [
        (pm["source"]["token_id"], dt.date.today().replace(day=1))
    ]


def test_enrollment_reads_judge_the_card_token_at_each_lease(tenant):
    """A worker builds its lease reads once and keeps them: a card token that expires after they were
    built reads as gone at the next lease (its time, not the time the reads were built)."""
    from domain.agentic.enrollment import enrollment_reads
    from infra import jobs as job_protocol
    from infra.dispatch import take_pending

    pm = created(tenant.client, VISA)
    reads = enrollment_reads()  # built now, kept for every lease below
    rail = rail_rows(pm["id"])[0]

    def lease() -> dict:
        with session_scope() as session:
            job = job_protocol.record(
                session,
                kind="agentic.enroll_rail",
                tenant_id=rail.tenant_id,
                subject_type="rail",
                subject_id=str(rail.id),
                trace_id=None,
            )
            take_pending(session)  # no message: the test takes the lease itself
        leased = job_protocol.lease(job.id, "tests:owner", lease_seconds=5, reads=reads)
        assert leased is not None
        with session_scope() as session:
            job_protocol.settle(session, session.get(Job, job.id), JobStatus.SUCCEEDED, result={})
        return leased[1]

    first = lease()
    assert (first["token_type"], first["token_active"]) == ("card", True)
    with session_scope() as session:
        session.execute(
            update(Token)
            .where(Token.id == pm["source"]["token_id"])
            .values(expires_at=utcnow() + dt.timedelta(seconds=0.5))
        )
    time.sleep(0.7)
    later_read = lease()
    assert (later_read["token_type"], later_read["token_data_ct"]) == (None, None)


def test_a_create_whose_rails_all_settled_answers_without_a_lock(tenant, monkeypatch):
    """Both rails settled for good within the wait: the answer is read in one statement, no lock and
    no write; a rail still pending at its provider takes the locked path that flags it for its event."""
    from domain.agentic import service

    locked = _recorded(monkeypatch, service, "lock_existing")
    pm = created(tenant.client, VISA)
    assert outcome(pm) == {"vic": "enabled", "psp": "enabled"}
    assert locked == []
    assert pm == get(tenant.client, pm["id"])  # the same object a read answers
    pending = created(tenant.client, PENDING)
    assert "pending" in outcome(pending).values()
    assert [pm_id for _, pm_id in locked] == [pending["id"]]


def test_an_unsupported_network_is_400_unsupported_provider(tenant):
    answer = create(tenant.client, card_token(tenant.client, DISCOVER))
    assert_problem(answer, 400, "UNSUPPORTED_PROVIDER")
    assert tenant.client.get(BASE).json["data"] == []


# ---- pending rails ---------------------------------------------------------------------------------


def test_a_pending_rail_completes_by_itself_and_its_event_is_delivered(tenant, receiver, sandbox):
    subscribe(tenant, receiver.url)
    pm = created(tenant.client, PENDING)
    assert outcome(pm)["vic"] == "pending"
    assert "error" not in rails(pm)[("agentic-token", "vic")]

    hits = receiver.wait_for(lambda r: r.json["event"]["type"] == RAIL_EVENT, timeout=20)
    data = hits[0].json["event"]["data"]
    assert data["payment_method"] == {"id": pm["id"], "status": "active"}
    assert data["rail"]["rail"] == "agentic-token" and data["rail"]["provider"] == "vic"
    assert data["rail"]["status"] == "enabled" and "error" not in data["rail"]
    final = get(tenant.client, pm["id"])
    assert outcome(final) == {"vic": "enabled", "psp": "enabled"}
    assert later(final, pm)
    assert len(rail_events(tenant.id, pm["id"])) == 1  # psp was never pending: no event for it
    enrollment_id = rail_rows(pm["id"])[0].enrollment_id
    assert [e["id"] for e in provider_enrollments(sandbox, "vic", PENDING) if e["id"] == enrollment_id]


def test_the_event_type_is_offered_to_webhooks():
    assert RAIL_EVENT in EVENT_TYPES


# ---- retry -----------------------------------------------------------------------------------------


def retry(client, pm_id: str, rail: str = "agentic-token", provider: str = "vic"):
    return client.post(f"{BASE}/{pm_id}/rails/retry", {"rail": rail, "provider": provider})


def test_a_rejected_card_stays_in_error_on_retry(tenant):
    pm = created(tenant.client, REJECTED)
    before = get(tenant.client, pm["id"])

    problem = assert_problem(retry(tenant.client, pm["id"]), 422, "CARD_REJECTED")
    assert problem["debug"]["provider_correlation"].startswith("corr_")
    assert problem["detail"]
    after = get(tenant.client, pm["id"])
    assert outcome(after) == {"vic": "CARD_REJECTED", "psp": "enabled"}
    assert after["updated_at"] == before["updated_at"]  # nothing a client sees changed
    errors = tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    assert [e["code"] for e in errors] == ["CARD_REJECTED", "CARD_REJECTED"]
    assert errors[0]["provider_correlation_id"] == problem["debug"]["provider_correlation"]


def test_a_failed_rail_is_enabled_by_a_retry_which_backfills_the_display(tenant):
    pm = created(tenant.client, FAILS_ON_CREATE)
    assert outcome(pm)["vic"] == "PROVIDER_ENROLLMENT_FAILED"
    with session_scope() as session:  # as if no provider had sent display data so far
        row = session.get(PaymentMethod, pm["id"])
        row.card = {**row.card, "display": dict.fromkeys(row.card["display"])}
        session.add(row)

    answer = retry(tenant.client, pm["id"])

    assert answer.status == 200, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    assert answer.json["card"]["display"]["background_color"] == "#1A1F71"
    assert answer.json["card"]["display"]["art_url"]
    assert later(answer.json, pm)
    assert get(tenant.client, pm["id"]) == answer.json
    assert [job.result.get("rail_status") for job in jobs_of(pm["id"]) if job.status == "succeeded"].count(
        "enabled"
    ) == 2


def test_a_retry_records_its_job_token_activity_and_log_row_in_one_statement(tenant, monkeypatch):
    """Seen through SQLAlchemy's events (statements listened to: the session's path, not the
    driver's, ``storage.db.read_then_write``), the retry's recording is two statements: one read
    (the payment method locked, its rail, its lease, the card token; the lock of the job's gate sent
    before it, in its round trip), then, just before the commit, one write of the lease, the job,
    the card token's activity of the month, the log row and the rail's change. The job's message
    goes out between the two (the worker waits at the gate for the commit); the retried rail is
    enabled."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.engine import Engine

    from infra import dispatch

    pm = created(tenant.client, FAILS_ON_CREATE)
    seen: list[tuple[int | None, str]] = []
    send = dispatch.send_messages

    def sent(messages):
        seen.append((None, f"sent {[kwargs['job_id'] for _, _, kwargs in messages]}"))
        send(messages)

    monkeypatch.setattr(dispatch, "send_messages", sent)

    def record(connection, cursor, statement, parameters, context, executemany):
        prefix = context.execution_options.get(PREFIX)  # sent before it, in its round trip
        seen.append((id(connection), f"{prefix}; {statement}" if prefix else statement))

    def committed(connection):
        seen.append((id(connection), "COMMIT"))

    sa_event.listen(Engine, "before_cursor_execute", record)
    sa_event.listen(Engine, "commit", committed)
    try:
        answer = retry(tenant.client, pm["id"])
    finally:
        sa_event.remove(Engine, "before_cursor_execute", record)
        sa_event.remove(Engine, "commit", committed)
    assert answer.status == 200, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    start = next(n for n, (_, text) in enumerate(seen) if "FOR UPDATE OF agentic_payment_methods" in text)
    connection = seen[start][0]
    transaction = [text for key, text in seen[start:] if key in (connection, None)]
    transaction = transaction[: transaction.index("COMMIT")]
    assert len(transaction) == 3, transaction
    read, message, write = transaction
    assert read.startswith("SELECT pg_advisory_xact_lock(") and "FOR UPDATE OF agentic_payment_methods" in read
    retried_job = next(rail.job_id for rail in rail_rows(pm["id"]) if rail.provider == "vic")
    assert message == f"sent {[str(retried_job)]}"
    for table in ("agentic_operation_leases", "jobs", "token_activity", "audit_logs"):
        assert re.search(rf'INSERT INTO "?{table}"? ', write), table
    for table in ("jobs", "token_activity", "audit_logs"):  # the rows from JSON documents, no statement per row
        assert f'FROM json_populate_recordset(NULL::"{table}", ' in write
    assert "ON CONFLICT (resource_id) DO UPDATE" in write
    assert re.search(r"\)\s+UPDATE agentic_payment_method_rails SET", write)  # the rail's change is the main statement
    retried = [job for job in jobs_of(pm["id"]) if job.status == "succeeded"]
    assert len(retried) == 2  # the create's psp job and the retry's vic job
    assert {rail.provider: rail.attempt for rail in rail_rows(pm["id"])} == {"vic": "retry", "psp": "create"}


def _driver_round_trips(monkeypatch) -> list[tuple[int | None, str]]:
    """What the api's threads send from now on, in order (the list fills as they run): each
    statement run on the driver's cursor (``storage.driver.execute`` / ``execute_text``) as
    ``(its connection's id, prefix; text; suffix)``, and each batch of task messages as
    ``(None, "sent [job ids]")``."""
    from infra import dispatch
    from storage import driver

    seen: list[tuple[int | None, str]] = []
    send, execute, execute_text = dispatch.send_messages, driver.execute, driver.execute_text
    here = threading.get_ident()  # the in-process api runs units of work on threads of its pool: not this one

    def sent(messages):
        seen.append((None, f"sent {sorted(job for _, _, kwargs in messages for job in _jobs_in(kwargs))}"))
        send(messages)

    def executed(info, cursor, statement, params, *, prefix=None, suffix=None):
        if threading.get_ident() != here:
            seen.append((id(cursor.connection), f"{prefix or ''}; {statement.text}; {suffix or ''}"))
        return execute(info, cursor, statement, params, prefix=prefix, suffix=suffix)

    def executed_text(info, cursor, text, parameters, *, prepared, prefix=None, suffix=None):
        if threading.get_ident() != here:
            seen.append((id(cursor.connection), f"{prefix or ''}; {text}; {suffix or ''}"))
        return execute_text(info, cursor, text, parameters, prepared=prepared, prefix=prefix, suffix=suffix)

    monkeypatch.setattr(dispatch, "send_messages", sent)
    monkeypatch.setattr(driver, "execute", executed)
    monkeypatch.setattr(driver, "execute_text", executed_text)
    return seen


def _unit_of(seen: list[tuple[int | None, str]], first: str) -> list[str]:
    """The read, the message and the write of the unit of work whose read matches ``first`` (a
    pattern), on its connection."""
    start = next(n for n, (_, text) in enumerate(seen) if re.search(first, text))
    connection = seen[start][0]
    return [text for key, text in seen[start:] if key in (connection, None)][:3]


def test_a_create_reads_its_card_with_its_gates_locked_then_sends_its_jobs_then_writes_once(tenant, monkeypatch):
    """A create without an idempotency key whose rails all have providers is two round trips on one
    connection of the driver (``storage.db.read_then_write``): the card token's read with ``BEGIN``
    and the locks of the gates of its jobs before it; then, after the one message of both rail jobs
    (the worker's lease waits at the gate for the commit), one statement writing the payment method,
    its rails, both jobs, the enroll lease, the token's activity and the log row, with ``COMMIT``
    after it. The answer is the object a read gives."""
    token_id = card_token(tenant.client, VISA)
    seen = _driver_round_trips(monkeypatch)
    answer = create(tenant.client, token_id)
    assert answer.status == 201, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    read, message, write = _unit_of(seen, r"FROM tokens\b")
    # both gates of the drawn ids (one per rail a card can have) locked before the read, in its round trip
    assert read.startswith("BEGIN; SELECT pg_advisory_xact_lock(") and read.count("pg_advisory_xact_lock(") == 2, read
    assert message == f"sent {sorted(str(job.id) for job in jobs_of(answer.json['id']))}"
    for table in ("agentic_payment_methods", "agentic_payment_method_rails", "jobs", "agentic_operation_leases"):
        assert f'INSERT INTO "{table}"' in write, table
    assert write.endswith("; COMMIT"), write
    assert get(tenant.client, answer.json["id"]) == answer.json


def test_a_retry_is_two_round_trips_its_message_between_them(tenant, monkeypatch):
    """A retry whose provider is configured, on the driver's cursor (``storage.db.read_then_write``):
    its read (the payment method locked, its rails, its lease, the card token) with ``BEGIN`` and the
    lock of its job's gate; its job's message; then one statement writing the lease, the job, the
    token's activity, the log row and the rail's change, with ``COMMIT``. The rail is enabled."""
    pm = created(tenant.client, FAILS_ON_CREATE)
    seen = _driver_round_trips(monkeypatch)
    answer = retry(tenant.client, pm["id"])
    assert answer.status == 200, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    read, message, write = _unit_of(seen, "FOR UPDATE OF agentic_payment_methods")
    assert read.startswith("BEGIN; SELECT pg_advisory_xact_lock(") and read.count("pg_advisory_xact_lock(") == 1, read
    retried_job = next(rail.job_id for rail in rail_rows(pm["id"]) if rail.provider == "vic")
    assert message == f"sent {[str(retried_job)]}"
    for table in ("agentic_operation_leases", "jobs", "token_activity", "audit_logs"):
        assert re.search(rf'INSERT INTO "?{table}"? ', write), table
    assert re.search(r"\)\s+UPDATE agentic_payment_method_rails SET", write)  # the rail's change is the main statement
    assert write.endswith("; COMMIT"), write
    assert {rail.provider: rail.attempt for rail in rail_rows(pm["id"])} == {"vic": "retry", "psp": "create"}


def _jobs_in(kwargs: dict) -> list[str]:
    """The job ids one message names (its ``job_id`` and any ``sibling_ids``)."""
    return [kwargs["job_id"], *kwargs.get("sibling_ids", ())]


def test_a_create_whose_rails_are_enabled_answers_from_their_outcome_messages(tenant, monkeypatch):
    """Both rails enabled, each by its one outcome statement, the two settled by one commit: the
    create answers from what it recorded and what their one outcome message carried, without reading
    the payment method, on the event loop (the finish on the database pool is not called). Each
    answer carries the card sealed (no card field readable in it); exactly one says it released the
    operation's lease (the last: its card and updated_at are final); the answer is the object a later
    read gives."""
    from domain.agentic import service
    from infra import wait

    token_id = card_token(tenant.client, VISA)
    read = _recorded(monkeypatch, service, "settled_view")
    finishes = _recorded(monkeypatch, service, "finish_create")
    messages: list[list[dict]] = []
    publish_outcomes = wait.publish_outcomes

    def publish(settled):
        messages.append([answer for _, _, _, answer in settled if answer is not None])
        publish_outcomes(settled)

    monkeypatch.setattr(wait, "publish_outcomes", publish)
    answer = create(tenant.client, token_id)
    assert answer.status == 201, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    assert read == [] and finishes == []
    ours = [
        [one for one in message if one.get("payment_method_id") == answer.json["id"]]
        for message in messages
        if any(one.get("payment_method_id") == answer.json["id"] for one in message)
    ]
    assert len(ours) == 1, messages  # the rails settled by one commit: one message for both
    answers = ours[0]
    assert len(answers) == 2, messages
    assert sorted(message["released"] for message in answers) == [False, True]
    for message in answers:
        assert set(message) == {"payment_method_id", "card_ct", "updated_at", "provider_ids", "released"}
        assert "last4" not in json.dumps(message) and VISA[-4:] not in json.dumps(message)
    assert get(tenant.client, answer.json["id"]) == answer.json


def test_a_create_whose_outcome_answer_does_not_open_reads_the_payment_method(tenant, monkeypatch):
    """An answer that does not open (tampered, another payment method's, a key version gone) is not
    used: the create reads the payment method once instead, and answers what a later read gives."""
    from domain.agentic import service
    from storage.crypto import DecryptionError

    def does_not_open(session, tenant_id, answer):
        raise DecryptionError("tampered")

    monkeypatch.setattr(service, "open_answer", does_not_open)
    read = _recorded(monkeypatch, service, "settled_view")
    answer = created(tenant.client, VISA)
    assert [pm_id for _, pm_id in read] == [answer["id"]]
    assert outcome(answer) == {"vic": "enabled", "psp": "enabled"}
    assert get(tenant.client, answer["id"]) == answer


def test_a_retry_that_enables_its_rail_answers_from_its_outcome_message(tenant, monkeypatch):
    """The retry's job settled with the rail enabled by its one outcome statement: the answer is made
    of what the retry read when it started (the payment method and its other rail) and what the
    outcome message carried, without reading the payment method again, on the event loop (the finish
    on the database pool is not called); it is the object a read answers, the retried rail's provider
    ids and the backfilled card included. When the message's answer does not open, the payment method
    is read once instead, by the finish, with the same answer; so it is when the tenant's key is not
    in the keyring's cache (the loop reads nothing)."""
    from domain.agentic import service
    from storage import crypto
    from storage.crypto import DecryptionError

    first, second, third = (created(tenant.client, FAILS_ON_CREATE) for _ in range(3))
    read = _recorded(monkeypatch, service, "settled_view")
    finishes = _recorded(monkeypatch, service, "finish_retry")
    answer = retry(tenant.client, first["id"])
    assert answer.status == 200, answer
    assert outcome(answer.json) == {"vic": "enabled", "psp": "enabled"}
    assert read == [] and finishes == []
    assert answer.json["updated_at"] > first["updated_at"]
    assert get(tenant.client, first["id"]) == answer.json

    def does_not_open(session, tenant_id, answer):
        raise DecryptionError("tampered")

    open_answer = service.open_answer

    def uncached(session, tenant_id, answer):
        if session is None:
            raise crypto.KeyNotCached("not cached")
        return open_answer(session, tenant_id, answer)

    monkeypatch.setattr(service, "open_answer", uncached)
    answer = retry(tenant.client, second["id"])
    assert answer.status == 200, answer
    assert read == [] and len(finishes) == 1  # the finish opened the answer with its session
    assert get(tenant.client, second["id"]) == answer.json

    monkeypatch.setattr(service, "open_answer", does_not_open)
    answer = retry(tenant.client, third["id"])
    assert answer.status == 200, answer
    assert [pm_id for _, pm_id in read] == [third["id"]]
    assert get(tenant.client, third["id"]) == answer.json


def test_a_pending_rail_can_be_retried(tenant, monkeypatch):
    real_read = providers.HttpAgenticProvider.get_enrollment

    def still_pending(self, enrollment_id):  # the provider keeps it pending until the retry is in
        answer = real_read(self, enrollment_id)
        return dataclasses.replace(answer, status="pending")

    monkeypatch.setattr(providers.HttpAgenticProvider, "get_enrollment", still_pending)
    pm = created(tenant.client, PENDING)
    assert outcome(pm)["vic"] == "pending"
    answer = retry(tenant.client, pm["id"])
    assert answer.status == 200, answer
    assert outcome(answer.json)["vic"] == "pending"
    monkeypatch.undo()
    assert outcome(settled(tenant.client, pm["id"]))["vic"] == "enabled"
    assert [e["rail"]["status"] for e in rail_events(tenant.id, pm["id"])] == ["enabled"]


def test_retry_validation_and_errors(tenant):
    pm = created(tenant.client, REJECTED)
    amex = created(tenant.client, AMEX)
    client = tenant.client

    problem = assert_problem(retry(client, pm["id"], "spt", "vic"), 400, "VALIDATION_ERROR")
    assert list(problem["errors"]) == ["provider"]
    assert problem["title"].startswith("provider: ")
    problem = assert_problem(
        client.post(f"{BASE}/{pm['id']}/rails/retry", {"rail": "card", "provider": "x"}), 400, "VALIDATION_ERROR"
    )
    assert set(problem["errors"]) == {"rail", "provider"}
    assert_problem(client.post(f"{BASE}/{pm['id']}/rails/retry", {"rail": "spt"}), 400, "VALIDATION_ERROR")
    assert_problem(retry(client, amex["id"], "agentic-token", "vic"), 400, "RAIL_NOT_FOUND")
    assert_problem(retry(client, pm["id"], "agentic-token", "agentpay"), 400, "RAIL_NOT_FOUND")
    problem = assert_problem(retry(client, pm["id"], "spt", "psp"), 400, "VALIDATION_ERROR")  # enabled
    assert list(problem["errors"]) == ["rail"]
    assert_problem(retry(client, "pm_unknown"), 404, "PAYMENT_METHOD_NOT_FOUND")


def test_a_retry_on_a_deleted_payment_method_is_400(tenant):
    pm = created(tenant.client, REJECTED)
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204
    assert_problem(retry(tenant.client, pm["id"]), 400, "PAYMENT_METHOD_DELETED")


def test_a_production_tenant_without_live_urls_records_provider_not_configured(api):
    from tests.conftest import make_tenant

    production = make_tenant(api, type="production")
    pm = created(production.client, VISA)
    assert outcome(pm) == {"vic": "PROVIDER_NOT_CONFIGURED", "psp": "PROVIDER_NOT_CONFIGURED"}
    assert jobs_of(pm["id"]) == []  # no provider call was even attempted
    assert_problem(retry(production.client, pm["id"]), 422, "PROVIDER_NOT_CONFIGURED")
    errors = production.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    assert [e["code"] for e in errors] == ["PROVIDER_NOT_CONFIGURED"] * 3


# ---- create validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"source": {"type": "card", "token_id": "x"}}, {"source.type", "source.token_id"}),
        ({"source": None}, {"source"}),
        ({"consumer": {}}, {"consumer.email"}),
        ({"consumer": {"email": "not-an-email"}}, {"consumer.email"}),
        ({"consumer": {"email": "a@example.com", "id": "nope"}}, {"consumer.id"}),
        ({"consumer": {"email": "a@example.com", "country_code": "XX"}}, {"consumer.country_code"}),
        ({"consumer": {"email": "a@example.com", "country_code": "GBR"}}, {"consumer.country_code"}),
        ({"consumer": {"email": "a@example.com", "language_code": "e"}}, {"consumer.language_code"}),
        ({"consumer": {"email": "a@example.com", "language_code": "en_US"}}, {"consumer.language_code"}),
        ({"consumer": {"email": "a@example.com", "language_code": "x" * 36}}, {"consumer.language_code"}),
        ({"agent_id": ""}, {"agent_id"}),
        ({"provider": "vic"}, {"provider"}),
    ],
)
def test_create_validation_lists_every_failing_field(tenant, change, fields):
    payload = {**body(a_uuid()), **change}
    problem = assert_problem(tenant.client.post(BASE, payload), 400, "VALIDATION_ERROR")
    assert set(problem["errors"]) == fields
    first = next(iter(problem["errors"]))
    assert problem["title"] == f"{first}: {problem['errors'][first][0]}"


def test_both_parts_missing_are_both_listed(tenant):
    problem = assert_problem(tenant.client.post(BASE, {}), 400, "VALIDATION_ERROR")
    assert set(problem["errors"]) == {"source", "consumer"}


def test_consumer_codes_are_normalised(tenant):
    consumer = {"email": "b@example.com", "id": a_uuid(), "country_code": "de", "language_code": "zh-hant-tw"}
    pm = created(tenant.client, AMEX, consumer=consumer)
    assert pm["consumer"] == {**consumer, "country_code": "DE", "language_code": "zh-Hant-TW"}


def test_the_token_must_be_a_readable_card_of_the_tenant(tenant, other_tenant):
    client = tenant.client
    assert_problem(create(client, a_uuid()), 400, "INVALID_TOKEN")
    plain = client.post("/tokens", {"type": "token", "data": "hello"}).json["id"]
    assert_problem(create(client, plain), 400, "INVALID_TOKEN")
    theirs = card_token(other_tenant.client, VISA)
    assert_problem(create(client, theirs), 400, "INVALID_TOKEN")
    no_expiry = client.post("/tokens", {"type": "card", "data": {"number": VISA}}).json["id"]
    assert_problem(create(client, no_expiry), 400, "INVALID_TOKEN")
    assert client.get(BASE).json["data"] == []


def test_an_agent_id_must_name_an_agent_of_the_tenant(tenant, other_tenant):
    token_id = card_token(tenant.client, AMEX)
    assert_problem(create(tenant.client, token_id, agent_id="agt_unknown"), 404, "AGENT_NOT_FOUND")
    theirs = other_tenant.client.post("/agentic/agents", {"name": "theirs"}).json["id"]
    assert_problem(create(tenant.client, token_id, agent_id=theirs), 404, "AGENT_NOT_FOUND")
    mine = tenant.client.post("/agentic/agents", {"name": "mine"}).json["id"]
    answer = create(tenant.client, token_id, agent_id=mine)
    assert answer.status == 201 and answer.json["agent_id"] == mine


# ---- list, get, permissions -------------------------------------------------------------------------


def test_list_pages_newest_first_with_filters(tenant):
    client = tenant.client
    consumer_id = a_uuid()
    token_id = card_token(client, AMEX)
    mine = [
        create(client, token_id, consumer={"email": "c@example.com", "id": consumer_id}).json["id"] for _ in range(3)
    ]
    other = create(client, token_id).json["id"]
    gone = create(client, token_id, consumer={"email": "c@example.com", "id": consumer_id}).json["id"]
    assert client.delete(f"{BASE}/{gone}").status == 204

    seen, start = [], None
    while True:
        page = client.get(f"{BASE}?size=2" + (f"&start={start}" if start else "")).json
        assert len(page["data"]) <= 2 and page["pagination"]["page_size"] == 2
        seen += [pm["id"] for pm in page["data"]]
        start = page["pagination"].get("next")
        if not start:
            break
    assert seen == [other, *reversed(mine)]
    assert [pm["id"] for pm in client.get(f"{BASE}?consumer_id={consumer_id}").json["data"]] == list(reversed(mine))
    assert [pm["id"] for pm in client.get(f"{BASE}?status=deleted").json["data"]] == [gone]
    assert len(client.get(f"{BASE}?status=all&consumer_id={consumer_id}").json["data"]) == 4
    assert client.get(f"{BASE}?consumer_id={a_uuid()}").json == {"pagination": {"page_size": 20}, "data": []}


@pytest.mark.parametrize("query", ["size=0", "size=101", "size=x", "status=gone", "consumer_id=1", "start=bogus"])
def test_list_query_validation(tenant, query):
    problem = assert_problem(tenant.client.get(f"{BASE}?{query}"), 400, "VALIDATION_ERROR")
    assert set(problem["errors"]) == {query.split("=")[0]}


def test_reads_do_not_move_updated_at(tenant):
    pm = created(tenant.client, AMEX)
    for _ in range(2):
        get(tenant.client, pm["id"])
        tenant.client.get(BASE)
        tenant.client.get(f"{BASE}/{pm['id']}/errors")
    assert get(tenant.client, pm["id"])["updated_at"] == pm["updated_at"]


def test_another_tenants_payment_method_is_not_found(tenant, other_tenant):
    pm = created(tenant.client, AMEX)
    for answer in (
        other_tenant.client.get(f"{BASE}/{pm['id']}"),
        other_tenant.client.get(f"{BASE}/{pm['id']}/errors"),
        other_tenant.client.delete(f"{BASE}/{pm['id']}"),
        retry(other_tenant.client, pm["id"], "spt", "psp"),
    ):
        assert_problem(answer, 404, "PAYMENT_METHOD_NOT_FOUND")
    assert other_tenant.client.get(BASE).json["data"] == []


def test_permissions(tenant, limited):
    token_id = card_token(tenant.client, AMEX)
    public = limited(tenant, ["agentic:payment-method:create"], type="public")
    pm = create(public, token_id)
    assert pm.status == 201, pm  # no token read permission needed
    pm_id = pm.json["id"]
    assert retry(public, pm_id, "spt", "psp").status == 400  # allowed, but the rail is enabled
    for answer, permission in (
        (public.get(BASE), "get"),
        (public.get(f"{BASE}/{pm_id}"), "get"),
        (public.get(f"{BASE}/{pm_id}/errors"), "get"),
        (public.delete(f"{BASE}/{pm_id}"), "delete"),
    ):
        assert answer.status == 403, answer
        assert f"agentic:payment-method:{permission}" in answer.json["detail"]
    reader = limited(tenant, ["agentic:payment-method:get"])
    assert reader.get(f"{BASE}/{pm_id}").status == 200
    assert reader.post(BASE, body(token_id)).status == 403
    assert retry(reader, pm_id, "spt", "psp").status == 403
    assert reader.delete(f"{BASE}/{pm_id}").status == 403
    deleter = limited(tenant, ["agentic:payment-method:delete"])
    assert deleter.delete(f"{BASE}/{pm_id}").status == 204


def test_a_fresh_card_enrolls_once_per_provider(tenant, sandbox):
    number = fresh_visa()
    pm = created(tenant.client, number)
    assert outcome(pm) == {"vic": "enabled", "psp": "enabled"}
    assert len(provider_enrollments(sandbox, "vic", number)) == 1
    assert len(provider_enrollments(sandbox, "psp", number)) == 1
    assert len(provider_enrollments(sandbox, "agentpay", number)) == 0


def test_updated_at_only_moves_with_visible_state(tenant):
    pm = created(tenant.client, AMEX)
    with session_scope() as session:  # internal bookkeeping changes are invisible
        session.execute(update(PaymentMethod).where(PaymentMethod.id == pm["id"]).values(idempotency_key=None))
    assert get(tenant.client, pm["id"])["updated_at"] == pm["updated_at"]
