"""Events and their fan-out to webhooks (``ARCHITECTURE.md``, step 4 of the spine).

:func:`emit` writes the event row and, per enabled webhook of the tenant subscribed to the type, one
delivery: its ``webhooks.deliver`` job row (``infra.jobs``) and its delivery row with the same id, in
the caller's transaction (the job and delivery rows of a flush in one statement), and sends the
delivery task after the commit, about a hundred delivery ids a message. Event data carries ids and
states, never sensitive values.

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

from sqlalchemy import Text, bindparam, cast, func, insert, inspect, literal
from sqlalchemy import event as sa_event
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Session, select

from config.settings import Settings, get_settings
from infra import jobs
from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_jobs_after_commit
from storage.db import Rows, insert_rows, on_commit
from storage.models import Event, Job, Webhook, WebhookDelivery
from storage.states import JobStatus, WebhookStatus
from storage.types import table_of, utcnow

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
#: Where :func:`emit` keeps an event's delivery rows until the flush that writes the event.
_DELIVERY_ROWS = "tessera_delivery_rows"


def emit(session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None) -> Event:
    """Record an event and its deliveries; the deliveries are enqueued when the session commits
    (batched across the events of one transaction).

    The event is added to ``session``; its deliveries' job and delivery rows are written right after
    the flush that writes the event (one statement for every event of the flush). Raises ValueError
    for a type not in :data:`EVENT_TYPES`.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    event = Event(tenant_id=tenant_id, type=type, data=data, trace_id=trace_id)
    subscribed = [webhook_id for webhook_id, types in _enabled_webhooks(session, tenant_id) if type in (types or [])]
    session.add(event)
    if subscribed:
        rows = Rows()
        _delivery_rows(
            session,
            rows,
            tenant_id=tenant_id,
            event_id=event.id,
            webhook_ids=subscribed,
            trace_id=trace_id,
            now=event.created_at,
        )
        inspect(event).info[_DELIVERY_ROWS] = rows
    return event


@sa_event.listens_for(Session, "after_flush")
def _write_deliveries(session, _context) -> None:
    """Write the job and delivery rows of the events :func:`emit` added, once their events are."""
    rows = Rows()
    for obj in session.new:
        if isinstance(obj, Event):
            staged = inspect(obj).info.pop(_DELIVERY_ROWS, None)
            if staged is not None:
                rows.merge(staged)
    if rows:
        insert_rows(session, rows)


def _delivery_rows(
    session: Session,
    rows: Rows,
    *,
    tenant_id: uuid.UUID,
    event_id: uuid.UUID,
    webhook_ids: list[uuid.UUID],
    trace_id: str | None,
    now: dt.datetime,
) -> list[uuid.UUID]:
    """Queue in ``rows`` one delivery of event ``event_id`` per webhook of ``webhook_ids``: its job row
    (sent after the commit, batched) and its delivery row, both with one new id; returns the ids."""
    ids = [uuid.uuid4() for _ in webhook_ids]
    jobs.stage_many(
        session,
        rows,
        [(i, str(w)) for i, w in zip(ids, webhook_ids, strict=True)],
        kind=DELIVER_TASK,
        tenant_id=tenant_id,
        subject_type="webhook",
        trace_id=trace_id,
        max_attempts=max_attempts(),
        now=now,
    )
    table = table_of(WebhookDelivery)
    for delivery_id, webhook_id in zip(ids, webhook_ids, strict=True):
        rows.add(
            table,
            {
                "id": delivery_id,
                "tenant_id": tenant_id,
                "webhook_id": webhook_id,
                "event_id": event_id,
                "last_status_code": None,
                "created_at": now,
                "completed_at": None,
            },
        )
    return ids


def max_attempts(settings: Settings | None = None) -> int:
    """The attempts of a delivery's job: the first and one per delay of ``TESSERA_WEBHOOK_RETRY_SCHEDULE``."""
    return len((settings or get_settings()).webhook_retry_delays) + 1


