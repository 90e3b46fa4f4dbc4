"""Network tokens through the real HTTP API, a real worker and the sandbox card network on loopback.

Every row of the sandbox's network-token table (``spec/SANDBOX.md``), the create rules, masking and
reveal, card art, cryptograms, suspend/resume/delete with their events, permissions, tenant
isolation, encryption at rest and the proxy lookup.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid

import pytest
from sqlmodel import select

from domain.network_tokens import provisioning, records
from domain.network_tokens import service as network_tokens
from infra.errors import Problem
from storage.db import session_scope
from storage.models import AuditLog, Event, Job
from storage.models_network_tokens import NetworkToken
from tests.conftest import SANDBOX_SLOW_SECONDS, make_tenant
from tests.helpers import ApiClient, wait_until

pytestmark = pytest.mark.api

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
DECLINED = "4000000000002016"
FLAKY = "4000000000002024"
SLOW = "4000000000002032"
AMEX = "378282246310005"
OTHER_VISA = "4111111111111111"

YEAR = dt.datetime.now(dt.UTC).year + 3
ALL_EVENTS = [
    "network-token.created",
    "network-token.suspended",
    "network-token.resumed",
    "network-token.deleted",
    "network-token.failed",
]


def _card(number: str = VISA, **extra) -> dict:
    return {"number": number, "expiration_month": 7, "expiration_year": YEAR, **extra}


def _create(client: ApiClient, number: str = VISA, **body):
    return client.post("/network-tokens", {"data": _card(number), **body})


def _active(client: ApiClient, number: str = VISA, **body) -> dict:
    answer = _create(client, number, **body)
    assert answer.status == 201, answer
    assert answer.json["status"] == "active"
    return answer.json


def _admin_tokens(sandbox: str, **query) -> list[dict]:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    answer = ApiClient(sandbox).get(f"/_admin/network-tokens?{params}")
    assert answer.status == 200, answer
    return answer.json["network_tokens"]


def _admin_requests(sandbox: str, endpoint: str, pan: str) -> int:
    answer = ApiClient(sandbox).get(f"/_admin/requests?endpoint={endpoint}&pan={pan}")
    assert answer.status == 200, answer
    return answer.json["total"]


def _subscribe(tenant, receiver) -> None:
    answer = tenant.client.post("/webhooks", {"name": "nt", "url": receiver.url, "events": ALL_EVENTS})
    assert answer.status == 201, answer


def _events(receiver, kind: str, token_id: str, timeout: float = 20) -> list[dict]:
    hits = receiver.wait_for(
        lambda r: r.json["event"]["type"] == kind and r.json["event"]["data"]["network_token"]["id"] == token_id,
        timeout=timeout,
    )
    return [hit.json["event"] for hit in hits]


def _rows(tenant_id) -> list[NetworkToken]:
    with session_scope() as session:
        return list(session.exec(select(NetworkToken).where(NetworkToken.tenant_id == tenant_id)).all())


def _provision_job(token_id: str) -> Job:
    with session_scope() as session:
        return session.exec(select(Job).where(Job.kind == records.PROVISION_TASK, Job.subject_id == token_id)).one()


def _masked(number: str) -> str:
    return "X" * (len(number) - 4) + number[-4:]


# ---- the sandbox's table, row by row --------------------------------------------------------------


def test_visa_is_provisioned_active_with_full_card_art(tenant, sandbox, receiver):
    _subscribe(tenant, receiver)
    created = _active(tenant.client, VISA)
    assert created["tenant_id"] == str(tenant.id)
    number = created["data"]["number"]  # the management key holds network-token:reveal: complete
    assert number.isdigit() and len(number) == 16 and number != VISA
    assert created["data"]["expiration_month"] == 7
    assert created["data"]["expiration_year"] == YEAR + 3
    details = created["network_token"]
    assert details["brand"] == "visa"
    assert details["bin"].startswith("489537") and len(details["bin"]) == 8
    assert details["last4"] == number[-4:]
    assert details["product"] == {"code": "A"}
    assert details["issuer"]["country"] == "US"
    assert details["issuer_country"]["alpha2"] == "US"
    assert details["additional"] == []
    assert created["card"] == {
        "brand": "visa",
        "bin": "424242",
        "last4": "4242",
        "expiration_month": 7,
        "expiration_year": YEAR,
    }
    assert created["par"].startswith("SBX1") and len(created["par"]) == 29
    assert created["token_id"] is None and created["token_intent_id"] is None
    reference = created["_extras"]["network_reference"]
    assert reference in {t["id"] for t in _admin_tokens(sandbox, pan=VISA, status="active")}

    (event,) = _events(receiver, "network-token.created", created["id"])
    assert event["data"] == {"network_token": {"id": created["id"], "status": "active"}}

    account = tenant.client.get(f"/network-tokens/{created['id']}/account")
    assert account.status == 200, account
    art = account.json["card_art"]
    assert art["background_color"] == "#1A1F71"
    assert art["logo"]["url"].endswith("/logo.png") and art["logo"]["height"] == 100
    assert art["card_image"]["url"].endswith("/card-image.png") and art["card_image"]["width"] == 1536
    # answered from storage the second time: the network is not asked again
    asked = _admin_requests(sandbox, "card-network.card-art", VISA)
    assert tenant.client.get(f"/network-tokens/{created['id']}/account").json == account.json
    assert _admin_requests(sandbox, "card-network.card-art", VISA) == asked


def test_without_a_subscribed_webhook_the_outcome_and_the_job_are_one_statement(tenant, sandbox):
    """No enabled webhook of the tenant subscribes to ``network-token.created``: the worker writes the
    network token's change and the job's completion in one statement (no transaction of its own
    around it), and no event row (events are read only to be delivered)."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.engine import Engine

    seen: list[tuple[str, str]] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        seen.append((statement, str(parameters)))

    sa_event.listen(Engine, "before_cursor_execute", record)  # every engine: the api's and the worker's
    try:
        created = _active(tenant.client, OTHER_VISA)
    finally:
        sa_event.remove(Engine, "before_cursor_execute", record)
    job = _provision_job(created["id"])
    # this create's statements (other tests' jobs may still run beside it): those naming its job
    mine = [statement for statement, parameters in seen if str(job.id) in parameters]
    outcome = [statement for statement in mine if "UPDATE network_tokens" in statement]
    assert len(outcome) == 1
    assert outcome[0].lstrip().startswith("WITH locked_job") and "UPDATE jobs" in outcome[0]
    assert not [statement for statement in mine if statement.rstrip().endswith("FOR UPDATE")]
    assert (job.status, job.result, job.lease_owner) == ("succeeded", {"network_token_id": created["id"]}, None)
    row = next(row for row in _rows(tenant.id) if str(row.id) == created["id"])
    assert (row.status, row.source_ct, row.pending_job_id) == ("active", None, None)
    with session_scope() as session:
        assert not session.exec(select(Event).where(Event.tenant_id == tenant.id)).all()


