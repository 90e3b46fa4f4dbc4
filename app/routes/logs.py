"""Log rows: ``/logs`` and ``/logs/entity-types`` (spec, core document section 4, Logs)."""

from __future__ import annotations

import datetime as dt
import uuid

from pydantic import Field
from sqlmodel import Session, select

from app.api import Api, Call
from app.pagination import cursor_page, cursor_query, decode_cursor
from app.schemas import ResponseModel
from domain.tenancy.audit import ENTITY_TYPES
from domain.tenancy.caller import Caller
from infra.errors import validation_problem
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


def _position(position: dict) -> tuple[dt.datetime, uuid.UUID]:
    """The (created_at, id) keyset position of a decoded cursor; 400 when its values are not ours."""
    try:
        at = _aware(dt.datetime.fromisoformat(position["t"]))
        last_id = uuid.UUID(position["id"])
    except (TypeError, ValueError, AttributeError):
        raise validation_problem({"start": ["This is not a cursor returned by this endpoint."]}) from None
    return at, last_id


def list_logs(session: Session, caller: Caller, query) -> dict:
    """One page of the tenant's log rows, newest first."""
    position = decode_cursor(query.start, ("t", "id"))
    stmt = select(AuditLog).where(AuditLog.tenant_id == caller.tenant_id)
    if query.entity_type:
        stmt = stmt.where(AuditLog.entity_type == query.entity_type)
    if query.entity_id:
        stmt = stmt.where(AuditLog.entity_id == query.entity_id)
    if query.start_date:
        stmt = stmt.where(AuditLog.created_at >= _aware(query.start_date))
    if query.end_date:
        stmt = stmt.where(AuditLog.created_at < _aware(query.end_date))
    if position:
        at, last_id = _position(position)
        stmt = stmt.where((AuditLog.created_at < at) | ((AuditLog.created_at == at) & (AuditLog.id < last_id)))
    rows = session.exec(stmt.order_by(AuditLog.created_at.desc(), AuditLog.id.desc()).limit(query.size + 1)).all()
    more = len(rows) > query.size
    rows = rows[: query.size]
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
    next_position = {"t": rows[-1].created_at.isoformat(), "id": str(rows[-1].id)} if more else None
    return cursor_page(data, size=query.size, next_position=next_position)


@api.route(
    "GET",
    "/logs",
    permission="log:read",
    query=LogQuery,
    response=list[LogOut],
    tag=TAG,
    summary="List log rows",
    errors=(400, 401, 403),
    description="Cursor pagination, newest first. Filters: entity_type, entity_id, start_date (inclusive), "
    "end_date (exclusive). Log rows never carry sensitive data. Retention is not limited.",
)
async def list_(call: Call):
    return await call.db(list_logs, call.caller, call.query)


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
