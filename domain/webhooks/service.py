"""Webhooks: subscriptions and the delivery log (``POST/GET/PUT/DELETE /webhooks``,
``GET /webhooks/{id}/deliveries``, redeliver). Delivering is :mod:`domain.webhooks.deliveries`; the public
shapes are :mod:`domain.webhooks.views`."""

from __future__ import annotations

import uuid

from sqlalchemy import delete
from sqlmodel import Session, col, select

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.webhooks.events import EVENT_TYPES
from domain.webhooks.views import delivery_view, parse_message_id, webhook_view
from infra import jobs
from infra.addresses import validate_destination_url
from infra.celery import DELIVER_TASK
from infra.errors import not_found, validation_problem
from infra.lookup import get_owned
from storage.keyset import keyset_page
from storage.models import Event, Job, Webhook, WebhookAttempt, WebhookDelivery
from storage.states import JobStatus, WebhookStatus
from storage.types import utcnow

# ---- subscriptions -------------------------------------------------------------------------------


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
    return get_owned(session, Webhook, webhook_id, caller.tenant_id, what="webhook")


def read_webhook(session: Session, caller: Caller, webhook_id: uuid.UUID) -> dict:
    """``GET /webhooks/{id}``."""
    webhook = get_webhook(session, caller, webhook_id)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="read")
    return webhook_view(webhook)


def list_webhooks(session: Session, caller: Caller, *, size: int, after: dict | None) -> tuple[list[dict], dict | None]:
    """``GET /webhooks``: one page, oldest first, and the next keyset position (or None)."""
    query = select(Webhook).where(Webhook.tenant_id == caller.tenant_id)
    rows, next_position = keyset_page(
        session, query, order=(Webhook.created_at, Webhook.id), size=size, after=after, descending=False
    )
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
    status: WebhookStatus | None,
) -> dict:
    """``PUT /webhooks/{id}``: replace the subscription; ``status`` enables or disables it."""
    check_subscription(url, events)
    webhook = get_webhook(session, caller, webhook_id)
    webhook.name, webhook.url, webhook.notify_email = name, url, notify_email
    webhook.events = list(dict.fromkeys(events))
    if status is not None and status != webhook.status:
        webhook.status = status
        webhook.failing_since = None
        webhook.disabled_reason = None if status == WebhookStatus.ENABLED else "disabled by the tenant"
    webhook.modified_by = caller.application_id
    webhook.modified_at = utcnow()
    session.add(webhook)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="update")
    return webhook_view(webhook)


def delete_webhook(session: Session, caller: Caller, webhook_id: uuid.UUID) -> None:
    """``DELETE /webhooks/{id}``: the webhook and its delivery log."""
    webhook = get_webhook(session, caller, webhook_id)
    session.execute(  # the deliveries' jobs; each takes its delivery row and attempts with it
        delete(Job)
        .where(
            col(Job.kind) == DELIVER_TASK, col(Job.subject_type) == "webhook", col(Job.subject_id) == str(webhook.id)
        )
        .execution_options(synchronize_session=False)
    )
    session.delete(webhook)
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="delete")


# ---- the delivery log ----------------------------------------------------------------------------


def list_deliveries(
    session: Session, caller: Caller, webhook_id: uuid.UUID, *, size: int, after: dict | None
) -> tuple[list[dict], dict | None]:
    """``GET /webhooks/{id}/deliveries``: newest first, with attempts, and the next position."""
    webhook = get_webhook(session, caller, webhook_id)
    query = (
        select(WebhookDelivery, Job.status, Job.due_at, Event.type)
        .join(Job, col(Job.id) == WebhookDelivery.id)
        .join(Event, col(Event.id) == WebhookDelivery.event_id)
        .where(WebhookDelivery.webhook_id == webhook.id)
    )
    rows, next_position = keyset_page(
        session,
        query,
        order=(WebhookDelivery.created_at, WebhookDelivery.id),
        size=size,
        after=after,
        entity=lambda row: row[0],
    )
    attempts: dict[uuid.UUID, list[WebhookAttempt]] = {}
    if rows:
        for attempt in session.exec(
            select(WebhookAttempt)
            .where(col(WebhookAttempt.delivery_id).in_([row[0].id for row in rows]))
            .order_by(col(WebhookAttempt.attempted_at), col(WebhookAttempt.number))
        ):
            attempts.setdefault(attempt.delivery_id, []).append(attempt)
    return [
        delivery_view(d, job_status, due_at, event_type, attempts.get(d.id, []))
        for d, job_status, due_at, event_type in rows
    ], next_position


def redeliver(session: Session, caller: Caller, webhook_id: uuid.UUID, delivery_ref: str) -> dict:
    """``POST /webhooks/{id}/deliveries/{delivery_id}/redeliver``: one more attempt, now, same message id."""
    webhook = get_webhook(session, caller, webhook_id)
    delivery_id = parse_message_id(delivery_ref)
    delivery = session.get(WebhookDelivery, delivery_id) if delivery_id else None
    if delivery is None or delivery.webhook_id != webhook.id:
        raise not_found("delivery")
    jobs.requeue(session, [delivery.id], kind=DELIVER_TASK, fresh_budget=False)
    delivery.completed_at = None
    session.add(delivery)
    event = session.get(Event, delivery.event_id)
    if event is None:  # a delivery's event is deleted only with the delivery (cascade)
        raise not_found("delivery")
    event_type = event.type
    audit.record(session, caller, entity_type="webhook", entity_id=webhook.id, operation="update")
    return delivery_view(delivery, JobStatus.QUEUED, utcnow(), event_type, [])
