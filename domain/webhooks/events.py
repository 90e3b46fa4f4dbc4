"""Events and their fan-out to webhooks (``ARCHITECTURE.md``, step 4 of the spine).

:func:`emit` writes the event rows and, per enabled webhook of the tenant subscribed to the type, one
delivery each: its ``webhooks.deliver`` job row (``infra.jobs.record``) and its delivery row with the
same id, in the caller's transaction and without ORM objects, and sends the delivery task after the
commit, about a hundred delivery ids a message. Event data carries ids and states, never sensitive
values. Given the caller's ``rows`` (the hot path: tokens) it writes no event at all when no enabled
webhook of the tenant subscribes to the type (events are read only to be delivered).

Which event types a tenant's enabled webhooks subscribe to is cached per process
(:data:`subscriptions`): a change of webhooks made through this process applies at once (it is
dropped when the change is flushed and again when it commits), one made through another process
within ``TESSERA_WEBHOOK_CACHE_SECONDS``. The webhooks themselves are read in the transaction
whenever the tenant subscribes to the type, so the deliveries always match the committed webhooks.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Sequence
from typing import overload

from sqlalchemy import event as sa_event
from sqlmodel import Session, select

from config.settings import Settings, get_settings
from infra import jobs
from infra.celery import DELIVER_TASK
from infra.dispatch import enqueue_jobs_after_commit
from storage import sql
from storage.db import Rows, on_commit, stage_rows
from storage.models import Event, Webhook, WebhookDelivery
from storage.states import WebhookStatus
from storage.types import random_uuid, table_of, utcnow

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


@overload
def emit(
    session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None, rows: Rows | None = None
) -> uuid.UUID: ...


@overload
def emit(
    session: Session,
    *,
    tenant_id: uuid.UUID,
    type: str,
    data: Sequence[dict],
    trace_id: str | None,
    rows: Rows | None = None,
) -> list[uuid.UUID]: ...


def emit(
    session: Session,
    *,
    tenant_id: uuid.UUID,
    type: str,
    data: dict | Sequence[dict],
    trace_id: str | None,
    rows: Rows | None = None,
) -> uuid.UUID | list[uuid.UUID]:
    """Record events of ``type`` (one per ``data``: a dict, or a list of them) and, per enabled webhook
    of the tenant subscribed to the type, a delivery of each: its ``webhooks.deliver`` job row and its
    delivery row with the same id, in the caller's transaction; the delivery task is sent when the
    session commits, about a hundred delivery ids a message. Returns the event id (one dict) or ids.

    The rows are written without ORM objects, in as few statements as the caller's unit of work allows:

    * ``rows`` given (the hot path: tokens, which write their rows in one statement): queued there,
      and only when an enabled webhook of the tenant subscribes to ``type`` (events are read only to
      be delivered; the returned ids are then those the events would have had);
    * one event on PostgreSQL: one ``INSERT ... WITH`` that reads the subscribed webhooks itself
      (:func:`storage.sql.insert_event_with_deliveries`);
    * otherwise one multi-row ``INSERT`` per table (:func:`storage.db.stage_rows`: with the group's
      rows when the session runs a :class:`storage.db.GroupCommit`).

    Raises ValueError for a type not in :data:`EVENT_TYPES`.
    """
    if type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type}")
    one = isinstance(data, dict)
    datas: list[dict] = [data] if isinstance(data, dict) else list(data)
    if rows is not None:
        if type in subscriptions.types(session, tenant_id):
            ids = _event_rows(session, rows, tenant_id=tenant_id, type=type, datas=datas, trace_id=trace_id)
        else:
            ids = [random_uuid() for _ in datas]
    elif one and (event_id := _emit_one(session, tenant_id=tenant_id, type=type, data=datas[0], trace_id=trace_id)):
        ids = [event_id]
    else:
        staged = Rows()
        ids = _event_rows(session, staged, tenant_id=tenant_id, type=type, datas=datas, trace_id=trace_id)
        stage_rows(session, staged)
    return ids[0] if one else ids


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
    if not ids:
        return ids
    jobs.record(
        session,
        rows=rows,
        subjects=[(i, str(w)) for i, w in zip(ids, webhook_ids, strict=True)],
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


def _emit_one(
    session: Session, *, tenant_id: uuid.UUID, type: str, data: dict, trace_id: str | None
) -> uuid.UUID | None:
    """One event and its deliveries in one statement where the database has one
    (:func:`storage.sql.insert_event_with_deliveries`); returns its id, or None when it has none."""
    event_id = uuid.uuid4()
    delivery_ids = sql.insert_event_with_deliveries(
        session,
        event_id=event_id,
        tenant_id=tenant_id,
        type=type,
        data=data,
        trace_id=trace_id,
        now=utcnow(),
        deliver_kind=DELIVER_TASK,
        max_attempts=max_attempts(),
    )
    if delivery_ids is None:
        return None
    if delivery_ids:
        enqueue_jobs_after_commit(session, DELIVER_TASK, [str(d) for d in delivery_ids])
    return event_id


def _event_rows(
    session: Session,
    rows: Rows,
    *,
    tenant_id: uuid.UUID,
    type: str,
    datas: list[dict],
    trace_id: str | None,
) -> list[uuid.UUID]:
    """Queue the event rows of ``datas`` and their delivery rows in ``rows`` (the delivery task is sent
    after the commit); returns the event ids."""
    now = utcnow()
    subscribed = [webhook_id for webhook_id, types in _enabled_webhooks(session, tenant_id) if type in (types or [])]
    ids = []
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
        _delivery_rows(
            session, rows, tenant_id=tenant_id, event_id=event_id, webhook_ids=subscribed, trace_id=trace_id, now=now
        )
        ids.append(event_id)
    return ids


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
