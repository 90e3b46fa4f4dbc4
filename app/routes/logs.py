"""Log rows: ``/logs`` and ``/logs/entity-types`` (spec, core document section 4, Logs)."""

from __future__ import annotations

import datetime as dt
import uuid

from pydantic import Field
from sqlmodel import Session, col, select

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, cursor_query, decode_cursor
from app.schemas import ResponseModel
from domain.tenancy.audit import ENTITY_TYPES
from domain.tenancy.caller import Caller
from storage.keyset import keyset_page
from storage.models import AuditLog

api = Api()
TAG = "Logs"

LogQuery = cursor_query(
    100,
    entity_type=(str | None, Field(None, max_length=64, pattern=r"^[^\x00]*$")),
    entity_id=(str | None, Field(None, max_length=400, pattern=r"^[^\x00]*$")),
    start_date=(dt.datetime | None, Field(None, description="created_at >= start_date (ISO 8601)")),
    end_date=(dt.datetime | None, Field(None, description="created_at < end_date (ISO 8601)")),
)


class LogOut(ResponseModel):
    tenant_id: uuid.UUID
    actor_id: uuid.UUID | None
    actor_type: str | None
    entity_type: str
    entity_id: str
    operation: str
    message: str
    created_at: dt.datetime


class EntityTypeOut(ResponseModel):
    display_name: str
    value: str


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    return value.replace(tzinfo=dt.UTC) if value is not None and value.tzinfo is None else value


def list_logs(session: Session, caller: Caller, query, position: dict | None) -> tuple[list[dict], dict | None]:
    """One page of the tenant's log rows, newest first, and the next keyset position (or None)."""
    stmt = select(AuditLog).where(AuditLog.tenant_id == caller.tenant_id)
    if query.entity_type:
        stmt = stmt.where(AuditLog.entity_type == query.entity_type)
    if query.entity_id:
        stmt = stmt.where(AuditLog.entity_id == query.entity_id)
    if query.start_date:
        stmt = stmt.where(col(AuditLog.created_at) >= _aware(query.start_date))
    if query.end_date:
        stmt = stmt.where(col(AuditLog.created_at) < _aware(query.end_date))
    rows, next_position = keyset_page(
        session, stmt, order=(AuditLog.created_at, AuditLog.id), size=query.size, after=position
    )
    data = [
        {
            "tenant_id": r.tenant_id,
            "actor_id": r.actor_id,
            "actor_type": r.actor_type,
            "entity_type": r.entity_type,
            "entity_id": r.entity_id,
            "operation": r.operation,
            "message": r.message,
            "created_at": r.created_at,
        }
        for r in rows
    ]
    return data, next_position


@api.route(
    "GET",
    "/logs",
    permission="log:read",
    query=LogQuery,
    response=CursorPage[LogOut],
    tag=TAG,
    summary="List log rows",
    errors=(400, 401, 403),
    description="Cursor pagination, newest first. Filters: entity_type, entity_id, start_date (inclusive), "
    "end_date (exclusive). Log rows never carry sensitive data. Retention is not limited.",
)
async def list_(call: Call):
    data, next_position = await call.db(list_logs, call.caller, call.query, decode_cursor(call, call.query.start))
    return cursor_page(call, data, size=call.query.size, next_position=next_position)


@api.route(
    "GET",
    "/logs/entity-types",
    permission="log:read",
    response=list[EntityTypeOut],
    tag=TAG,
    summary="List the entity types that log rows name",
    errors=(401, 403),
)
async def entity_types(call: Call):
    return [{"display_name": name, "value": value} for value, name in ENTITY_TYPES.items()]
