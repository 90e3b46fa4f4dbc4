"""Keyset pagination: one page of rows ordered by (time, id), and the position after it.

Every cursor list of the API pages this way (core document, "Pagination objects": cursor form). A
position is ``{"t": <ISO 8601 time>, "id": <id as text>}``: the time and id of the last row of the
previous page; the next page holds the rows strictly after it in the order. The API layer signs
positions into opaque cursors (``app/pagination.py``), so a position reaching this module is one this
module produced.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Uuid, and_, or_
from sqlmodel import Session


def keyset_page(
    session: Session,
    stmt,
    *,
    order: tuple[Any, Any],
    size: int,
    after: dict | None,
    descending: bool = True,
    entity: Callable[[Any], Any] | None = None,
) -> tuple[list, dict | None]:
    """Run ``stmt`` for one page: at most ``size`` rows after the position ``after`` (None: the
    first page) in the order of the columns ``order`` = ``(time column, id column)``, newest first
    unless ``descending`` is False. ``entity(row)`` picks the ordered model out of a row when ``stmt``
    selects several things (default: the row itself). Returns ``(rows, next position or None)``;
    None means this is the last page. Raises ValueError for a position that is not one of ours."""
    time_column, id_column = order
    if after:
        at = dt.datetime.fromisoformat(after["t"])
        last = uuid.UUID(str(after["id"])) if isinstance(id_column.type, Uuid) else str(after["id"])
        if descending:
            stmt = stmt.where(or_(time_column < at, and_(time_column == at, id_column < last)))
        else:
            stmt = stmt.where(or_(time_column > at, and_(time_column == at, id_column > last)))
    ordering = (time_column.desc(), id_column.desc()) if descending else (time_column, id_column)
    stmt = stmt.order_by(*ordering).limit(size + 1)
    rows = list(session.scalars(stmt).all() if entity is None else session.execute(stmt).all())
    if len(rows) <= size:
        return rows, None
    rows = rows[:size]
    last_entity = entity(rows[-1]) if entity else rows[-1]
    position = {"t": getattr(last_entity, time_column.key).isoformat(), "id": str(getattr(last_entity, id_column.key))}
    return rows, position
