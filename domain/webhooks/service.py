"""Webhooks: subscriptions, signed deliveries with retries, the delivery log.

Delivery (``ARCHITECTURE.md`` step 4): :func:`domain.webhooks.events.emit` writes one delivery row per subscribed
webhook; the ``webhooks.deliver`` task takes a lease on the row, POSTs the envelope
``{event: {id, type, timestamp, tenant_id, trace_id, data}, delivered_at}`` signed with the Standard
Webhooks scheme (``webhook-id`` is the delivery's message id and stays the same across retries), and
records the attempt. A non-2xx answer or a timeout is retried after the delays of
``TESSERA_WEBHOOK_RETRY_SCHEDULE`` (default 5 s, 30 s, 2 min, 10 min, 30 min, 2 h, 5 h, 10 h, 10 h);
delays up to a minute ride on a Celery countdown, longer ones wait as ``due_at`` for the beat relay.
A webhook failing without a single success for ``TESSERA_WEBHOOK_DISABLE_AFTER_SECONDS`` (5 days) is
disabled and its ``notify_email`` is told. Redirects are never followed; private, loopback and
link-local destinations are refused at delivery time unless ``TESSERA_ALLOW_PRIVATE_DESTINATIONS``.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import or_, update
from sqlmodel import Session, select

from config.settings import Settings
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tenancy.tenants import webhook_signing_secret
from domain.webhooks.events import EVENT_TYPES
from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_after_commit, send_task
from infra.errors import not_found, validation_problem
from infra.http import DeliveryResult, deliver, validate_destination_url
from infra.signing import headers as signature_headers
from storage.keyset import keyset_page
from storage.models import Event, Webhook, WebhookAttempt, WebhookDelivery
from storage.types import utcnow

NOTIFY_TASK = "mail.webhook_disabled"
MAX_COUNTDOWN_SECONDS = 60


# ---- subscriptions -------------------------------------------------------------------------------


def webhook_view(webhook: Webhook) -> dict:
    """The public webhook object."""
    return {
        "id": webhook.id,
        "tenant_id": webhook.tenant_id,
        "status": webhook.status,
        "name": webhook.name,
        "url": webhook.url,
        "notify_email": webhook.notify_email,
        "events": list(webhook.events),
        "created_by": webhook.created_by,
        "created_at": webhook.created_at,
        "modified_by": webhook.modified_by,
        "modified_at": webhook.modified_at,
    }


def check_subscription(url: str, events: list[str]) -> None:
    """400 unless the URL has a deliverable form and every event type is known (no DNS lookup)."""
    errors: dict[str, list[str]] = {}
    url_error = validate_destination_url(url)
    if url_error:
        errors["url"] = [url_error]
    for index, name in enumerate(events):
        if name not in EVENT_TYPES:
            errors[f"events[{index}]"] = [f"'{name}' is not an event type; see GET /webhooks/event-types."]
    if not events:
        errors["events"] = ["Subscribe to at least one event type."]
    if errors:
        raise validation_problem(errors)


def create_webhook(
    session: Session, caller: Caller, *, name: str, url: str, notify_email: str | None, events: list[str]
) -> dict:
    """``POST /webhooks``: a new enabled webhook."""
    check_subscription(url, events)
    webhook = Webhook(
        tenant_id=caller.tenant_id,
        name=name,
        url=url,
        notify_email=notify_email,
        events=list(dict.fromkeys(events)),
        created_by=caller.application_id,
    )
    session.add(webhook)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="create")
    return webhook_view(webhook)


def get_webhook(session: Session, caller: Caller, webhook_id: uuid.UUID) -> Webhook:
    """The tenant's webhook, else 404."""
    webhook = session.get(Webhook, webhook_id)
    if webhook is None or webhook.tenant_id != caller.tenant_id:
        raise not_found("webhook")
    return webhook


def read_webhook(session: Session, caller: Caller, webhook_id: uuid.UUID) -> dict:
    """``GET /webhooks/{id}``."""
    webhook = get_webhook(session, caller, webhook_id)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="read")
    return webhook_view(webhook)


def list_webhooks(session: Session, caller: Caller, *, size: int, after: dict | None) -> tuple[list[dict], dict | None]:
    """``GET /webhooks``: one page, oldest first, and the next keyset position (or None)."""
    query = select(Webhook).where(Webhook.tenant_id == caller.tenant_id)
    rows, next_position = keyset_page(session, query, order=(Webhook.created_at, Webhook.id), size=size, after=after,
                                      descending=False)
    return [webhook_view(w) for w in rows], next_position


