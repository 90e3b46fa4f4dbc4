"""The tenant usage report (core document section 2, Tenant: usage report; ``GET /tenants/self/reports/usage``).

``monthly_active_tokens`` is exact: the token domain calls :func:`record_token_activity` whenever
tokens are created, read or used, which writes one ``token_activity`` row per (tenant, calendar month
in UTC, token) with insert-or-ignore; the report counts this month's rows. A token active many times in
a month counts once; a token deleted later in the month still counts (it was active).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable

from sqlalchemy import func, insert, or_
from sqlmodel import Session, select

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from storage.models import Token
from storage.models_tenant_admin import TokenActivity
from storage.types import utcnow

#: Rows per INSERT statement (keeps the statement's bound parameters well under backend limits).
_INSERT_BATCH = 500


def month_of(moment: dt.datetime) -> dt.date:
    """The calendar month (UTC) holding ``moment``, as its first day."""
    moment = moment.astimezone(dt.UTC)
    return dt.date(moment.year, moment.month, 1)


def _insert_ignore(session: Session):
    """An INSERT that skips rows whose primary key exists (PostgreSQL and SQLite forms)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(TokenActivity).on_conflict_do_nothing()
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(TokenActivity).on_conflict_do_nothing()
    return insert(TokenActivity).prefix_with("IGNORE")  # MySQL-like backends


def record_token_activity(
    session: Session, tenant_id: uuid.UUID, token_ids: Iterable[str], *, now: dt.datetime | None = None
) -> None:
    """Count ``token_ids`` as active this month for the tenant, in the caller's transaction.

    Call it wherever tokens are created, read (single reads, lists, searches, children) or used
    (proxy and reactor detokenization, network tokens made from a token). Duplicates, in the list or
    already recorded this month, are ignored; an empty list does nothing. ``now`` defaults to the
    current time (UTC).
    """
    month = month_of(now or utcnow())
    unique = list(dict.fromkeys(str(token_id) for token_id in token_ids))
    for start in range(0, len(unique), _INSERT_BATCH):
        rows = [{"tenant_id": tenant_id, "month": month, "token_id": t} for t in unique[start : start + _INSERT_BATCH]]
        session.execute(_insert_ignore(session), rows)


def monthly_active_tokens(session: Session, tenant_id: uuid.UUID, *, now: dt.datetime | None = None) -> int:
    """How many distinct tokens of the tenant were active in the calendar month of ``now``."""
    return session.exec(
        select(func.count())
        .select_from(TokenActivity)
        .where(TokenActivity.tenant_id == tenant_id, TokenActivity.month == month_of(now or utcnow()))
    ).one()


def usage_report(session: Session, caller: Caller, *, included: int, now: dt.datetime | None = None) -> dict:
    """``GET /tenants/self/reports/usage``: ``{"token_report": {...}}``.

    ``metrics_by_type`` maps each token type with live tokens (not past ``expires_at``) to its
    ``count`` and ``last_created_at``; ``included_monthly_active_tokens`` is ``included`` (the
    setting ``TESSERA_INCLUDED_MONTHLY_ACTIVE_TOKENS``).
    """
    now = now or utcnow()
    rows = session.exec(
        select(Token.type, func.count(), func.max(Token.created_at))
        .where(Token.tenant_id == caller.tenant_id, or_(Token.expires_at.is_(None), Token.expires_at > now))
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
