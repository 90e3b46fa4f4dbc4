"""Webhooks: subscriptions over HTTP, signed deliveries by a real worker to a real receiver."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlmodel import select

from config.settings import Settings, get_settings
from domain.webhooks import deliveries as webhooks
from domain.webhooks import events
from infra import outbox
from infra.signing import SignatureError, verify
from storage.db import session_scope
from storage.models import Job, Webhook, WebhookDelivery
from tests.helpers import race, wait_until

pytestmark = pytest.mark.api


def _subscribe(tenant, url: str, events_: list[str] | None = None, **extra) -> dict:
    answer = tenant.client.post(
        "/webhooks",
        {
            "name": "hook",
            "url": url,
            "notify_email": "ops@example.com",
            "events": events_ or ["token.created"],
            **extra,
        },
    )
    assert answer.status == 201, answer
    return answer.json


def _emit(tenant, type_: str = "token.created", data: dict | None = None) -> uuid.UUID:
    with session_scope() as session:
        event_id = events.emit(
            session,
            tenant_id=tenant.id,
            type=type_,
            data=data or {"token": {"id": "t1", "type": "card"}},
            trace_id="trace-1",
        )
        return event_id


def _secret(tenant) -> str:
    answer = tenant.client.get("/webhooks/signing-key")
    assert answer.status == 200
    return answer.json["key"]


# ---- management --------------------------------------------------------------------------------


def test_create_read_list_update_delete(tenant):
    created = _subscribe(tenant, "https://hooks.example.com/in")
    assert created["status"] == "enabled"
    assert created["events"] == ["token.created"]
    assert tenant.client.get(f"/webhooks/{created['id']}").json == created
    page = tenant.client.get("/webhooks").json
    assert [w["id"] for w in page["data"]] == [created["id"]]
    assert "next" not in page["pagination"]

    updated = tenant.client.put(
        f"/webhooks/{created['id']}",
        {
            "name": "renamed",
            "url": "https://hooks.example.com/v2",
            "notify_email": None,
            "events": ["token.created", "token.deleted"],
            "status": "disabled",
        },
    )
    assert updated.status == 200, updated
    assert updated.json["status"] == "disabled"
    assert updated.json["name"] == "renamed"
    assert updated.json["modified_at"] is not None

    assert tenant.client.delete(f"/webhooks/{created['id']}").status == 204
    assert tenant.client.get(f"/webhooks/{created['id']}").status == 404


def test_list_pages_with_a_cursor(tenant):
    ids = [_subscribe(tenant, f"https://hooks.example.com/{n}")["id"] for n in range(5)]
    seen, cursor = [], None
    while True:
        answer = tenant.client.get("/webhooks?size=2" + (f"&start={cursor}" if cursor else ""))
        assert answer.status == 200
        seen += [w["id"] for w in answer.json["data"]]
        cursor = answer.json["pagination"].get("next")
        if not cursor:
            break
    assert seen == ids


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "url": "ftp://example.com/", "events": ["token.created"]}, "url"),
        ({"name": "x", "url": "https://user:pw@example.com/", "events": ["token.created"]}, "url"),
        ({"name": "x", "url": "https://example.com/", "events": ["token.exploded"]}, "events[0]"),
        ({"name": "x", "url": "https://example.com/", "events": []}, "events"),
        (
            {"name": "x", "url": "https://example.com/", "events": ["token.created"], "notify_email": "nope"},
            "notify_email",
        ),
        ({"url": "https://example.com/", "events": ["token.created"]}, "name"),
        ({"name": "x", "url": "https://example.com/", "events": ["token.created"], "secret": "s"}, "secret"),
    ],
)
def test_invalid_subscriptions_are_refused_and_nothing_is_written(tenant, body, field):
    answer = tenant.client.post("/webhooks", body)
    assert answer.status == 400
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert field in answer.json["errors"]
    assert tenant.client.get("/webhooks").json["data"] == []


def test_event_types_and_signing_key(tenant):
    types = tenant.client.get("/webhooks/event-types").json
    for required in (
        "token.created",
        "token.updated",
        "token.deleted",
        "network-token.created",
        "account-updater.job.completed",
        "agentic.payment-method.rail.retried",
        "reactor.invocation.completed",
        "reactor.invocation.failed",
    ):
        assert required in types
    key = _secret(tenant)
    assert key.startswith("whsec_")
    assert _secret(tenant) == key


def test_permissions_and_isolation(tenant, other_tenant, limited):
    created = _subscribe(tenant, "https://hooks.example.com/in")
    assert other_tenant.client.get(f"/webhooks/{created['id']}").status == 404
    assert other_tenant.client.delete(f"/webhooks/{created['id']}").status == 404
    reader = limited(tenant, ["webhook:read"])
    assert reader.get(f"/webhooks/{created['id']}").status == 200
    assert reader.get("/webhooks/signing-key").status == 200
    assert reader.get("/webhooks").status == 403  # listing needs webhooks:read
    denied = reader.post("/webhooks", {"name": "x", "url": "https://e.com/", "events": ["token.created"]})
    assert denied.status == 403
    assert "webhooks:create" in denied.json["detail"]
    assert limited(tenant, ["webhooks:read"]).get("/webhooks/signing-key").status == 403


# ---- delivery ------------------------------------------------------------------------------------


def test_delivery_is_signed_and_carries_the_envelope(tenant, receiver):
    _subscribe(tenant, receiver.url)
    event_id = _emit(tenant)
    hit = receiver.wait_for(lambda r: str(event_id).encode() in r.body)[0]
    verify(_secret(tenant), hit.headers, hit.body)
    envelope = hit.json
    assert set(envelope) == {"event", "delivered_at"}
    assert envelope["event"]["id"] == str(event_id)
    assert envelope["event"]["type"] == "token.created"
    assert envelope["event"]["tenant_id"] == str(tenant.id)
    assert envelope["event"]["trace_id"] == "trace-1"
    assert envelope["event"]["data"] == {"token": {"id": "t1", "type": "card"}}
    assert hit.headers["webhook-id"].startswith("msg_")
    with pytest.raises(SignatureError):
        verify(_secret(tenant), hit.headers, hit.body + b" ")


def test_only_subscribed_enabled_webhooks_receive_and_fan_out_is_one_delivery_each(tenant, receiver):
    _subscribe(tenant, receiver.url + "?a")
    _subscribe(tenant, receiver.url + "?b")
    _subscribe(tenant, receiver.url + "?deleted-only", ["token.deleted"])
    disabled = _subscribe(tenant, receiver.url + "?disabled")
    tenant.client.put(
        f"/webhooks/{disabled['id']}",
        {"name": "d", "url": disabled["url"], "events": ["token.created"], "status": "disabled"},
    )
    event_id = _emit(tenant)
    hits = receiver.wait_for(lambda r: str(event_id).encode() in r.body and "?" in r.path)
    wait_until(lambda: len([r for r in receiver.received if str(event_id).encode() in r.body]) >= 2)
    paths = sorted(r.path for r in receiver.received if str(event_id).encode() in r.body)
    assert paths == ["/hook?a", "/hook?b"], hits
    with session_scope() as session:
        rows = session.exec(select(WebhookDelivery).where(WebhookDelivery.event_id == event_id)).all()
    assert len(rows) == 2


def test_failed_answers_are_retried_with_the_same_message_id_and_logged(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    receiver.status = 500
    event_id = _emit(tenant)
    receiver.wait_for(lambda r: str(event_id).encode() in r.body)
    receiver.status = 200
    wait_until(lambda: len([r for r in receiver.received if str(event_id).encode() in r.body]) >= 2, timeout=15)
    hits = [r for r in receiver.received if str(event_id).encode() in r.body]
    assert len({h.headers["webhook-id"] for h in hits}) == 1

    def succeeded():
        page = tenant.client.get(f"/webhooks/{hook['id']}/deliveries").json
        return page if page["data"] and page["data"][0]["status"] == "succeeded" else None

    page = wait_until(succeeded)
    delivery = page["data"][0]
    assert delivery["id"] == hits[0].headers["webhook-id"]
    assert [a["status_code"] for a in delivery["attempts"]][:1] == [500]
    assert delivery["attempts"][-1]["status_code"] == 200
    assert all(a["duration_ms"] >= 0 for a in delivery["attempts"])


def test_redeliver_sends_the_same_message_again(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    event_id = _emit(tenant)
    first = receiver.wait_for(lambda r: str(event_id).encode() in r.body)[0]
    msg_id = first.headers["webhook-id"]
    wait_until(lambda: tenant.client.get(f"/webhooks/{hook['id']}/deliveries").json["data"][0]["status"] == "succeeded")
    answer = tenant.client.post(f"/webhooks/{hook['id']}/deliveries/{msg_id}/redeliver")
    assert answer.status == 202, answer
    wait_until(lambda: len([r for r in receiver.received if r.headers["webhook-id"] == msg_id]) == 2)
    assert tenant.client.post(f"/webhooks/{hook['id']}/deliveries/msg_{uuid.uuid4().hex}/redeliver").status == 404


def test_exhausted_retries_close_the_delivery_as_failed(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    receiver.status = 503
    event_id = _emit(tenant)
    schedule = get_settings().webhook_retry_delays

    def failed():
        data = tenant.client.get(f"/webhooks/{hook['id']}/deliveries").json["data"]
        return data if data and data[0]["status"] == "failed" else None

    delivery = wait_until(failed, timeout=30)[0]
    assert len(delivery["attempts"]) == len(schedule) + 1
    assert len([r for r in receiver.received if str(event_id).encode() in r.body]) == len(schedule) + 1


def test_a_webhook_failing_for_the_disable_period_is_disabled_and_notified(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    with session_scope() as session:
        row = session.get(Webhook, uuid.UUID(hook["id"]))
        row.failing_since = dt.datetime.now(dt.UTC) - dt.timedelta(days=6)
        session.add(row)
    receiver.status = 500
    _emit(tenant)
    wait_until(lambda: tenant.client.get(f"/webhooks/{hook['id']}").json["status"] == "disabled")
    mail_dir = get_settings().data_dir / "mail"

    def mailed():
        return [p for p in mail_dir.glob("*.eml") if hook["id"] in p.read_text()] if mail_dir.exists() else []

    message = wait_until(mailed)[0].read_text()
    assert "ops@example.com" in message
    assert "disabled" in message


def test_private_destinations_are_refused_unless_allowed(tenant, receiver):
    _subscribe(tenant, receiver.url)
    with session_scope() as session:
        event_id = events.emit(session, tenant_id=tenant.id, type="token.created", data={}, trace_id=None)
        session.info.clear()  # keep the worker out of it: this test delivers by hand
        delivery_id = session.exec(select(WebhookDelivery.id).where(WebhookDelivery.event_id == event_id)).one()
    strict = Settings(allow_private_destinations=False)
    assert webhooks.attempt(delivery_id, "test", strict) == "refused"
    with session_scope() as session:
        assert session.get(WebhookDelivery, delivery_id).status == "failed"
    assert not [r for r in receiver.received if str(event_id).encode() in r.body]


def test_the_relay_sends_recorded_work_whose_message_was_lost(tenant, receiver):
    _subscribe(tenant, receiver.url)
    with session_scope() as session:
        event_id = events.emit(session, tenant_id=tenant.id, type="token.created", data={}, trace_id=None)
        session.info.clear()  # the process "died" between commit and send
    with session_scope() as session:
        delivery = session.exec(select(WebhookDelivery).where(WebhookDelivery.event_id == event_id)).one()
        job = session.get(Job, delivery.id)  # the delivery's work
        # and a worker that took it died holding an expired lease
        job.lease_owner, job.lease_expires_at = "dead-worker", dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(job)
    with session_scope() as session:
        assert outbox.relay(session, grace_seconds=0) >= 1
    receiver.wait_for(lambda r: str(event_id).encode() in r.body)
    with session_scope() as session:  # relayed once: a second pass right away finds nothing to re-send
        assert outbox.relay(session, grace_seconds=0) == 0
    assert len([r for r in receiver.received if str(event_id).encode() in r.body]) == 1


def test_a_leased_delivery_is_not_delivered_twice(tenant, receiver):
    _subscribe(tenant, receiver.url)
    with session_scope() as session:
        event_id = events.emit(session, tenant_id=tenant.id, type="token.created", data={}, trace_id=None)
        session.info.clear()
        delivery_id = session.exec(select(WebhookDelivery.id).where(WebhookDelivery.event_id == event_id)).one()
    settings = get_settings()
    with session_scope() as session:
        assert webhooks.lease_delivery(session, delivery_id, "worker-a", lease_seconds=60)
    assert webhooks.attempt(delivery_id, "worker-b", settings) == "skipped"
    assert not [r for r in receiver.received if str(event_id).encode() in r.body]


def test_default_retry_schedule_starts_within_ten_seconds_and_grows():
    delays = Settings.model_fields["webhook_retry_schedule"].default.split(",")
    delays = [int(d) for d in delays]
    assert delays[0] <= 10
    assert delays == sorted(delays)
    assert sum(delays) > 24 * 3600


def test_an_answer_retrying_cannot_change_fails_the_delivery_at_once(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    receiver.status = 404  # a 4xx other than 408/409/425/429: the receiver answers the same every time
    event_id = _emit(tenant)

    def failed():
        data = tenant.client.get(f"/webhooks/{hook['id']}/deliveries").json["data"]
        return data if data and data[0]["status"] == "failed" else None

    delivery = wait_until(failed, timeout=15)[0]
    assert [a["status_code"] for a in delivery["attempts"]] == [404]
    assert delivery["next_attempt_at"] is None
    assert len([r for r in receiver.received if str(event_id).encode() in r.body]) == 1


def test_a_conflict_answer_is_retried(tenant, receiver):
    hook = _subscribe(tenant, receiver.url)
    receiver.status = 409
    event_id = _emit(tenant)
    receiver.wait_for(lambda r: str(event_id).encode() in r.body)
    receiver.status = 200

    def succeeded():
        data = tenant.client.get(f"/webhooks/{hook['id']}/deliveries").json["data"]
        return data if data and data[0]["status"] == "succeeded" else None

    delivery = wait_until(succeeded, timeout=20)[0]
    assert [a["status_code"] for a in delivery["attempts"]] == [409, 200]


def test_the_disabled_notice_is_a_recorded_job(tenant, receiver):
    from storage.models import Job

    hook = _subscribe(tenant, receiver.url)
    with session_scope() as session:
        row = session.get(Webhook, uuid.UUID(hook["id"]))
        row.failing_since = dt.datetime.now(dt.UTC) - dt.timedelta(days=6)
        session.add(row)
    receiver.status = 500
    _emit(tenant)

    def notice():
        with session_scope() as session:
            return session.exec(
                select(Job).where(
                    Job.kind == webhooks.NOTIFY_TASK,
                    Job.subject_type == "webhook",
                    Job.subject_id == hook["id"],
                    Job.status == "succeeded",
                )
            ).first()

    job = wait_until(notice, timeout=20)
    assert job.result == {"sent": True} and job.tenant_id == tenant.id


def test_two_workers_leasing_one_batch_at_once_share_it_without_overlap(tenant, receiver):
    _subscribe(tenant, receiver.url)
    with session_scope() as session:
        for _ in range(60):
            events.emit(session, tenant_id=tenant.id, type="token.created", data={}, trace_id=None)
        ids = list(
            session.exec(
                select(WebhookDelivery.id).where(
                    WebhookDelivery.tenant_id == tenant.id, WebhookDelivery.status == "pending"
                )
            ).all()
        )
        session.info.clear()  # keep the worker out of it: the two "workers" below race for the rows

    def lease(owner: str) -> list:
        with session_scope() as session:
            prepared, closed = webhooks.lease_batch(session, ids, owner, lease_seconds=60)
        return [p.delivery_id for p in prepared] + closed

    got = race(lease)
    assert not set(got["a"]) & set(got["b"])
    assert sorted(got["a"] + got["b"]) == sorted(ids)


def test_the_signing_secret_cache_follows_a_new_secret(tenant):
    from domain.tenancy.tenants import WEBHOOK_SECRET_PURPOSE, cached_signing_secret, webhook_signing_secret
    from storage.crypto import get_keyring
    from storage.models import Tenant

    with session_scope() as session:
        first = webhook_signing_secret(session, tenant.id)
        old_ct = session.get(Tenant, tenant.id).webhook_secret_ct
        assert cached_signing_secret(session, tenant.id, old_ct) == first
        new_ct = get_keyring().encrypt(session, tenant.id, WEBHOOK_SECRET_PURPOSE, str(tenant.id), b"whsec_bmV3")
        assert cached_signing_secret(session, tenant.id, new_ct) == "whsec_bmV3"
        assert cached_signing_secret(session, tenant.id, old_ct) == first
