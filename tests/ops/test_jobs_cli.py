"""``tessera jobs`` and ``tessera queues`` as an operator runs them (real subprocesses), against the
in-process worker: dead letters recorded with their last error and replayed, cancelled jobs,
failed webhook deliveries replayed, queue depth, oldest age and consumers."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid

import pytest
from sqlmodel import select

from config.settings import get_settings
from domain.webhooks.views import message_id
from infra import ops
from storage.db import session_scope
from storage.models import Job, WebhookDelivery
from tessera.cli.output import table as _table
from tests.helpers import wait_until
from tests.ops import probe
from tests.ops.conftest import TESSERA

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


def tessera(*args: str) -> subprocess.CompletedProcess:
    """Run ``tessera <args>`` with the test settings (the environment of this run)."""
    return subprocess.run([*TESSERA, *args], capture_output=True, text=True, timeout=60)


def as_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_dead_letter_is_listed_shown_and_replayed(worker, tenant):
    probe.MODE["value"] = "transient"
    job = probe.record(max_attempts=2, tenant_id=tenant.id)
    wait_until(lambda: probe.read(job.id).status == "dead")

    dead = as_json(
        tessera("jobs", "list", "--state", "dead", "--kind", probe.KIND, "--tenant", str(tenant.id), "--json")
    )
    assert [row["id"] for row in dead] == [str(job.id)]
    assert dead[0]["attempts"] == 2 and dead[0]["max_attempts"] == 2
    assert "503" in dead[0]["last_error"]

    shown = as_json(tessera("jobs", "show", str(job.id), "--json"))
    assert shown["state"] == "dead" and shown["queue"] == "default" and shown["tenant_id"] == str(tenant.id)
    assert shown["attempts"] == 2 and "probe provider answered 503" in shown["last_error"]

    table = tessera("jobs", "list", "--state", "dead", "--tenant", str(tenant.id))
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["ID", "KIND", "STATE", "ATTEMPTS", "UPDATED", "LAST", "ERROR"]
    assert row.split()[:4] == [str(job.id), probe.KIND, "dead", "2/2"]

    probe.MODE["value"] = "succeed"
    try:
        replayed = tessera("jobs", "retry", str(job.id))
        assert replayed.returncode == 0, replayed.stderr
        assert "queued again" in replayed.stdout
        done = wait_until(lambda: (j := probe.read(job.id)).status == "succeeded" and j)
    finally:
        probe.MODE["value"] = "transient"
    assert done.attempts == 1 and done.result == {"ok": True}

    refused = tessera("jobs", "retry", str(job.id))
    assert refused.returncode == 1
    assert "succeeded" in refused.stderr


def test_a_queued_job_is_cancelled_and_a_cancelled_one_cannot_be_cancelled_again(worker):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    job = probe.record(due_at=later)  # its task finds it not due yet and leaves it queued
    cancelled = as_json(tessera("jobs", "cancel", str(job.id), "--json"))
    assert cancelled["state"] == "cancelled"
    assert probe.read(job.id).status == "cancelled"
    again = tessera("jobs", "cancel", str(job.id))
    assert again.returncode == 1 and "cancelled" in again.stderr
    unknown = tessera("jobs", "show", "00000000-0000-0000-0000-000000000000")
    assert unknown.returncode == 1 and "no job or webhook delivery" in unknown.stderr


def test_a_failed_webhook_delivery_is_shown_with_its_attempts_and_replayed(api, tenant, receiver):
    receiver.status = 500
    hook = tenant.client.post("/webhooks", {"name": "replay", "url": receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook
    token = tenant.client.post("/tokenize", CARD)
    assert token.status == 201, token

    def failed():
        with session_scope() as session:
            query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == uuid.UUID(hook.json["id"]))
            rows = session.exec(query).all()
            return rows[0] if rows and rows[0].status == "failed" else None

    delivery = wait_until(failed, timeout=30)  # the test retry schedule is 1, 1, 2 s
    listed = as_json(
        tessera("jobs", "list", "--kind", "webhooks.deliver", "--state", "failed", "--tenant", str(tenant.id), "--json")
    )
    assert [row["id"] for row in listed] == [str(delivery.id)]
    shown = as_json(tessera("jobs", "show", message_id(delivery.id), "--json"))
    assert shown["kind"] == "webhooks.deliver" and shown["state"] == "failed"
    assert [a["status_code"] for a in shown["attempt_log"]] == [500, 500, 500, 500]
    assert shown["last_error"] == "HTTP 500"

    receiver.status = 200
    replayed = as_json(tessera("jobs", "retry", str(delivery.id), "--json"))
    assert replayed["state"] == "pending"
    wait_until(lambda: (d := _delivery(delivery.id)).status == "succeeded" and d)
    shown = as_json(tessera("jobs", "show", str(delivery.id), "--json"))
    assert [a["outcome"] for a in shown["attempt_log"]][-1] == "success"
    ids = {r.headers["webhook-id"] for r in receiver.received}
    assert ids == {message_id(delivery.id)}  # one message id across the retries and the replay


def _delivery(delivery_id) -> WebhookDelivery:
    with session_scope() as session:
        return session.get(WebhookDelivery, delivery_id)


@pytest.fixture
def beat_alive():
    """A beat heartbeat, as a running ``tessera beat`` writes it (the in-process worker has no beat)."""
    settings = get_settings()
    ops.record_heartbeat(settings, "beat")
    yield
    ops.forget_heartbeat(settings, "beat")


def test_queues_shows_depth_oldest_age_consumers_and_workers(worker, beat_alive):
    earlier = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=3)
    with session_scope() as session:
        waiting = Job(kind="ops_probe.waiting", status="queued", due_at=earlier)
        session.add(waiting)
    try:
        report = as_json(tessera("queues", "--json"))
        table = tessera("queues")
    finally:
        with session_scope() as session:
            session.delete(session.get(Job, waiting.id))
    queues = {q["queue"]: q for q in report["queues"]}
    assert set(queues) == {"default", "webhooks", "providers", "files", "mail", "sweeps", "reactors"}
    assert all(isinstance(q["depth"], int) for q in queues.values())
    assert queues["default"]["due"] >= 1 and queues["default"]["oldest_age_seconds"] >= 180
    assert all(q["consumers"] >= 1 for q in queues.values()), report  # the in-process worker answers
    assert report["errors"] == {}
    assert any(w["ping"] for w in report["workers"]), report
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == ["QUEUE", "DEPTH", "DUE", "OLDEST", "CONSUMERS"]
    assert any(line.split()[:1] == ["default"] and line.split()[3] == "3m" for line in table.stdout.splitlines())


def test_queues_exits_non_zero_when_beat_or_every_worker_is_missing(worker):
    settings = get_settings()
    ops.forget_heartbeat(settings, "beat")
    no_beat = tessera("queues")
    assert no_beat.returncode == 1, no_beat.stdout
    assert "beat: MISSING" in no_beat.stdout and no_beat.stdout.splitlines()[-1] == "missing: beat"

    ops.record_heartbeat(settings, "beat")
    try:
        assert tessera("queues").returncode == 0
        # A run whose broker no worker consumes (its own Redis key prefix) has no worker alive.
        alone = subprocess.run(
            [*TESSERA, "queues", "--json", "--timeout", "0.5"],
            env={**os.environ, "TESSERA_REDIS_KEY_PREFIX": f"{settings.redis_key_prefix}alone{os.urandom(3).hex()}:"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        ops.forget_heartbeat(settings, "beat")
    report = json.loads(alone.stdout)
    assert alone.returncode == 1 and not any(w["alive"] for w in report["workers"])


def test_the_table_lines_up_its_columns():
    text = _table([{"a": "x", "b": None}, {"a": "longer", "b": 2}], [("a", "A"), ("b", "B")])
    assert text.splitlines() == ["A       B", "x       -", "longer  2"]
