"""The dialect-specific SQL of the platform, behind portable verbs (PostgreSQL and SQLite): domain
code states what it wants and never branches on the dialect.

Portable ``INSERT ... ON CONFLICT`` statements (:func:`insert_if_absent`, :func:`upsert_when`),
transaction-scoped locks by key (:func:`lock_key`), an ``UPDATE`` that returns columns of joined
tables (:func:`update_returning`), an event with its deliveries in one statement
(:func:`insert_event_with_deliveries`), lookups of many keys (:func:`select_by_keys`).

The ``INSERT ... ON CONFLICT`` forms are used instead of a SAVEPOINT around an insert that may collide:
SQLAlchemy dispatches ``after_commit`` when a SAVEPOINT is released, which would send the tasks a
transaction recorded before its real commit (``infra/dispatch.py``). On PostgreSQL a colliding insert
still waits for the transaction holding the other row to end, so the primary key decides between two
racing callers.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Row,
    Select,
    String,
    Text,
    Update,
    bindparam,
    cast,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped
from sqlmodel import Session, SQLModel

from storage.db import rowcount
from storage.models import Event, Job, Webhook, WebhookDelivery
from storage.states import JobStatus, WebhookStatus
from storage.types import table_of


def insert_if_absent(session: Session, model: type[SQLModel], values: dict) -> bool:
    """Insert one row of ``model`` unless its primary key (or a unique key) exists; True when inserted."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(table_of(model)).values(**values).on_conflict_do_nothing()
    return rowcount(session.execute(statement)) == 1


def upsert_when(session: Session, model: type[SQLModel], values: dict, *, index: list[str], when) -> bool:
    """Insert one row of ``model``, or overwrite the row with the same ``index`` columns when the
    SQL condition ``when`` holds for it (``INSERT ... ON CONFLICT (index) DO UPDATE ... WHERE when``):
    one statement. True when the row was inserted or overwritten, False when it exists and ``when``
    is false for it (left unchanged)."""
    statement = upsert_statement(session.get_bind().dialect.name, model, values, index=index, when=when)
    return rowcount(session.execute(statement)) == 1


def upsert_statement(dialect_name: str, model: type[SQLModel], values: dict, *, index: list[str], when) -> Insert:
    """The statement of :func:`upsert_when` on a ``dialect_name`` database (``postgresql`` or
    ``sqlite``), for a caller that sends it with other writes (``storage.db.stage_write``)."""
    insert = postgresql.insert if dialect_name == "postgresql" else sqlite.insert
    statement = insert(table_of(model)).values(**values)
    return statement.on_conflict_do_update(
        index_elements=index, set_={name: value for name, value in values.items() if name not in index}, where=when
    )


def is_postgresql(session: Session) -> bool:
    """True when ``session`` is bound to PostgreSQL (the statements of this module choose by it)."""
    return session.get_bind().dialect.name == "postgresql"


def lock_key(session: Session, key: str) -> None:
    """Serialise, until ``session``'s transaction ends, every transaction that locks the same ``key``:
    a transaction-level advisory lock on PostgreSQL (``pg_advisory_xact_lock(hashtext(key))``); nothing
    elsewhere (SQLite runs one writing transaction at a time)."""
    if is_postgresql(session):
        session.execute(select(func.pg_advisory_xact_lock(func.hashtext(key))))


def update_returning(
    session: Session,
    statement: Update,
    *,
    key: ColumnElement[Any],
    joins: Sequence[ColumnElement[bool]],
    columns: Sequence[Any],
) -> Sequence[Row[Any]]:
    """Run ``statement`` (an ``UPDATE`` of ``key``'s table) and return ``columns`` of each updated row
    together with the rows of other tables that ``joins`` (join conditions) relate to it: on PostgreSQL
    one ``UPDATE ... FROM ... RETURNING``; elsewhere (SQLite returns only the updated table's columns)
    the update returning ``key`` and one ``SELECT`` of the updated keys' rows."""
    if is_postgresql(session):
        return session.execute(statement.where(*joins).returning(*columns)).all()
    updated = session.execute(statement.returning(key)).scalars().all()
    if not updated:
        return []
    return session.execute(select(*columns).where(*joins, key.in_(updated))).all()


def insert_event_with_deliveries(
    session: Session,
    *,
    event_id: uuid.UUID,
    tenant_id: uuid.UUID,
    type: str,
    data: dict,
    trace_id: str | None,
    now: dt.datetime,
    deliver_kind: str,
    max_attempts: int,
) -> list[uuid.UUID] | None:
    """Insert event ``event_id`` and, per enabled webhook of the tenant subscribed to ``type``, one
    delivery: a ``queued`` job of ``deliver_kind`` (subject: the webhook) and its delivery row with the
    same new id, in one PostgreSQL statement that reads the webhooks itself (so the deliveries match
    the webhooks committed when it runs). Returns the delivery ids, or None on a database without this
    statement (nothing written: the caller writes the rows itself)."""
    if not is_postgresql(session):
        return None
    params = {
        "event_id": event_id,
        "tenant_id": tenant_id,
        "type": type,
        "trace_id": trace_id,
        "data": data,
        "now": now,
        "subscribed": [type],
        "max_attempts": max_attempts,
        "deliver_kind": deliver_kind,
    }
    return list(session.connection().execute(_event_with_deliveries_statement(), params).scalars().all())


@functools.cache
def _event_with_deliveries_statement() -> Any:
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
                bindparam("deliver_kind"),
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


def select_by_keys(
    session: Session,
    model: type[SQLModel],
    key: Mapped[str],
    values: list[str],
    *columns: Mapped[Any] | ColumnElement[Any],
    where: ColumnElement[bool],
) -> Select[Any]:
    """``SELECT columns`` of the rows of ``model`` whose text column ``key`` is one of ``values`` and
    for which ``where`` holds (e.g. the tenant's rows), one primary-key lookup per value.

    On PostgreSQL the values are joined as ``unnest(:values)`` so every row is a primary-key lookup
    whatever the table statistics say (``IN (5000 values)`` lets the planner pick a scan of the
    tenant's rows, ~3x slower); elsewhere a plain ``IN``. The statement may be refined further
    (``.where(...)``).
    """
    if session.get_bind().dialect.name == "postgresql":
        array = bindparam("wanted_keys", values, type_=postgresql.ARRAY(String))
        wanted = func.unnest(array).table_valued("id").render_derived(name="wanted")
        return select(*columns).select_from(wanted).join(model, where & (key == wanted.c.id))
    return select(*columns).where(where, key.in_(values))
