"""Statements marked ``storage.db.server_prepared`` on real PostgreSQL: prepared once per connection,
then executed with their parameters; results read as usual (types included); a statement the
server cannot prepare runs as it is on an autocommit connection; unmarked statements are untouched."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import Integer, bindparam, cast, event, literal, literal_column, select, text
from sqlalchemy.dialects.postgresql import JSONB

from domain.tenancy.tenants import create_tenant
from storage.db import get_engine, get_lease_engine, server_prepared
from storage.models import Job
from storage.types import table_of, utcnow

pytestmark = pytest.mark.worker

_JOBS = table_of(Job)
#: One statement object, as the platform keeps its hot statements: typed parameters, a repeated one,
#: a literal percent sign, typed results (UUID, timestamp, JSON).
_STATEMENT = server_prepared(
    select(
        cast(bindparam("id", type_=_JOBS.c.id.type), _JOBS.c.id.type).label("id"),
        cast(bindparam("at", type_=_JOBS.c.updated_at.type), _JOBS.c.updated_at.type).label("at"),
        cast(bindparam("result", type_=_JOBS.c.result.type), _JOBS.c.result.type).label("result"),
        (cast(bindparam("n"), Integer) + cast(bindparam("n"), Integer)).label("twice"),
        literal_column("'100%'").label("percent"),
    )
)


def _prepared_names(connection) -> list[str]:
    return list(connection.execute(text("SELECT name FROM pg_prepared_statements ORDER BY name")).scalars())


def _sent(engine) -> tuple[list[str], object]:
    sent: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        sent.append(statement)

    event.listen(engine, "after_cursor_execute", record)
    return sent, lambda: event.remove(engine, "after_cursor_execute", record)


def test_a_marked_statement_is_prepared_once_per_connection_and_reads_as_usual(database):
    job_id, at = uuid.uuid4(), dt.datetime(2026, 11, 27, 3, 0, tzinfo=dt.UTC)
    engine = get_lease_engine()
    assert engine is not None
    engine.dispose()  # a new connection: nothing prepared on it yet
    sent, stop = _sent(engine)
    try:
        with engine.connect() as connection:
            rows = [
                connection.execute(_STATEMENT, {"id": job_id, "at": at, "result": {"k": [n]}, "n": n}).one()
                for n in (1, 2, 3)
            ]
            names = _prepared_names(connection)
    finally:
        stop()
    assert [tuple(row) for row in rows] == [(job_id, at, {"k": [n]}, 2 * n, "100%") for n in (1, 2, 3)]
    assert isinstance(rows[0].id, uuid.UUID) and rows[0].at.tzinfo is not None
    assert len(names) == 1  # prepared once on this connection
    assert [statement.split(" ", 2)[:2] for statement in sent if "tessera_" in statement] == [["EXECUTE", names[0]]] * 3


def test_a_statement_the_server_cannot_prepare_runs_as_it_is(database):
    """A parameter whose type the server cannot tell without its value: on an autocommit connection
    the statement runs unprepared (and is not tried again on that connection)."""
    untyped = server_prepared(select((bindparam("a") + bindparam("a")).label("x")))  # unknown + unknown
    engine = get_lease_engine()
    assert engine is not None
    with engine.connect() as connection:
        before = _prepared_names(connection)
        assert [connection.execute(untyped, {"a": n}).scalar_one() for n in (1, 2)] == [2, 4]
        assert _prepared_names(connection) == before


def test_unmarked_statements_and_transactions_are_untouched(database):
    plain = select(literal(1, JSONB).label("one"))
    get_engine().dispose()  # a new connection: nothing prepared on it yet
    with get_engine().connect() as connection:
        assert connection.execute(plain).scalar_one() == 1
        assert _prepared_names(connection) == []
        connection.rollback()
        with connection.begin():
            assert connection.execute(_STATEMENT, {"id": uuid.uuid4(), "at": None, "result": None, "n": 1}).one()
        assert len(_prepared_names(connection)) == 1  # a marked statement in a transaction is prepared too


def test_the_rows_of_a_unit_are_inserted_by_a_prepared_statement(database):
    """``insert_rows``' one statement (positional parameters: a JSON document per table) is prepared
    once per connection; its rows are stored as before."""
    from storage.db import Rows, insert_rows, session_scope
    from storage.models import AuditLog

    logs = table_of(AuditLog)
    with session_scope() as session:
        tenant_id = create_tenant(
            session, name="prepared", owner_email=f"o-{uuid.uuid4().hex[:8]}@example.com"
        ).tenant_id
    get_engine().dispose()  # a new connection: nothing prepared on it yet

    def one_row(message: str) -> None:
        with session_scope() as session:
            rows = Rows()
            row = {"id": uuid.uuid4(), "tenant_id": tenant_id, "actor_type": "system", "entity_type": "test"}
            rows.add(logs, {**row, "entity_id": "e", "operation": "create", "message": message, "created_at": utcnow()})
            insert_rows(session, rows)

    sent, stop = _sent(get_engine())
    try:
        one_row("100% first")
        one_row("second")
    finally:
        stop()
    inserts = [statement for statement in sent if statement.startswith(("PREPARE", "EXECUTE"))]
    assert [statement.split(" ")[0] for statement in inserts] == ["EXECUTE", "EXECUTE"]
    with get_engine().connect() as connection:
        stored = connection.execute(select(logs.c.message).where(logs.c.entity_type == "test")).scalars().all()
    assert sorted(stored) == ["100% first", "second"]
