"""SIGTERM on real ``tessera api`` and ``tessera worker`` processes: the api finishes the request in
flight, a worker finishes the task it runs and leaves the rest in the queue, and the work of a worker
killed mid-task comes back (late acknowledgement, the lease, the relay). Along the way: the api's
``/metrics`` adds up the series of every worker process, ``/readyz`` and ``tessera queues`` show the
workers and beat, and every line the processes log is JSON with its context and no secret."""

from __future__ import annotations

import base64
import datetime as dt
import json
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update
from sqlmodel import select

from domain.webhooks.views import message_id
from infra import logs, ops
from storage.db import session_scope
from storage.models import Job, WebhookDelivery
from tests.helpers import ApiClient, WebhookReceiver, wait_until
from tests.ops.scan import find_secrets

pytestmark = pytest.mark.timeout(240)

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


@pytest.fixture
def owner(database):
    """A tenant made the way ``tessera tenants create`` makes it."""
    from domain.tenancy.tenants import create_tenant

    with session_scope() as session:
        return create_tenant(session, name="ops", owner_email=f"ops-{uuid.uuid4().hex[:8]}@example.com", type="test")


@pytest.fixture
def slow_receiver():
    server = WebhookReceiver(delay=3.0).start()
    yield server
    server.stop()


def _deliveries(webhook_id: str) -> list[WebhookDelivery]:
    with session_scope() as session:
        query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == uuid.UUID(webhook_id))
        return list(session.exec(query.order_by(WebhookDelivery.created_at)).all())


def _job(job_id: uuid.UUID) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _leased(webhook_id: str) -> WebhookDelivery | None:
    with session_scope() as session:
        query = (
            select(WebhookDelivery)
            .join(Job, Job.id == WebhookDelivery.id)
            .where(
                WebhookDelivery.webhook_id == uuid.UUID(webhook_id),
                Job.status == "running",
                Job.lease_owner.is_not(None),
            )
            .order_by(WebhookDelivery.created_at)
        )
        return session.exec(query).first()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _metrics(base_url: str) -> dict:
    answer = ApiClient(base_url).get("/metrics")
    assert answer.status == 200, answer
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.raw.decode())
        for s in family.samples
    }


def _assert_clean_json_logs(*processes) -> list[dict]:
    lines = []
    for process in processes:
        for raw in process.stderr_lines():
            if not raw.strip():
                continue
            line = json.loads(raw)  # every line is one JSON object
            assert set(logs.CONTEXT_FIELDS) <= set(line), raw
            assert {"time", "level", "logger", "message"} <= set(line), raw
            assert not find_secrets(raw), raw
            lines.append(line)
    return lines


def test_sigterm_lets_the_api_finish_the_request_in_flight(platform, owner):
    from sqlalchemy import text

    from storage.db import get_engine

    api = platform.start_api()
    port = int(platform.env["TESSERA_API_PORT"])
    client = ApiClient(platform.api_url, owner.api_key)
    hook = client.post("/webhooks", {"name": "before", "url": "https://example.com/h", "events": ["token.created"]})
    assert hook.status == 201, hook
    # The test holds the webhook's row: the update below is a request in flight for as long as it wants.
    with get_engine().connect() as connection, ThreadPoolExecutor(1) as pool:
        transaction = connection.begin()
        connection.execute(text("SELECT id FROM webhooks WHERE id = :id FOR UPDATE"), {"id": hook.json["id"]})
        change = {"name": "after", "url": "https://example.com/h", "events": ["token.created"]}
        in_flight = pool.submit(client.put, f"/webhooks/{hook.json['id']}", change)
        time.sleep(1.0)
        assert not in_flight.done()
        api.signal(signal.SIGTERM)
        wait_until(lambda: not _accepts(port), timeout=10)  # draining: no new connections
        time.sleep(1.0)
        assert api.alive(), api.output()  # still serving the request in flight
        transaction.commit()
        answer = in_flight.result(timeout=30)
    assert answer.status == 200, (answer, api.output())
    assert answer.json["name"] == "after"
    assert api.popen.wait(20) == 0, api.output()
    lines = _assert_clean_json_logs(api)
    served = [x for x in lines if x.get("route") == "/webhooks/{id}" and x.get("method") == "PUT"]
    assert served and served[0]["status"] == 200 and served[0]["tenant_id"] == str(owner.tenant_id)
    assert served[0]["duration_ms"] >= 2000


