"""Events and their fan-out to webhooks (``ARCHITECTURE.md``, step 4 of the spine).

:func:`emit` writes the event row and one delivery row per enabled webhook of the tenant subscribed
to the type, in the caller's transaction, and sends the delivery task after the commit. Event data
carries ids and states, never sensitive values.

:func:`stage_events` is the hot path's form (tokens): it queues the rows without ORM objects and
writes no event at all when no enabled webhook of the tenant subscribes to the type (events are
read only to be delivered). Which event types a tenant's enabled webhooks subscribe to is cached per
process (:data:`subscriptions`): a change of webhooks made through this process applies at once (it
is dropped when the change is flushed and again when it commits), one made through another process
within ``TESSERA_WEBHOOK_CACHE_SECONDS``. The webhooks themselves are read in the transaction
whenever the tenant subscribes to the type, so the deliveries always match the committed webhooks.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid

from sqlalchemy import bindparam, cast, func, insert, literal
from sqlalchemy import event as sa_event
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Session, select

from config.settings import get_settings
from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_batch_after_commit
from storage.db import Rows, on_commit
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
    "agentic.allowance.updated",
    "agentic.credential.created",
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


def emit_event(session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None) -> uuid.UUID:
    """:func:`emit` in one statement and without ORM objects, for paths that emit one event per
    transaction (a job's outcome): on PostgreSQL the event row and one delivery row per enabled
    webhook of the tenant subscribed to ``type`` are inserted by one ``INSERT ... WITH`` that reads
    the webhooks itself (so the deliveries match the webhooks committed when it runs, as with
    :func:`emit`); the delivery task is sent when the session commits. Elsewhere :func:`emit`.
    Returns the event id. Raises ValueError for a type not in :data:`EVENT_TYPES`."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        return emit(session, tenant_id=tenant_id, type=type, data=data, trace_id=trace_id).id
    event_id, now = uuid.uuid4(), utcnow()
    delivery_ids = connection.execute(_EMIT_ONE, {
        "event_id": event_id, "tenant_id": tenant_id, "type": type, "trace_id": trace_id, "data": data,
        "now": now, "subscribed": [type],
    }).scalars().all()
    if delivery_ids:
        enqueue_batch_after_commit(session, DELIVER_TASK, "delivery_ids", [str(d) for d in delivery_ids])
    return event_id


def _emit_one_statement():
    """``INSERT`` the event (CTE) and its deliveries ``SELECT``-ed from the subscribed enabled webhooks
    (``webhooks.events`` is a JSON array of types), returning the delivery ids."""
    events, webhooks, deliveries = Event.__table__, Webhook.__table__, WebhookDelivery.__table__
    event = insert(events).values(
        id=bindparam("event_id", type_=events.c.id.type),
        tenant_id=bindparam("tenant_id", type_=events.c.tenant_id.type),
        type=bindparam("type"), trace_id=bindparam("trace_id"), data=bindparam("data", type_=events.c.data.type),
        created_at=bindparam("now", type_=events.c.created_at.type),
    ).cte("event")
    chosen = select(
        func.gen_random_uuid(), webhooks.c.tenant_id, webhooks.c.id, bindparam("event_id", type_=events.c.id.type),
        literal("pending"), literal(0), bindparam("now", type_=events.c.created_at.type),
        bindparam("now", type_=events.c.created_at.type),
    ).where(
        webhooks.c.tenant_id == bindparam("tenant_id", type_=events.c.tenant_id.type),
        webhooks.c.status == "enabled",
        cast(webhooks.c.events, JSONB).contains(bindparam("subscribed", type_=JSONB)),
    ).add_cte(event)
    columns = ("id", "tenant_id", "webhook_id", "event_id", "status", "attempts", "due_at", "created_at")
    return insert(deliveries).from_select(columns, chosen).returning(deliveries.c.id)


_EMIT_ONE = _emit_one_statement()


def emit_many(session: Session, *, tenant_id: uuid.UUID, type: str, datas: list[dict], trace_id: str | None) -> int:
    """:func:`emit` for many events of one type at once (bulk inserts: one statement per table).

    Returns how many deliveries were recorded. Raises ValueError for an unknown type.
    """
    rows = Rows()
    count = _event_rows(session, rows, tenant_id=tenant_id, type=type, datas=datas, trace_id=trace_id)
    for (table, _ignore), batch in rows.tables.items():
        session.execute(insert(table), batch)
    return count


def stage_events(
    session: Session, rows: Rows, *, tenant_id: uuid.UUID, type: str, datas: list[dict], trace_id: str | None,
    now: dt.datetime | None = None,
) -> int:
    """Queue in ``rows`` the events of ``datas`` and their deliveries, only when an enabled webhook
    of the tenant subscribes to ``type`` (no event row otherwise; see the module's note on the
    cache). The delivery task is sent when the session commits. Returns how many deliveries were
    queued. Raises ValueError for an unknown type."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    if type not in subscriptions.types(session, tenant_id):
        return 0
    return _event_rows(session, rows, tenant_id=tenant_id, type=type, datas=datas, trace_id=trace_id, now=now,
                       only_subscribed=True)


def _event_rows(
    session: Session, rows: Rows, *, tenant_id: uuid.UUID, type: str, datas: list[dict], trace_id: str | None,
    now: dt.datetime | None = None, only_subscribed: bool = False,
) -> int:
    """Queue the event rows and delivery rows of ``datas`` (every event, or only when a webhook
    subscribes) and the delivery task after the commit; returns how many deliveries."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    now = now or utcnow()
    subscribed = [webhook_id for webhook_id, types in _enabled_webhooks(session, tenant_id) if type in (types or [])]
    if only_subscribed and not subscribed:
        return 0
    delivery_ids = []
    for data in datas:
        event_id = uuid.uuid4()
        rows.add(Event.__table__, {"id": event_id, "tenant_id": tenant_id, "type": type, "trace_id": trace_id,
                                   "data": data, "created_at": now})
        for webhook_id in subscribed:
            delivery_id = uuid.uuid4()
            delivery_ids.append(str(delivery_id))
            rows.add(WebhookDelivery.__table__, {
                "id": delivery_id, "tenant_id": tenant_id, "webhook_id": webhook_id, "event_id": event_id,
                "status": "pending", "attempts": 0, "due_at": now, "created_at": now,
            })
    if delivery_ids:
        enqueue_batch_after_commit(session, DELIVER_TASK, "delivery_ids", delivery_ids)
    return len(delivery_ids)


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


class SubscriptionCache:
    """Tenant id -> the event types its enabled webhooks subscribe to, each kept ``ttl`` seconds
    (the setting ``TESSERA_WEBHOOK_CACHE_SECONDS``; 0: read on every call)."""

    def __init__(self) -> None:
        self._entries: dict[uuid.UUID, tuple[frozenset[str], float]] = {}
        self._lock = threading.Lock()

    def types(self, session: Session, tenant_id: uuid.UUID) -> frozenset[str]:
        """The subscribed event types of the tenant (read in ``session`` when not cached)."""
        entry = self._entries.get(tenant_id)
        if entry is not None and entry[1] > time.monotonic():
            return entry[0]
        ttl = get_settings().webhook_cache_seconds
        found = frozenset(t for _, types in _enabled_webhooks(session, tenant_id) for t in (types or ()))
        if ttl > 0:
            with self._lock:
                if len(self._entries) > 10_000:
                    self._entries.clear()
                self._entries[tenant_id] = (found, time.monotonic() + ttl)
        return found

    def clear(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._entries.clear()


#: The process's cache of webhook subscriptions.
subscriptions = SubscriptionCache()


@sa_event.listens_for(Session, "after_flush")
def _webhooks_changed(session, _context) -> None:
    if any(isinstance(obj, Webhook) for group in (session.new, session.dirty, session.deleted) for obj in group):
        subscriptions.clear()  # at once, and again at the commit (a read in between saw the old rows)
        on_commit(session, subscriptions.clear)
