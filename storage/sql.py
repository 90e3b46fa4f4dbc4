"""Portable ``INSERT ... ON CONFLICT`` statements (PostgreSQL and SQLite).

Used instead of a SAVEPOINT around an insert that may collide: SQLAlchemy dispatches ``after_commit``
when a SAVEPOINT is released, which would send the tasks a transaction recorded before its real
commit (``infra/dispatch.py``). On PostgreSQL a colliding insert still waits for the transaction
holding the other row to end, so the primary key decides between two racing callers.
"""

from __future__ import annotations

from sqlalchemy.dialects import postgresql, sqlite
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