def test_sigterm_warm_shutdown_finishes_the_running_task_and_leaves_the_rest_queued(platform, owner, slow_receiver):
    api = platform.start_api()
    first_worker = platform.start_worker("--concurrency", "1")
    client = ApiClient(platform.api_url, owner.api_key)
    hook = client.post("/webhooks", {"name": "drain", "url": slow_receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook
    tokens = [client.post("/tokenize", CARD) for _ in range(2)]
    assert [t.status for t in tokens] == [201, 201], tokens
    running = wait_until(lambda: _leased(hook.json["id"]), timeout=30)

    first_worker.signal(signal.SIGTERM)
    assert first_worker.popen.wait(30) == 0, first_worker.output()
    finished = {d.id: d for d in _deliveries(hook.json["id"])}
    assert finished[running.id].status == "succeeded"  # the task in flight finished first
    waiting = [d for d in finished.values() if d.id != running.id]
    assert len(waiting) == 1 and waiting[0].status == "pending" and _job(waiting[0].id).attempts == 0
    assert ops.queue_depths(platform.settings())["webhooks"] == 1  # its message is still in Redis

    report = json.loads(platform.run("queues", "--json").stdout)
    assert {q["queue"]: q["depth"] for q in report["queues"]}["webhooks"] == 1
    assert not [w for w in report["workers"] if w["alive"]], report  # the stopped worker said goodbye

    second_worker = platform.start_worker("--concurrency", "2")
    wait_until(lambda: all(d.status == "succeeded" for d in _deliveries(hook.json["id"])), timeout=30)
    assert {r.headers["webhook-id"] for r in slow_receiver.received} == {
        message_id(d.id) for d in _deliveries(hook.json["id"])
    }

    # The api never runs a task: these counts come from the two workers' pool processes.
    samples = _metrics(platform.api_url)
    key = ("tessera_tasks_total", frozenset({("task", "webhooks.deliver"), ("outcome", "succeeded")}))
    assert samples.get(key, 0) >= 2, samples
    assert samples.get(("tessera_webhook_deliveries_total", frozenset({("outcome", "success")})), 0) >= 2
    ready = ApiClient(platform.api_url).get("/readyz").json
    assert ready["status"] == "ready", ready
    # one `tessera worker`: its prefork node and its providers and reactors (thread pool) nodes
    assert len(ready["workers"]) == 3 and all(w["heartbeat_age_seconds"] < 30 for w in ready["workers"]), ready
    nodes = sorted(
        "providers" if "-providers@" in w["name"] else "reactors" if "-reactors@" in w["name"] else "prefork"
        for w in ready["workers"]
    )
    assert nodes == ["prefork", "providers", "reactors"], ready

    second_worker.signal(signal.SIGTERM)
    assert second_worker.popen.wait(30) == 0, second_worker.output()
    api.signal(signal.SIGTERM)
    assert api.popen.wait(30) == 0, api.output()
    lines = _assert_clean_json_logs(api, first_worker, second_worker)
    traces = {t.headers["TS-TRACE-ID"] for t in tokens}
    ran = [x for x in lines if x["task"] == "webhooks.deliver" and x["logger"] == "celery.app.trace"]
    assert ran and all(x["tenant_id"] == str(owner.tenant_id) and x["trace_id"] in traces for x in ran), ran


def _unacked_delivery_ids(client, prefix: str) -> set[str]:
    found = set()
    for raw in client.hvals(f"{prefix}unacked"):
        message = json.loads(raw)[0]
        _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        found.update(kwargs.get("delivery_ids", []))
    return found


def test_work_of_a_worker_killed_mid_task_comes_back(platform, owner, slow_receiver, redis_flushed):
    api = platform.start_api()
    doomed = platform.start_worker("--concurrency", "1")
    client = ApiClient(platform.api_url, owner.api_key)
    hook = client.post("/webhooks", {"name": "killed", "url": slow_receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook
    assert client.post("/tokenize", CARD).status == 201
    running = wait_until(lambda: _leased(hook.json["id"]), timeout=30)

    doomed.kill_group()  # no warm shutdown: the worker and its pool process die mid-delivery
    prefix = platform.env["TESSERA_REDIS_KEY_PREFIX"]
    assert str(running.id) in _unacked_delivery_ids(redis_flushed, prefix)  # late ack: never acknowledged
    assert _deliveries(hook.json["id"])[0].status == "pending"

    # The lease runs out (made to now, as tests/infra/test_jobs.py does); beat's relay sends it again.
    with session_scope() as session:
        session.execute(
            update(Job)
            .where(Job.id == running.id)
            .values(lease_expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
    relay = {"TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "1"}
    beat = platform.start("beat", "beat", extra_env=relay)
    rescuer = platform.start_worker("--concurrency", "1", extra_env=relay)
    wait_until(lambda: _deliveries(hook.json["id"])[0].status == "succeeded", timeout=60)
    assert {r.headers["webhook-id"] for r in slow_receiver.received} == {message_id(running.id)}

    report = json.loads(platform.run("queues", "--json").stdout)
    assert report["beat"]["alive"] and report["relay"]["alive"], report
    assert any(w["alive"] and w["ping"] for w in report["workers"]), report
    assert ApiClient(platform.api_url).get("/readyz").json["beat"]["heartbeat_age_seconds"] < 30
    for process in (beat, rescuer, api):
        assert process.alive(), process.output()
        process.signal(signal.SIGTERM)
        assert process.popen.wait(30) == 0, process.output()
    _assert_clean_json_logs(api, doomed, beat, rescuer)