def emit_event(session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None) -> uuid.UUID:
    """:func:`emit` in one statement and without ORM objects, for paths that emit one event per
    transaction (a job's outcome): on PostgreSQL the event row and, per enabled webhook of the tenant
    subscribed to ``type``, a delivery's job row and delivery row are inserted by one ``INSERT ... WITH``
    that reads the webhooks itself (so the deliveries match the webhooks committed when it runs, as
    with :func:`emit`); the delivery task is sent when the session commits. Elsewhere :func:`emit`.
    Returns the event id. Raises ValueError for a type not in :data:`EVENT_TYPES`."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        return emit(session, tenant_id=tenant_id, type=type, data=data, trace_id=trace_id).id
    event_id, now = uuid.uuid4(), utcnow()
    delivery_ids = (
        connection.execute(
            _EMIT_ONE,
            {
                "event_id": event_id,
                "tenant_id": tenant_id,
                "type": type,
                "trace_id": trace_id,
                "data": data,
                "now": now,
                "subscribed": [type],
                "max_attempts": max_attempts(),
            },
        )
        .scalars()
        .all()
    )
    if delivery_ids:
        enqueue_jobs_after_commit(session, DELIVER_TASK, [str(d) for d in delivery_ids])
    return event_id


def _emit_one_statement():
    """``INSERT`` the event (CTE), pick a new delivery id per subscribed enabled webhook
    (``webhooks.events`` is a JSON array of types), ``INSERT`` their jobs (CTE) and their delivery
    rows, returning the delivery ids (foreign keys are checked when the statement ends)."""
    events, webhooks, deliveries = table_of(Event), table_of(Webhook), table_of(WebhookDelivery)
    job_table = table_of(Job)
    event_id = bindparam("event_id", type_=events.c.id.type)
    now = bindparam("now", type_=events.c.created_at.type)
    event = (
        insert(events)
        .values(
            id=event_id,
            tenant_id=bindparam("tenant_id", type_=events.c.tenant_id.type),
            type=bindparam("type"),
            trace_id=bindparam("trace_id"),
            data=bindparam("data", type_=events.c.data.type),
            created_at=now,
        )
        .cte("event")
    )
    chosen = (
        select(
            func.gen_random_uuid().label("id"),
            webhooks.c.tenant_id,
            webhooks.c.id.label("webhook_id"),
        )
        .where(
            webhooks.c.tenant_id == bindparam("tenant_id", type_=events.c.tenant_id.type),
            webhooks.c.status == WebhookStatus.ENABLED,
            cast(webhooks.c.events, JSONB).contains(bindparam("subscribed", type_=JSONB)),
        )
        .cte("chosen")
    )
    job_columns = (
        "id",
        "tenant_id",
        "kind",
        "subject_type",
        "subject_id",
        "status",
        "attempts",
        "max_attempts",
        "due_at",
        "created_at",
        "updated_at",
        "trace_id",
    )
    staged = (
        insert(job_table)
        .from_select(
            job_columns,
            select(
                chosen.c.id,
                chosen.c.tenant_id,
                literal(DELIVER_TASK),
                literal("webhook"),
                cast(chosen.c.webhook_id, Text),
                literal(JobStatus.QUEUED.value),
                literal(0),
                bindparam("max_attempts"),
                now,
                now,
                now,
                bindparam("trace_id"),
            ),
        )
        .cte("job")
    )
    columns = ("id", "tenant_id", "webhook_id", "event_id", "created_at")
    return (
        insert(deliveries)
        .from_select(columns, select(chosen.c.id, chosen.c.tenant_id, chosen.c.webhook_id, event_id, now))
        .add_cte(event, staged)
        .returning(deliveries.c.id)
    )


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
    session: Session,
    rows: Rows,
    *,
    tenant_id: uuid.UUID,
    type: str,
    datas: list[dict],
    trace_id: str | None,
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
    return _event_rows(
        session, rows, tenant_id=tenant_id, type=type, datas=datas, trace_id=trace_id, now=now, only_subscribed=True
    )


def _event_rows(
    session: Session,
    rows: Rows,
    *,
    tenant_id: uuid.UUID,
    type: str,
    datas: list[dict],
    trace_id: str | None,
    now: dt.datetime | None = None,
    only_subscribed: bool = False,
) -> int:
    """Queue the event rows and delivery rows of ``datas`` (every event, or only when a webhook
    subscribes) and the delivery task after the commit; returns how many deliveries."""
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    now = now or utcnow()
    subscribed = [webhook_id for webhook_id, types in _enabled_webhooks(session, tenant_id) if type in (types or [])]
    if only_subscribed and not subscribed:
        return 0
    delivery_ids = 0
    for data in datas:
        event_id = uuid.uuid4()
        rows.add(
            table_of(Event),
            {
                "id": event_id,
                "tenant_id": tenant_id,
                "type": type,
                "trace_id": trace_id,
                "data": data,
                "created_at": now,
            },
        )
        delivery_ids += len(
            _delivery_rows(
                session,
                rows,
                tenant_id=tenant_id,
                event_id=event_id,
                webhook_ids=subscribed,
                trace_id=trace_id,
                now=now,
            )
        )
    return delivery_ids


def _enabled_webhooks(session: Session, tenant_id: uuid.UUID) -> list[tuple[uuid.UUID, list]]:
    """The tenant's enabled webhooks and their event types, read once per transaction."""
    cache = session.info.setdefault(_WEBHOOK_CACHE, {})
    if tenant_id not in cache:
        cache[tenant_id] = session.exec(
            select(Webhook.id, Webhook.events).where(
                Webhook.tenant_id == tenant_id, Webhook.status == WebhookStatus.ENABLED
            )
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
