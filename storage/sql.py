"""Portable statements (PostgreSQL and SQLite): ``INSERT ... ON CONFLICT`` and lookups of many keys.

Used instead of a SAVEPOINT around an insert that may collide: SQLAlchemy dispatches ``after_commit``
when a SAVEPOINT is released, which would send the tasks a transaction recorded before its real
commit (``infra/dispatch.py``). On PostgreSQL a colliding insert still waits for the transaction
holding the other row to end, so the primary key decides between two racing callers.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, String, bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped
from sqlmodel import Session, SQLModel

from storage.db import rowcount
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
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = insert(table_of(model)).values(**values)
    statement = statement.on_conflict_do_update(
        index_elements=index, set_={name: value for name, value in values.items() if name not in index}, where=when
    )
    return rowcount(session.execute(statement)) == 1


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