def update_webhook(
    session: Session,
    caller: Caller,
    webhook_id: uuid.UUID,
    *,
    name: str,
    url: str,
    notify_email: str | None,
    events: list[str],
    status: str | None,
) -> dict:
    """``PUT /webhooks/{id}``: replace the subscription; ``status`` enables or disables it."""
    check_subscription(url, events)
    webhook = get_webhook(session, caller, webhook_id)
    webhook.name, webhook.url, webhook.notify_email = name, url, notify_email
    webhook.events = list(dict.fromkeys(events))
    if status is not None and status != webhook.status:
        webhook.status = status
        webhook.failing_since = None
        webhook.disabled_reason = None if status == "enabled" else "disabled by the tenant"
    webhook.modified_by = caller.application_id
    webhook.modified_at = utcnow()
    session.add(webhook)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="update")
    return webhook_view(webhook)


def delete_webhook(session: Session, caller: Caller, webhook_id: uuid.UUID) -> None:
    """``DELETE /webhooks/{id}``: the webhook and its delivery log."""
    webhook = get_webhook(session, caller, webhook_id)
    session.delete(webhook)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="delete")


# ---- the delivery log ----------------------------------------------------------------------------


def message_id(delivery_id: uuid.UUID) -> str:
    """The Standard Webhooks message id of a delivery (``webhook-id``), stable across retries."""
    return f"msg_{delivery_id.hex}"


def delivery_view(delivery: WebhookDelivery, event_type: str, attempts: list[WebhookAttempt]) -> dict:
    """A delivery with its attempts (newest attempt last)."""
    return {
        "id": message_id(delivery.id),
        "webhook_id": delivery.webhook_id,
        "event_id": delivery.event_id,
        "event_type": event_type,
        "status": delivery.status,
        "next_attempt_at": delivery.due_at if delivery.status == "pending" else None,
        "created_at": delivery.created_at,
        "completed_at": delivery.completed_at,
        "attempts": [
            {
                "number": a.number,
                "attempted_at": a.attempted_at,
                "outcome": a.outcome,
                "status_code": a.status_code,
                "duration_ms": a.duration_ms,
                "error": a.error,
            }
            for a in attempts
        ],
    }


def parse_message_id(value: str) -> uuid.UUID | None:
    """The delivery id inside a ``msg_...`` message id (or a plain uuid); None when malformed."""
    try:
        return uuid.UUID(value.removeprefix("msg_"))
    except ValueError:
        return None


def list_deliveries(
    session: Session, caller: Caller, webhook_id: uuid.UUID, *, size: int, after: dict | None
) -> tuple[list[dict], dict | None]:
    """``GET /webhooks/{id}/deliveries``: newest first, with attempts, and the next position."""
    webhook = get_webhook(session, caller, webhook_id)
    query = (
        select(WebhookDelivery, Event.type)
        .join(Event, Event.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.webhook_id == webhook.id)
    )
    rows, next_position = keyset_page(session, query, order=(WebhookDelivery.created_at, WebhookDelivery.id),
                                      size=size, after=after, entity=lambda row: row[0])
    attempts: dict[uuid.UUID, list[WebhookAttempt]] = {}
    if rows:
        for attempt in session.exec(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_([d.id for d, _ in rows]))
            .order_by(WebhookAttempt.number)
        ):
            attempts.setdefault(attempt.delivery_id, []).append(attempt)
    return [delivery_view(d, event_type, attempts.get(d.id, [])) for d, event_type in rows], next_position


def redeliver(session: Session, caller: Caller, webhook_id: uuid.UUID, delivery_ref: str) -> dict:
    """``POST /webhooks/{id}/deliveries/{delivery_id}/redeliver``: one more attempt, now, same message id."""
    webhook = get_webhook(session, caller, webhook_id)
    delivery_id = parse_message_id(delivery_ref)
    delivery = session.get(WebhookDelivery, delivery_id) if delivery_id else None
    if delivery is None or delivery.webhook_id != webhook.id:
        raise not_found("delivery")
    delivery.status = "pending"
    delivery.due_at = utcnow()
    delivery.completed_at = None
    session.add(delivery)
    enqueue_after_commit(session, DELIVER_TASK, delivery_ids=[str(delivery.id)])
    event_type = session.get(Event, delivery.event_id).type
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="update")
    return delivery_view(delivery, event_type, [])


# ---- delivering ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """What one attempt needs, read in a short transaction before the HTTP call."""

    delivery_id: uuid.UUID
    url: str
    body: bytes
    headers: dict[str, str]
    attempt_number: int


