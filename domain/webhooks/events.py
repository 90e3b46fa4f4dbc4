"""Events and their fan-out to webhooks (``ARCHITECTURE.md``, step 4 of the spine).

:func:`emit` writes the event row and one delivery row per enabled webhook of the tenant subscribed
to the type, in the caller's transaction, and sends the delivery task after the commit. Event data
carries ids and states, never sensitive values.
"""

from __future__ import annotations

import uuid

from sqlalchemy import event as sa_event
from sqlalchemy import insert
from sqlmodel import Session, select

from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_batch_after_commit
from storage.models import Event, Webhook, WebhookDelivery
from storage.types import utcnow

#: Every event type the platform emits or will emit (``GET /webhooks/event-types``).
EVENT_TYPES: tuple[str, ...] = (
    "token.created",
    "token.updated",
    "token.deleted",
    "network-token.created",
    "network-token.suspended",
    "network-token.resumed",
    "network-token.deleted",
    "network-token.failed",
    "account-updater.job.completed",
    "agentic.payment-method.rail.retried",
    "reactor.invocation.completed",
    "reactor.invocation.failed",
)

_WEBHOOK_CACHE = "tessera_webhooks"


def emit(session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None) -> Event:
    """Record an event and its deliveries; the deliveries are enqueued when the session commits
    (batched across the events of one transaction).

    Raises ValueError for a type not in :data:`EVENT_TYPES`.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    event = Event(tenant_id=tenant_id, type=type, data=data, trace_id=trace_id)
    deliveries = [
        WebhookDelivery(tenant_id=tenant_id, webhook_id=webhook_id, event_id=event.id)
        for webhook_id, types in _enabled_webhooks(session, tenant_id)
        if type in (types or [])
    ]
    session.add(event)
    if deliveries:
        session.add_all(deliveries)
        enqueue_batch_after_commit(session, DELIVER_TASK, "delivery_ids", [str(d.id) for d in deliveries])
    return event


def emit_many(session: Session, *, tenant_id: uuid.UUID, type: str, datas: list[dict], trace_id: str | None) -> int:
    """:func:`emit` for many events of one type at once (bulk inserts: one statement per table).

    Returns how many deliveries were recorded. Raises ValueError for an unknown type.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    now = utcnow()
    subscribed = [webhook_id for webhook_id, types in _enabled_webhooks(session, tenant_id) if type in (types or [])]
    events, deliveries = [], []
    for data in datas:
        event_id = uuid.uuid4()
        events.append(
            {
                "id": event_id,
                "tenant_id": tenant_id,
                "type": type,
                "trace_id": trace_id,
                "data": data,
                "created_at": now,
            }
        )
        deliveries += [
            {
                "id": uuid.uuid4(),
                "tenant_id": tenant_id,
                "webhook_id": webhook_id,
                "event_id": event_id,
                "status": "pending",
                "attempts": 0,
                "due_at": now,
                "created_at": now,
            }
            for webhook_id in subscribed
        ]
    if events:
        session.execute(insert(Event), events)
    if deliveries:
        session.execute(insert(WebhookDelivery), deliveries)
        enqueue_batch_after_commit(session, DELIVER_TASK, "delivery_ids", [str(d["id"]) for d in deliveries])
    return len(deliveries)


def _enabled_webhooks(session: Session, tenant_id: uuid.UUID) -> list[tuple[uuid.UUID, list]]:
    """The tenant's enabled webhooks and their event types, read once per transaction."""
    cache = session.info.setdefault(_WEBHOOK_CACHE, {})
    if tenant_id not in cache:
        cache[tenant_id] = session.exec(
            select(Webhook.id, Webhook.events).where(Webhook.tenant_id == tenant_id, Webhook.status == "enabled")
        ).all()
    return cache[tenant_id]


@sa_event.listens_for(Session, "after_transaction_end")
def _forget_webhooks(session, transaction) -> None:
    session.info.pop(_WEBHOOK_CACHE, None)
