"""The tenant usage report (core document section 2, Tenant: usage report; ``GET /tenants/self/reports/usage``).

``monthly_active_tokens`` is exact: a token counts in the month it was created (its ``created_at``),
and the token domain calls :func:`record_token_activity` whenever tokens are read or used, which
writes one ``token_activity`` row per (tenant, calendar month in UTC, token) with insert-or-ignore;
the report counts the distinct tokens of both. A token active many times in a month counts once; a
deleted token still counts in the month it was created (:func:`record_deleted_tokens` writes that
month's activity row when it is deleted).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, exists, func, or_, union
from sqlmodel import Session, col, select

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from storage.db import Rows, insert_rows, insert_rows_unflushed
from storage.models import Token
from storage.models_tenancy import TokenActivity
from storage.types import table_of, utcnow

_TABLE = table_of(TokenActivity)


def month_of(moment: dt.datetime) -> dt.date:
    """The calendar month (UTC) holding ``moment``, as its first day."""
    moment = moment.astimezone(dt.UTC)
    return dt.date(moment.year, moment.month, 1)


def record_token_activity(
    session: Session,
    tenant_id: uuid.UUID,
    token_ids: Iterable[str],
    *,
    now: dt.datetime | None = None,
    rows: Rows | None = None,
) -> None:
    """Count ``token_ids`` as active this month for the tenant, in the caller's transaction: written
    now, or queued in ``rows`` when the caller writes its rows in one statement
    (``storage.db.insert_rows``).

    Call it wherever tokens are read (single reads, lists, searches, children) or used (proxy and
    reactor detokenization, network tokens made from a token), and for deleted tokens (see
    :func:`record_deleted_tokens`); a token's creation counts through its ``created_at``.
    Duplicates, in the list or already recorded this month, are ignored; an empty list does
    nothing. ``now`` defaults to the current time (UTC).
    """
    if rows is not None:
        stage_token_activity(rows, tenant_id, token_ids, now=now)
        return
    staged = Rows()
    stage_token_activity(staged, tenant_id, token_ids, now=now)
    insert_rows(session, staged)


def record_token_activity_unflushed(
    tenant_id: uuid.UUID, token_ids: Iterable[str], *, now: dt.datetime | None = None
) -> None:
    """:func:`record_token_activity` outside any transaction, in one statement committed without
    waiting for the WAL flush (:func:`storage.db.execute_unflushed`): for a job's slow step (a
    provider call reading a card token), whose outcome or failure commit makes it durable."""
    rows = Rows()
    stage_token_activity(rows, tenant_id, token_ids, now=now)
    insert_rows_unflushed(rows)


def activity_recorded(tenant_id: Any, token_id: Any, month: Any) -> ColumnElement[bool]:
    """Whether token ``token_id`` of ``tenant_id`` already counts as active in ``month`` (the first day
    of a calendar month in UTC): an ``EXISTS`` over the activity rows' primary key, each argument a
    value or an SQL expression (e.g. a lease statement's read, with ``month`` its
    :data:`infra.jobs.LEASE_MONTH`), so that a job skips a write that would change nothing."""
    return exists().where(_TABLE.c.tenant_id == tenant_id, _TABLE.c.month == month, _TABLE.c.token_id == token_id)


def stage_token_activity(
    rows: Rows, tenant_id: uuid.UUID, token_ids: Iterable[str], *, now: dt.datetime | None = None
) -> None:
    """Queue in ``rows`` what :func:`record_token_activity` writes (for ``storage.db.stage_rows``)."""
    month = month_of(now or utcnow())
    for token_id in dict.fromkeys(str(t) for t in token_ids):
        rows.add(_TABLE, {"tenant_id": tenant_id, "month": month, "token_id": token_id}, ignore_conflicts=True)


def record_deleted_tokens(session: Session, tenant_id: uuid.UUID, deleted: Iterable[tuple[str, dt.datetime]]) -> None:
    """Keep deleted tokens counted in the month they were created (``(id, created_at)`` pairs): the
    count of a month reads the ``tokens`` created in it, which a deletion removes."""
    by_month: dict[dt.date, list[str]] = {}
    for token_id, created_at in deleted:
        by_month.setdefault(month_of(created_at), []).append(token_id)
    for month, ids in by_month.items():
        record_token_activity(session, tenant_id, ids, now=dt.datetime(month.year, month.month, 1, tzinfo=dt.UTC))


def monthly_active_tokens(session: Session, tenant_id: uuid.UUID, *, now: dt.datetime | None = None) -> int:
    """How many distinct tokens of the tenant were active in the calendar month of ``now``: created
    in it (``tokens.created_at``) or recorded active in it (``token_activity``)."""
    month = month_of(now or utcnow())
    start = dt.datetime(month.year, month.month, 1, tzinfo=dt.UTC)
    end = dt.datetime(month.year + month.month // 12, month.month % 12 + 1, 1, tzinfo=dt.UTC)
    active = select(TokenActivity.token_id).where(TokenActivity.tenant_id == tenant_id, TokenActivity.month == month)
    created = select(Token.id).where(Token.tenant_id == tenant_id, Token.created_at >= start, Token.created_at < end)
    return session.exec(select(func.count()).select_from(union(active, created).subquery())).one()


def usage_report(session: Session, caller: Caller, *, included: int, now: dt.datetime | None = None) -> dict:
    """``GET /tenants/self/reports/usage``: ``{"token_report": {...}}``.

    ``metrics_by_type`` maps each token type with live tokens (not past ``expires_at``) to its
    ``count`` and ``last_created_at``; ``included_monthly_active_tokens`` is ``included`` (the
    setting ``TESSERA_INCLUDED_MONTHLY_ACTIVE_TOKENS``).
    """
    now = now or utcnow()
    rows = session.exec(
        select(Token.type, func.count(), func.max(Token.created_at))
        .where(
            col(Token.tenant_id) == caller.tenant_id, or_(col(Token.expires_at).is_(None), col(Token.expires_at) > now)
        )
        .group_by(Token.type)
        .order_by(Token.type)
    ).all()
    metrics = {
        kind: {"count": count, "last_created_at": _aware(last_created_at)} for kind, count, last_created_at in rows
    }
    audit.record(session, caller, entity_type="tenant", entity_id=caller.tenant_id, operation="read")
    return {
        "token_report": {
            "metrics_by_type": metrics,
            "included_monthly_active_tokens": included,
            "monthly_active_tokens": monthly_active_tokens(session, caller.tenant_id, now=now),
        }
    }


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    # func.max() bypasses the column's type on some backends (SQLite returns text): normalise to UTC.
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)