def lease_delivery(session: Session, delivery_id: uuid.UUID, owner: str, *, lease_seconds: float) -> bool:
    """Take the lease on a due, pending delivery (an atomic update: one worker wins)."""
    now = utcnow()
    result = session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == delivery_id,
            WebhookDelivery.status == "pending",
            WebhookDelivery.due_at <= now + dt.timedelta(seconds=1),
            or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < now),
        )
        .values(lease_owner=owner, lease_expires_at=now + dt.timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def prepare(session: Session, delivery_id: uuid.UUID) -> Prepared | None:
    """Build the signed request of a leased delivery; None (and the delivery closed) when its webhook
    is gone or disabled."""
    delivery = session.get(WebhookDelivery, delivery_id)
    webhook = session.get(Webhook, delivery.webhook_id) if delivery else None
    if delivery is None:
        return None
    if webhook is None or webhook.status != "enabled":
        _close(delivery, "failed", "the webhook is disabled")
        session.add(delivery)
        return None
    event = session.get(Event, delivery.event_id)
    envelope = {
        "event": {
            "id": str(event.id),
            "type": event.type,
            "timestamp": event.created_at.isoformat(),
            "tenant_id": str(event.tenant_id),
            "trace_id": event.trace_id,
            "data": event.data,
        },
        "delivered_at": utcnow().isoformat(),
    }
    body = json.dumps(envelope, separators=(",", ":")).encode()
    secret = webhook_signing_secret(session, event.tenant_id)
    signed = signature_headers(secret, message_id(delivery.id), int(time.time()), body)
    return Prepared(delivery.id, webhook.url, body, signed, delivery.attempts + 1)


def _close(delivery: WebhookDelivery, status: str, error: str | None) -> None:
    delivery.status = status
    delivery.completed_at = utcnow()
    delivery.lease_owner = None
    delivery.lease_expires_at = None
    if error:
        delivery.last_error = error[:500]


def record_outcome(session: Session, prepared: Prepared, result: DeliveryResult, settings: Settings) -> int | None:
    """Record an attempt; returns the countdown (s) for a retry the caller should send now, if any.

    Success closes the delivery and clears the webhook's failing streak. Any other outcome schedules
    the next retry from the schedule, or closes the delivery as failed when the schedule is spent or
    the destination was refused; a webhook failing for longer than the disable period is disabled
    and its notify address mailed (after commit).
    """
    delivery = session.get(WebhookDelivery, prepared.delivery_id)
    webhook = session.get(Webhook, delivery.webhook_id)
    now = utcnow()
    session.add(
        WebhookAttempt(
            delivery_id=delivery.id,
            number=prepared.attempt_number,
            outcome=result.outcome,
            status_code=result.status_code,
            duration_ms=result.duration_ms,
            error=result.error,
            attempted_at=now,
        )
    )
    delivery.attempts = prepared.attempt_number
    delivery.last_status_code = result.status_code
    countdown = None
    if result.outcome == "success":
        _close(delivery, "succeeded", None)
        if webhook is not None and webhook.failing_since is not None:
            webhook.failing_since = None
            session.add(webhook)
    else:
        delays = settings.webhook_retry_delays
        if result.outcome == "refused" or prepared.attempt_number > len(delays):
            _close(delivery, "failed", result.error or f"HTTP {result.status_code}")
        else:
            delay = max(delays[prepared.attempt_number - 1], result.retry_after_s or 0)
            delivery.due_at = now + dt.timedelta(seconds=delay)
            delivery.last_error = (result.error or f"HTTP {result.status_code}")[:500]
            delivery.lease_owner = None
            delivery.lease_expires_at = None
            countdown = delay if delay <= MAX_COUNTDOWN_SECONDS else None
        if webhook is not None:
            _note_failure(session, webhook, now, settings)
    session.add(delivery)
    return countdown


def _note_failure(session: Session, webhook: Webhook, now: dt.datetime, settings: Settings) -> None:
    webhook.failing_since = webhook.failing_since or now
    failing_for = (now - webhook.failing_since).total_seconds()
    if webhook.status == "enabled" and failing_for >= settings.webhook_disable_after_seconds:
        webhook.status = "disabled"
        webhook.disabled_reason = f"deliveries failed for {int(failing_for)} s without a success"
        webhook.modified_at = now
        if webhook.notify_email:
            enqueue_after_commit(session, NOTIFY_TASK, webhook_id=str(webhook.id))
    session.add(webhook)


def attempt(delivery_id: uuid.UUID, owner: str, settings: Settings, session_scope) -> str:
    """Run one attempt of a delivery end to end; returns what happened (for logs and tests).

    Two short transactions: lease and prepare, then record. The HTTP call runs outside any transaction.
    """
    lease_seconds = settings.webhook_timeout_seconds * 3 + 30
    with session_scope() as session:
        if not lease_delivery(session, delivery_id, owner, lease_seconds=lease_seconds):
            return "skipped"
        prepared = prepare(session, delivery_id)
    if prepared is None:
        return "closed"
    result = deliver(
        prepared.url,
        prepared.body,
        prepared.headers,
        timeout_s=settings.webhook_timeout_seconds,
        allow_private=settings.allow_private_destinations,
    )
    with session_scope() as session:
        countdown = record_outcome(session, prepared, result, settings)
    if countdown is not None:
        send_task(DELIVER_TASK, countdown=countdown, delivery_ids=[str(delivery_id)])
    return result.outcome