def test_the_create_answers_from_the_outcome_message_without_reading_the_network_token_back(tenant, limited, sandbox):
    """The outcome statement's values come with the job's outcome message (the DPAN sealed, as at
    rest): the waiting create answers from them and what it recorded, and no statement reads the
    network token back; the answer is the object a read gives, masked or revealed by the caller's
    permissions."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.engine import Engine

    reads: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT") and "FROM network_tokens" in statement:
            reads.append(f"{statement} {parameters}")

    sa_event.listen(Engine, "before_cursor_execute", record)
    try:
        revealed = _active(tenant.client, OTHER_VISA)
        masked = _active(limited(tenant, ["network-token:create"]), OTHER_VISA)
    finally:
        sa_event.remove(Engine, "before_cursor_execute", record)
    for created in (revealed, masked):
        assert not [statement for statement in reads if created["id"] in statement], reads
    assert revealed == tenant.client.get(f"/network-tokens/{revealed['id']}").json
    shown = tenant.client.get(f"/network-tokens/{masked['id']}").json
    assert masked == {**shown, "data": {**shown["data"], "number": _masked(shown["data"]["number"])}}
    assert (
        revealed["data"]["number"] != OTHER_VISA
        and revealed["network_token"]["last4"] == revealed["data"]["number"][-4:]
    )


def test_the_create_answers_on_the_event_loop_unless_the_tenants_key_is_not_cached(tenant, sandbox, monkeypatch):
    """An outcome message that answers the create is turned into the answer on the event loop: the
    finish on the database pool (``provisioning_outcome``) is not called. Without the tenant's key in
    the keyring's cache the loop gets no answer (no statement runs there: the key is not read) and the
    finish answers the same object, reading the key."""
    from domain.tenancy.auth import authenticate
    from storage.crypto import get_keyring

    finishes: list[records.Started] = []
    asked: list[tuple] = []
    finish, settled_answer = provisioning.provisioning_outcome, provisioning.settled_answer

    def counted_finish(session, caller, started, *, outcome=None):
        finishes.append(started)
        return finish(session, caller, started, outcome=outcome)

    def recorded(session, caller, started, outcome):
        if session is None:
            asked.append((started, outcome))
        return settled_answer(session, caller, started, outcome)

    monkeypatch.setattr(provisioning, "provisioning_outcome", counted_finish)
    monkeypatch.setattr(provisioning, "settled_answer", recorded)
    created = _active(tenant.client, OTHER_VISA)
    assert finishes == [] and len(asked) == 1
    started, outcome = asked[0]
    assert outcome.answer is not None and str(started.network_token_id) == created["id"]
    with session_scope() as session:
        caller = authenticate(session, tenant.api_key)
        keyring = get_keyring()
        keyring._data_keys.clear()
        assert settled_answer(None, caller, started, outcome) is None
        read = settled_answer(session, caller, started, outcome)
        assert read is not None and read[0] == 201 and str(read[1]["id"]) == created["id"]
        assert read[1]["data"]["number"] == created["data"]["number"]
        assert settled_answer(None, caller, started, outcome) == read  # the key is cached by the read


def test_an_outcome_answer_that_does_not_open_is_not_believed(tenant, sandbox):
    """A message whose answer is not what the worker wrote (a sealed value that does not open for
    this network token, a missing value) is not answered from: the create reads the row instead."""
    from domain.network_tokens.views import created_row, provisioned_values
    from domain.tenancy.auth import authenticate
    from infra.wait import Outcome

    created = _active(tenant.client, OTHER_VISA)
    with session_scope() as session:
        caller = authenticate(session, tenant.api_key)
        other = session.get(NetworkToken, uuid.UUID(_active(tenant.client, OTHER_VISA)["id"]))
        row = session.get(NetworkToken, uuid.UUID(created["id"]))
        assert other is not None and row is not None and other.data_ct is not None
        recorded = created_row({**vars(row), "status": "inactive", "data_ct": None})
        started = records.Started(row.id, row.id, created=recorded)
        forged = provisioned_values(
            status="active",
            details={},
            par="forged",
            reference="forged",
            modified_at=row.created_at,
            data_ct=other.data_ct,  # another network token's sealed DPAN: bound to that one
        )
        for answer in (forged, {"status": "active"}):
            status, shown = provisioning.provisioning_outcome(
                session, caller, started, outcome=Outcome("succeeded", {}, answer)
            )
            assert status == 201 and shown["par"] == created["par"] and shown["data"] == created["data"]


def test_a_create_from_card_data_is_recorded_by_one_statement_and_its_commit(tenant, sandbox, monkeypatch):
    """Nothing to read first (card data, not a token): the recording's rows (network token, job, log
    row) are one statement, sent with ``BEGIN`` and the lock of the job's gate in one round trip; the
    job's message goes out next, then ``COMMIT`` (the worker's lease waits at the gate for it); the
    session's own transaction never begins. A create from a token reads the token first: its rows go
    out in that transaction."""
    from sqlalchemy import event as sa_event
    from sqlalchemy.engine import Engine

    from domain.tenancy.auth import authenticate
    from infra import dispatch

    commits: list[int] = []
    statements: list[str] = []
    here = threading.get_ident()  # the in-process api and worker run beside this test: its own only

    def committed(connection):
        if threading.get_ident() == here:
            commits.append(1)

    def record(connection, cursor, statement, parameters, context, executemany):
        if threading.get_ident() == here:
            statements.append(statement)

    send = dispatch.send_messages

    def sent(messages):
        statements.append(f"sent {[kwargs['job_id'] for _, _, kwargs in messages]}")
        send(messages)

    with session_scope() as session:
        caller = authenticate(session, tenant.api_key)
    monkeypatch.setattr(dispatch, "send_messages", sent)
    sa_event.listen(Engine, "commit", committed)
    sa_event.listen(Engine, "before_cursor_execute", record)
    try:
        with session_scope() as session:
            started = provisioning.create_network_token(session, caller, {"data": _card(OTHER_VISA)})
            assert not session.in_transaction()  # written and committed already
    finally:
        sa_event.remove(Engine, "commit", committed)
        sa_event.remove(Engine, "before_cursor_execute", record)
    assert commits == []
    written, message, commit = statements
    assert written.startswith("BEGIN; SELECT pg_advisory_xact_lock(")
    assert all(table in written for table in ("network_tokens", "jobs", "audit_logs"))
    assert message == f"sent {[str(started.job_id)]}"
    assert commit == "COMMIT"
    job = wait_until(lambda: (found := _provision_job(str(started.network_token_id))).status == "succeeded" and found)
    assert job.result == {"network_token_id": str(started.network_token_id)}

    source = tenant.client.post("/tokens", {"type": "card", "data": _card(OTHER_VISA)})
    assert source.status == 201, source
    sa_event.listen(Engine, "commit", committed)
    try:
        with session_scope() as session:
            from_token = provisioning.create_network_token(session, caller, {"token_id": source.json["id"]})
            assert session.in_transaction()  # the token was read: the rows wait for this commit
    finally:
        sa_event.remove(Engine, "commit", committed)
    assert commits == [1]
    assert _provision_job(str(from_token.network_token_id)).kind == records.PROVISION_TASK


def test_mastercard_is_provisioned_with_a_logo_only(tenant, sandbox):
    created = _active(tenant.client, MASTERCARD)
    assert created["network_token"]["brand"] == "mastercard"
    assert created["network_token"]["bin"].startswith("520473")
    assert created["network_token"]["product"] == {"code": "MCS"}
    art = tenant.client.get(f"/network-tokens/{created['id']}/account").json["card_art"]
    assert art["logo"]["url"].endswith("/logo.png")
    assert art["card_image"] is None
    assert art["background_color"] is None


def test_a_declined_card_answers_422_and_leaves_nothing(tenant, sandbox, receiver):
    _subscribe(tenant, receiver)
    answer = _create(tenant.client, DECLINED)
    assert answer.status == 422, answer
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json["code"] == "card_not_eligible"
    assert answer.json["title"] == "Card not eligible"
    assert "not eligible" in answer.json["detail"]
    assert _rows(tenant.id) == []
    assert _admin_tokens(sandbox, pan=DECLINED) == []
    with session_scope() as session:
        (job,) = session.exec(select(Job).where(Job.tenant_id == tenant.id, Job.kind == records.PROVISION_TASK))
        assert job.status == "failed" and job.attempts == 1
        # the create answered 422 itself: no network-token.failed event
        assert (
            session.exec(
                select(Event).where(Event.tenant_id == tenant.id, Event.type == "network-token.failed")
            ).first()
            is None
        )


def test_an_unsupported_network_answers_422(tenant, sandbox):
    answer = _create(tenant.client, AMEX)
    assert answer.status == 422, answer
    assert answer.json["code"] == "network_not_supported"
    assert answer.json["title"] == "Network not supported"
    assert _rows(tenant.id) == []
    assert _admin_tokens(sandbox, pan=AMEX) == []


def test_the_flaky_network_is_retried_and_the_create_succeeds(tenant, sandbox):
    before = _admin_requests(sandbox, "card-network.provision", FLAKY)
    created = _active(tenant.client, FLAKY)
    assert _admin_requests(sandbox, "card-network.provision", FLAKY) - before == 3  # 503, 503, 201
    job = _provision_job(created["id"])
    assert job.status == "succeeded" and job.attempts == 3
    tokens = [t for t in _admin_tokens(sandbox, pan=FLAKY) if t["id"] == created["_extras"]["network_reference"]]
    assert len(tokens) == 1


def test_the_slow_network_answers_202_then_the_token_becomes_active_with_a_webhook(tenant, sandbox, receiver):
    assert SANDBOX_SLOW_SECONDS > 10  # just past the API's bounded wait
    _subscribe(tenant, receiver)
    answer = _create(tenant.client, SLOW)
    assert answer.status == 202, answer
    pending = answer.json
    assert pending["status"] == "inactive"
    assert pending["data"] is None and pending["network_token"] is None
    assert pending["card"]["last4"] == "2032"
    assert tenant.client.get(f"/network-tokens/{pending['id']}/account").status == 409
    assert tenant.client.put(f"/network-tokens/{pending['id']}/suspend").status == 409

    (event,) = _events(receiver, "network-token.created", pending["id"], timeout=30)
    assert event["data"] == {"network_token": {"id": pending["id"], "status": "active"}}
    current = tenant.client.get(f"/network-tokens/{pending['id']}").json
    assert current["status"] == "active"
    assert current["data"]["number"].endswith(current["network_token"]["last4"])
    assert len(_admin_tokens(sandbox, pan=SLOW, status="active")) >= 1


# ---- the create rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "keys"),
    [
        ({}, {"body"}),
        ({"data": _card(), "token_id": "x"}, {"data", "token_id"}),
        ({"data": _card(), "expiration_month": 1, "expiration_year": YEAR}, {"expiration_month", "expiration_year"}),
        ({"token_id": "x", "expiration_month": 1}, {"expiration_year", "token_id"}),
        ({"data": {"number": "4242424242424241", "expiration_month": 1, "expiration_year": YEAR}}, {"data.number"}),
        ({"data": {"number": VISA}}, {"data.expiration_month", "data.expiration_year"}),
        ({"data": _card(name="Ada")}, {"data.name"}),
        ({"token_id": "no-such-token"}, {"token_id"}),
        ({"token_intent_id": str(uuid.uuid4())}, {"token_intent_id"}),
        ({"data": _card(), "expiration_month": "1", "expiration_year": YEAR}, {"expiration_month"}),
        ({"data": _card(), "surprise": 1}, {"surprise"}),
    ],
)
def test_create_validation(tenant, body, keys):
    answer = tenant.client.post("/network-tokens", body)
    assert answer.status == 400, answer
    assert set(answer.json["errors"]) == keys, answer.json
    assert _rows(tenant.id) == []


def test_a_source_token_must_hold_card_data(tenant):
    answer = tenant.client.post("/tokens", {"type": "token", "data": {"number": VISA}})
    assert answer.status == 201, answer
    refused = tenant.client.post("/network-tokens", {"token_id": answer.json["id"]})
    assert refused.status == 400
    assert refused.json["errors"]["token_id"] == ["must name a token holding card data with a number"]


def test_a_token_without_expiration_needs_the_override_pair(tenant, sandbox):
    token = tenant.client.post("/tokens", {"type": "card", "data": {"number": VISA}}).json
    refused = tenant.client.post("/network-tokens", {"token_id": token["id"]})
    assert refused.status == 400
    assert set(refused.json["errors"]) == {"expiration_month", "expiration_year"}
    created = tenant.client.post(
        "/network-tokens", {"token_id": token["id"], "expiration_month": 3, "expiration_year": YEAR + 1}
    )
    assert created.status == 201, created
    assert created.json["card"]["expiration_month"] == 3


def test_overrides_show_on_the_card_and_leave_the_source_unchanged(tenant, sandbox):
    token = tenant.client.post("/tokens", {"type": "card", "data": _card(VISA, cvc="123", name="Ada")})
    assert token.status == 201, token
    created = tenant.client.post(
        "/network-tokens",
        {
            "token_id": token.json["id"],
            "expiration_month": 11,
            "expiration_year": YEAR + 1,
            "cardholder_info": {"name": "Ada Lovelace", "address": {"line1": "1 Main St", "country_code": "GB"}},
            "merchant_id": str(uuid.uuid4()),
        },
    )
    assert created.status == 201, created
    body = created.json
    assert body["token_id"] == token.json["id"]
    assert body["card"]["expiration_month"] == 11 and body["card"]["expiration_year"] == YEAR + 1
    assert body["data"]["expiration_month"] == 11  # the network token follows the card sent
    assert body["_extras"]["merchant_id"] is not None
    source = tenant.client.get(f"/tokens/{token.json['id']}").json
    assert source["data"]["expiration_month"] == 7 and source["data"]["expiration_year"] == YEAR
    # the provisioning input (number, cvc, cardholder) is dropped once provisioning ends
    (row,) = [r for r in _rows(tenant.id) if str(r.id) == body["id"]]
    assert row.source_ct is None


def test_the_par_is_the_same_for_the_same_card(tenant, sandbox):
    first = _active(tenant.client, MASTERCARD)
    token = tenant.client.post("/tokens", {"type": "card", "data": _card(MASTERCARD)}).json
    second = tenant.client.post("/network-tokens", {"token_id": token["id"]})
    assert second.status == 201, second
    other = _active(tenant.client, OTHER_VISA)
    assert first["id"] != second.json["id"]
    assert first["par"] == second.json["par"]
    assert other["par"] != first["par"]
    assert first["_extras"]["network_reference"] != second.json["_extras"]["network_reference"]


def test_a_production_tenant_without_a_live_network_gets_422(api):
    production = make_tenant(api, type="production", name="live")
    answer = _create(production.client, VISA)
    assert answer.status == 422, answer
    assert answer.json["title"] == "Provider not configured"
    assert "card network" in answer.json["detail"]
    assert _rows(production.id) == []


def test_a_failure_after_the_202_answer_removes_the_record_and_emits_network_token_failed(tenant, sandbox, receiver):
    from domain.tenancy.auth import authenticate

    _subscribe(tenant, receiver)
    # The create handler's own steps, its bounded wait cut to nothing: it records the network token and the
    # job, finds the job still queued and answers 202, all before the worker gets the job (sent on commit).
    with session_scope() as session:
        caller = authenticate(session, tenant.api_key, trace_id="trace-failed")
        started = provisioning.create_network_token(session, caller, {"data": _card(DECLINED)})
        status, body = provisioning.provisioning_outcome(session, caller, started)
    assert status == 202 and body["status"] == "inactive"
    token_id = str(started.network_token_id)

    (event,) = _events(receiver, "network-token.failed", token_id)
    assert event["data"] == {"network_token": {"id": token_id, "status": "failed"}}
    assert event["trace_id"] == "trace-failed"
    assert _rows(tenant.id) == []
    removed = tenant.client.get(f"/network-tokens/{token_id}")
    assert removed.status == 404
    assert removed.json["code"] == "card_not_eligible"
    assert _provision_job(token_id).status == "failed"
    assert not [r for r in receiver.received if r.json["event"]["type"] == "network-token.created"]


# ---- reading: masking, reveal, permissions, isolation ---------------------------------------------


def test_read_masks_reveal_reveals_and_reveal_wins(tenant, limited, sandbox):
    created = _active(tenant.client)
    path = f"/network-tokens/{created['id']}"
    full = limited(tenant, ["network-token:reveal"]).get(path)
    assert full.status == 200, full
    number = full.json["data"]["number"]
    assert number.isdigit() and len(number) == 16 and number != VISA
    read_only = limited(tenant, ["network-token:read"]).get(path)
    assert read_only.status == 200
    assert read_only.json["data"]["number"] == _masked(number)
    both = limited(tenant, ["network-token:read", "network-token:reveal"]).get(path)
    assert both.json["data"]["number"] == number
    assert limited(tenant, ["network-token:create"]).get(path).status == 403
    # the management key holds reveal too
    assert tenant.client.get(path).json["data"]["number"] == number
    # the create answer follows the same rule
    assert created["data"]["number"] == number
    masked_create = _active(limited(tenant, ["network-token:create"]))
    assert masked_create["data"]["number"].startswith("XXXX")
    with session_scope() as session:
        logs = session.exec(select(AuditLog).where(AuditLog.entity_id == created["id"])).all()
        assert {log.operation for log in logs} >= {"create", "read"}
        assert {log.entity_type for log in logs} == {"network-token"}


def test_each_action_needs_its_own_permission(tenant, limited, sandbox):
    created = _active(tenant.client)
    path = f"/network-tokens/{created['id']}"
    nothing = limited(tenant, ["token:pci:read:low"])
    assert _create(nothing).status == 403
    assert nothing.get(path).status == 403
    assert nothing.get(f"{path}/account").status == 403
    assert nothing.post(f"{path}/cryptogram").status == 403
    assert nothing.put(f"{path}/suspend").status == 403
    assert nothing.put(f"{path}/resume").status == 403
    assert nothing.delete(path).status == 403
    assert limited(tenant, ["network-token:reveal"]).get(f"{path}/account").status == 200
    assert limited(tenant, ["network-token:read"]).post(f"{path}/cryptogram").status == 403
    assert limited(tenant, ["network-token:cryptogram"]).post(f"{path}/cryptogram").status == 200
    assert limited(tenant, ["network-token:resume"]).put(f"{path}/suspend").status == 403
    assert limited(tenant, ["network-token:suspend"]).put(f"{path}/suspend").status == 200
    assert limited(tenant, ["network-token:suspend"]).put(f"{path}/resume").status == 403
    assert limited(tenant, ["network-token:resume"]).put(f"{path}/resume").status == 200
    assert limited(tenant, ["network-token:read"]).delete(path).status == 403
    assert limited(tenant, ["network-token:delete"]).delete(path).status == 204


def test_another_tenant_sees_nothing(tenant, other_tenant, sandbox):
    created = _active(tenant.client)
    path = f"/network-tokens/{created['id']}"
    for answer in (
        other_tenant.client.get(path),
        other_tenant.client.get(f"{path}/account"),
        other_tenant.client.post(f"{path}/cryptogram"),
        other_tenant.client.put(f"{path}/suspend"),
        other_tenant.client.put(f"{path}/resume"),
        other_tenant.client.delete(path),
        other_tenant.client.get(f"/network-tokens/{uuid.uuid4()}"),
        other_tenant.client.get("/network-tokens/not-a-uuid"),
    ):
        assert answer.status == 404, answer
        assert answer.json["detail"] == "The network token was not found."
    # nothing was done to it
    assert tenant.client.get(path).json["status"] == "active"
    token = tenant.client.post("/tokens", {"type": "card", "data": _card()}).json
    refused = other_tenant.client.post("/network-tokens", {"token_id": token["id"]})
    assert refused.status == 400
    assert refused.json["errors"]["token_id"] == ["no token of the tenant has this id"]


def test_a_network_token_removed_by_a_failed_provisioning_answers_404_naming_it(tenant, other_tenant):
    answer = _create(tenant.client, DECLINED)
    assert answer.status == 422
    with session_scope() as session:
        job = session.exec(
            select(Job).where(Job.tenant_id == tenant.id, Job.kind == records.PROVISION_TASK, Job.status == "failed")
        ).one()
    removed = tenant.client.get(f"/network-tokens/{job.subject_id}")
    assert removed.status == 404
    assert removed.json["code"] == "card_not_eligible"
    plain = other_tenant.client.get(f"/network-tokens/{job.subject_id}")
    assert plain.status == 404 and "code" not in plain.json


# ---- cryptograms ----------------------------------------------------------------------------------


def test_cryptograms_are_fresh_with_the_brand_eci_and_never_stored(tenant, sandbox):
    visa = _active(tenant.client, VISA)
    mastercard = _active(tenant.client, MASTERCARD)
    first = tenant.client.post(f"/network-tokens/{visa['id']}/cryptogram")
    second = tenant.client.post(f"/network-tokens/{visa['id']}/cryptogram")
    assert first.status == 200, first
    assert set(first.json) == {"cryptogram", "eci"}
    assert first.json["eci"] == "05"
    assert first.json["cryptogram"] != second.json["cryptogram"]
    other = tenant.client.post(f"/network-tokens/{mastercard['id']}/cryptogram")
    assert other.json["eci"] == "02"
    cryptograms = [first.json["cryptogram"], second.json["cryptogram"], other.json["cryptogram"]]
    with session_scope() as session:
        crypto_jobs = session.exec(
            select(Job).where(Job.tenant_id == tenant.id, Job.kind == records.CRYPTOGRAM_TASK)
        ).all()
        stored = json.dumps([job.result for job in crypto_jobs]) + json.dumps(
            [e.data for e in session.exec(select(Event).where(Event.tenant_id == tenant.id)).all()]
        )
        rows = session.exec(select(NetworkToken).where(NetworkToken.tenant_id == tenant.id)).all()
    assert len(crypto_jobs) == 3
    assert all(job.result == {"eci": job.result["eci"], "delivered": True} for job in crypto_jobs)
    for value in cryptograms:
        assert value not in stored
        assert all(value.encode() not in (row.data_ct or b"") for row in rows)


# ---- suspend, resume, delete ----------------------------------------------------------------------


def test_suspend_resume_delete_move_the_states_and_tell_the_network(tenant, sandbox, receiver):
    _subscribe(tenant, receiver)
    created = _active(tenant.client)
    path = f"/network-tokens/{created['id']}"
    reference = created["_extras"]["network_reference"]

    def network_status() -> str:
        return next(t["status"] for t in _admin_tokens(sandbox, pan=VISA) if t["id"] == reference)

    suspended = tenant.client.put(f"{path}/suspend")
    assert suspended.status == 200, suspended
    assert suspended.json["status"] == "suspended"
    assert suspended.json["modified_at"] is not None
    assert network_status() == "suspended"
    assert tenant.client.get(path).json["status"] == "suspended"
    again = tenant.client.put(f"{path}/suspend")
    assert again.status == 409
    assert again.json["status_now"] == "suspended"
    assert tenant.client.post(f"{path}/cryptogram").status == 409
    (event,) = _events(receiver, "network-token.suspended", created["id"])
    assert event["data"] == {"network_token": {"id": created["id"], "status": "suspended"}}

    resumed = tenant.client.put(f"{path}/resume")
    assert resumed.status == 200, resumed
    assert resumed.json["status"] == "active"
    assert network_status() == "active"
    assert tenant.client.put(f"{path}/resume").status == 409
    _events(receiver, "network-token.resumed", created["id"])

    assert tenant.client.delete(path).status == 204
    assert tenant.client.get(path).status == 404
    assert tenant.client.delete(path).status == 404
    wait_until(lambda: network_status() == "deleted")
    (event,) = _events(receiver, "network-token.deleted", created["id"])
    assert event["data"] == {"network_token": {"id": created["id"], "status": "deleted"}}
    for hit in receiver.received:  # events carry ids and status only, never numbers
        assert VISA not in hit.body.decode()


def test_deleting_an_inactive_network_token_deletes_what_the_network_issues(tenant, sandbox, receiver):
    _subscribe(tenant, receiver)
    answer = _create(tenant.client, SLOW)
    assert answer.status == 202, answer
    pending_id = answer.json["id"]
    assert tenant.client.delete(f"/network-tokens/{pending_id}").status == 204
    assert tenant.client.get(f"/network-tokens/{pending_id}").status == 404

    def network_delete_job() -> Job | None:
        with session_scope() as session:
            return session.exec(
                select(Job).where(
                    Job.tenant_id == tenant.id, Job.kind == records.DELETE_TASK, Job.status == "succeeded"
                )
            ).first()

    job = wait_until(network_delete_job, timeout=30)
    deleted = [t for t in _admin_tokens(sandbox, pan=SLOW) if t["id"] == job.subject_id]
    assert deleted and deleted[0]["status"] == "deleted"
    assert _provision_job(pending_id).result["removed"] is True
    _events(receiver, "network-token.deleted", pending_id)
    assert not [r for r in receiver.received if r.json["event"]["type"] == "network-token.created"]


# ---- at rest and the proxy ------------------------------------------------------------------------


def test_the_number_is_encrypted_at_rest_and_readable_by_the_proxy_lookup(tenant, other_tenant, sandbox):
    created = _active(tenant.client)
    number = created["data"]["number"]
    (row,) = [r for r in _rows(tenant.id) if str(r.id) == created["id"]]
    assert number.encode() not in row.data_ct
    assert VISA.encode() not in row.data_ct
    assert number not in json.dumps(row.details) and number not in json.dumps(row.card)
    with session_scope() as session:
        value = network_tokens.proxy_value(session, tenant.id, created["id"])
        assert value["data"]["number"] == number
        assert value["data"]["expiration_year"] == YEAR + 3
        assert "cryptogram" not in json.dumps(value, default=str)
        with pytest.raises(Problem) as missing:
            network_tokens.proxy_value(session, other_tenant.id, created["id"])
        assert missing.value.status == 404
    assert tenant.client.put(f"/network-tokens/{created['id']}/suspend").status == 200
    with session_scope() as session, pytest.raises(Problem) as suspended:
        network_tokens.proxy_value(session, tenant.id, created["id"])
    assert suspended.value.status == 422


def test_the_openapi_description_documents_the_design(api):
    spec = ApiClient(api.base_url).get("/openapi.json").json
    create = spec["paths"]["/network-tokens"]["post"]
    assert "202" in create["description"] and "network-token.failed" in create["description"]
    assert "network-token:create" in create["x-permission"]
    read = spec["paths"]["/network-tokens/{id}"]["get"]
    assert "network-token:reveal" in read["x-permission"]
    assert "204" in spec["paths"]["/network-tokens/{id}"]["delete"]["responses"]
