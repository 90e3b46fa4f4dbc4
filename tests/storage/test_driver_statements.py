"""Statements run on the driver's cursor (``storage.driver``) on real PostgreSQL: the same rows, types
and errors as through SQLAlchemy; prepared once per connection; a connection the server closed is
replaced (and a lease-like statement runs once more); a joint transaction writes all or nothing;
SQLAlchemy's path is kept while something listens to the engine's statements."""

from __future__ import annotations

import datetime as dt
import uuid

import psycopg2
import pytest
from sqlalchemy import Integer, bindparam, event, insert, literal_column, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from config.settings import get_settings, reload_settings
from domain.tenancy.tenants import create_tenant
from storage import db, driver
from storage.db import (
    Rows,
    execute_durable,
    execute_durable_together,
    execute_once_more_on_disconnect,
    get_autocommit_engine,
    get_engine,
    read_all,
    read_first,
    reset_engine,
    server_prepared,
    session_scope,
    stage_inserts,
    stage_write,
)
from storage.models import Job
from storage.types import table_of
from tests.storage.test_server_prepared import _STATEMENT

pytestmark = pytest.mark.worker

_JOBS = table_of(Job)
_READ = _STATEMENT  # typed parameters, a repeated one, a literal percent sign, typed results
_SERIES = server_prepared(
    select(literal_column("n").label("n")).select_from(
        text("generate_series(1, :count) AS n").bindparams(bindparam("count", type_=Integer))
    )
)


def _tenant_id() -> uuid.UUID:
    name = f"driver-{uuid.uuid4().hex[:8]}"
    with session_scope() as session:
        return create_tenant(session, name=name, owner_email=f"{name}@example.com").tenant_id


def _job_insert():
    return server_prepared(
        insert(_JOBS)
        .values(
            id=bindparam("job_id", type_=_JOBS.c.id.type),
            tenant_id=bindparam("tenant_id", type_=_JOBS.c.tenant_id.type),
            kind="driver.test",
            subject_type="test",
            subject_id=bindparam("subject", type_=_JOBS.c.subject_id.type),
            status="succeeded",  # settled: no sweep or relay of the shared test database picks it up
            attempts=0,
            max_attempts=1,
            due_at=bindparam("at", type_=_JOBS.c.due_at.type),
            created_at=bindparam("at", type_=_JOBS.c.created_at.type),
            updated_at=bindparam("at", type_=_JOBS.c.updated_at.type),
        )
        .returning(_JOBS.c.id, _JOBS.c.created_at, _JOBS.c.result)
    )


_INSERT = _job_insert()


def _jobs_named(subject: str) -> int:
    with session_scope() as session:
        return len(session.execute(select(_JOBS.c.id).where(_JOBS.c.subject_id == subject)).all())


def _terminate_pooled(engine) -> None:
    """Close every pooled connection of ``engine`` from the server's side (as a database restart
    would), from a connection of its own."""
    with engine.connect() as connection:
        mine = connection.execute(text("SELECT pg_backend_pid()")).scalar()
        connection.commit()
    other = psycopg2.connect(get_engine().url.render_as_string(hide_password=False).replace("+psycopg2", ""))
    try:
        other.autocommit = True
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", (mine,))
    finally:
        other.close()


def test_the_driver_path_is_taken_and_reads_what_sqlalchemy_reads(database):
    engine = get_autocommit_engine()
    assert engine is not None and driver.runs_on_driver(engine, _READ)
    job_id, at = uuid.uuid4(), dt.datetime(2026, 11, 28, 21, 0, tzinfo=dt.UTC)
    params = {"id": job_id, "at": at, "result": {"k": [1, "two"]}, "n": 4}
    row = read_first(_READ, params)
    assert id(_READ) in driver._COMPILED  # compiled once for the driver: the path was taken
    with engine.connect() as connection:
        through_sqlalchemy = connection.execute(_READ, params).one()
    assert tuple(row) == tuple(through_sqlalchemy) == (job_id, at, {"k": [1, "two"]}, 8, "100%")
    assert isinstance(row.id, uuid.UUID) and row.at.tzinfo is not None and row._mapping["twice"] == 8
    mapping = execute_once_more_on_disconnect(engine, _READ, params)
    assert dict(mapping) == dict(through_sqlalchemy._mapping)
    assert [row.n for row in read_all(_SERIES, {"count": 3})] == [1, 2, 3]
    assert read_all(_SERIES, {"count": 0}) == []
    assert execute_once_more_on_disconnect(engine, _SERIES, {"count": 0}) is None
    assert execute_once_more_on_disconnect(engine, _SERIES, {"count": 2}, every_row=True) == [{"n": 1}, {"n": 2}]


def test_a_statement_is_prepared_once_per_connection(database):
    engine = get_autocommit_engine()
    assert engine is not None
    engine.dispose()  # a new connection: nothing prepared on it yet
    for n in (1, 2, 3):
        assert (
            read_first(_READ, {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": {}, "n": n}).twice == 2 * n
        )
    with driver.driver_cursor(engine) as (info, cursor):
        cursor.execute("SELECT name, statement FROM pg_prepared_statements")
        prepared = cursor.fetchall()
        assert len(info[driver._PREPARED_ON_CONNECTION]) == 1
    assert len(prepared) == 1 and prepared[0][0].startswith("tessera_")


def test_a_statement_the_server_cannot_prepare_runs_as_it_is_and_its_transaction_goes_on(database):
    untyped = server_prepared(text("SELECT :value IS NULL AS missing"))  # $1's type: unknown to PREPARE
    tenant_id, subject = _tenant_id(), f"driver-{uuid.uuid4()}"
    at = dt.datetime(2026, 11, 29, 3, 0, tzinfo=dt.UTC)
    get_engine().dispose()  # a new connection: the statement's first run there
    with session_scope() as session:
        session.execute(_INSERT, {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at})
        assert session.execute(untyped, {"value": "x"}).scalar_one() is False  # run unprepared, in the transaction
        assert session.execute(untyped, {"value": None}).scalar_one() is True  # not tried again
        session.execute(_INSERT, {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at})
        prepared = session.execute(text("SELECT statement FROM pg_prepared_statements")).scalars().all()
    assert _jobs_named(subject) == 2  # the failed PREPARE cost the transaction nothing
    assert len(prepared) == 1 and "INSERT INTO jobs" in prepared[0]


def _two_jobs() -> tuple[uuid.UUID, str, uuid.UUID, uuid.UUID]:
    """Two jobs of a new tenant with a new subject, written; the engine's connections closed (no
    statement prepared on any). Returns the tenant's id, the subject and the jobs' ids."""
    tenant_id, subject = _tenant_id(), f"driver-{uuid.uuid4()}"
    at = dt.datetime(2026, 11, 29, 3, 5, tzinfo=dt.UTC)
    first, second = uuid.uuid4(), uuid.uuid4()
    for job_id in (first, second):
        execute_durable(_INSERT, {"job_id": job_id, "tenant_id": tenant_id, "subject": subject, "at": at})
    get_engine().dispose()
    return tenant_id, subject, first, second


def test_the_writes_staged_for_a_commit_are_one_statement_prepared_once_per_connection(database):
    _, subject, first, second = _two_jobs()
    for n in (1, 2, 3):
        with session_scope() as session:
            stage_write(session, update(_JOBS).where(_JOBS.c.id == first).values(result={"n": n}))
            stage_write(session, update(_JOBS).where(_JOBS.c.id == second).values(result={"n": -n}))
    with session_scope() as session:
        prepared = (
            session.execute(text("SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%%staged_0%%'"))
            .scalars()
            .all()
        )
        results = dict(session.execute(select(_JOBS.c.id, _JOBS.c.result).where(_JOBS.c.subject_id == subject)).all())
    assert len(prepared) == 1  # planned once on the connection, run three times
    assert results == {first: {"n": 3}, second: {"n": -3}}


_STAGED_RESULT = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("staged_id", type_=_JOBS.c.id.type))
    .values(result=bindparam("staged_result", type_=_JOBS.c.result.type))
)
_STAGED_ERROR = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("staged_other_id", type_=_JOBS.c.id.type))
    .values(last_error=bindparam("staged_error", type_=_JOBS.c.last_error.type))
)


def test_writes_staged_with_their_values_and_rows_beside_them_are_one_statement_built_once(database):
    """Writes built once, their values given at staging (``stage_write(..., params)``), with rows
    staged beside them: one statement per transaction, the same statement object each time (built
    once per shape), prepared once on the connection; each transaction writes its own values."""
    from infra.jobs import new_row

    tenant_id, subject, first, second = _two_jobs()
    built = db._staged_statement.cache_info()
    added = []
    for n in (1, 2, 3):
        with session_scope() as session:
            rows = Rows()
            row = new_row(
                kind="driver.test", tenant_id=tenant_id, subject_type="test", subject_id=subject, trace_id=None
            )
            row["status"] = "succeeded"  # settled: no sweep or relay of the shared test database picks it up
            rows.add(_JOBS, row)
            added.append(row["id"])
            stage_inserts(session, rows)
            stage_write(session, _STAGED_RESULT, {"staged_id": first, "staged_result": {"n": n}})
            stage_write(session, _STAGED_ERROR, {"staged_other_id": second, "staged_error": f"error {n}"})
    after = db._staged_statement.cache_info()
    assert (after.misses - built.misses, after.hits - built.hits) == (1, 2)  # built once, used three times
    with session_scope() as session:
        prepared = (
            session.execute(text("SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%%staged_0%%'"))
            .scalars()
            .all()
        )
        found = {
            job_id: (result, error)
            for job_id, result, error in session.execute(
                select(_JOBS.c.id, _JOBS.c.result, _JOBS.c.last_error).where(_JOBS.c.subject_id == subject)
            ).all()
        }
    assert len(prepared) == 1  # planned once on the connection, run three times
    assert found[first][0] == {"n": 3} and found[second][1] == "error 3"
    assert set(added) <= set(found) and len(found) == 5


def test_past_the_most_prepared_statements_a_new_one_runs_as_it_is(database, monkeypatch):
    monkeypatch.setattr(driver, "MOST_PREPARED", 1)
    engine = get_autocommit_engine()
    assert engine is not None
    engine.dispose()
    assert read_first(_READ, {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": {}, "n": 2}).twice == 4
    assert read_all(_SERIES, {"count": 3}) == [(1,), (2,), (3,)]  # the second statement: sent as it is
    with driver.driver_cursor(engine) as (info, cursor):
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone()[0] == 1
        assert len(info[driver._PREPARED_ON_CONNECTION]) == 1


@pytest.fixture
def unprepared(database, monkeypatch):
    """The settings with ``db_prepared_statements`` off (as behind a transaction pooler), new engines."""
    monkeypatch.setenv("TESSERA_DB_PREPARED_STATEMENTS", "false")
    reload_settings()
    reset_engine()
    yield
    monkeypatch.delenv("TESSERA_DB_PREPARED_STATEMENTS")
    reload_settings()
    reset_engine()


def test_with_prepared_statements_off_the_statement_is_sent_as_it_is(unprepared):
    assert not get_settings().db_prepared_statements
    engine = get_autocommit_engine()
    assert engine is not None and driver.runs_on_driver(engine, _READ)
    assert read_first(_READ, {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": None, "n": 1}).twice == 2
    with driver.driver_cursor(engine) as (info, cursor):
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone()[0] == 0
        assert driver._PREPARED_ON_CONNECTION not in info


def test_a_durable_write_commits_and_its_errors_are_sqlalchemys(database):
    tenant_id, subject = _tenant_id(), f"driver-{uuid.uuid4()}"
    job_id, at = uuid.uuid4(), dt.datetime(2026, 11, 28, 21, 30, tzinfo=dt.UTC)
    params = {"job_id": job_id, "tenant_id": tenant_id, "subject": subject, "at": at}
    row = execute_durable(_INSERT, params)
    assert tuple(row) == (job_id, at, None)
    assert _jobs_named(subject) == 1  # committed: another connection sees it
    with pytest.raises(IntegrityError) as raised:
        execute_durable(_INSERT, params)  # the same id again
    assert subject not in str(raised.value)  # the query, its values interpolated, is not in the error
    # the connection went back to the pool usable: the next write on it works
    assert execute_durable(_INSERT, {**params, "job_id": uuid.uuid4()}) is not None
    assert _jobs_named(subject) == 2


def test_a_joint_transaction_writes_all_or_nothing(database):
    tenant_id, subject = _tenant_id(), f"driver-{uuid.uuid4()}"
    at = dt.datetime(2026, 11, 28, 21, 45, tzinfo=dt.UTC)
    first = {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at}
    second = {**first, "job_id": uuid.uuid4()}
    rows = execute_durable_together([(_INSERT, first), (_INSERT, second)])
    assert [row.id for row in rows] == [first["job_id"], second["job_id"]]
    assert _jobs_named(subject) == 2
    third = {**first, "job_id": uuid.uuid4()}
    with pytest.raises(IntegrityError):
        execute_durable_together([(_INSERT, third), (_INSERT, first)])  # the second fails: the first is undone
    assert _jobs_named(subject) == 2
    with get_engine().connect() as connection:  # nothing left open on the pooled connections
        idle = connection.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND pid <> pg_backend_pid()"
            )
        ).scalar()
    assert idle == 0


def test_a_connection_closed_by_the_server_is_replaced(database):
    engine = get_autocommit_engine()
    assert engine is not None
    engine.dispose()
    params = {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": {}, "n": 5}
    assert read_first(_READ, params).twice == 10  # one pooled connection, with the statement prepared
    _terminate_pooled(engine)
    # a read or a lease runs once more on a fresh connection
    assert execute_once_more_on_disconnect(engine, _READ, params)["twice"] == 10
    engine.dispose()  # durable writes run on the same engine's connections
    tenant_id, subject = _tenant_id(), f"driver-{uuid.uuid4()}"
    at = dt.datetime.now(dt.UTC)
    assert execute_durable(_INSERT, {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at})
    _terminate_pooled(engine)
    # a durable write is not sent again (whether it committed would be unknown): the error says why
    with pytest.raises(DBAPIError) as raised:
        execute_durable(_INSERT, {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at})
    assert raised.value.connection_invalidated
    assert execute_durable(_INSERT, {"job_id": uuid.uuid4(), "tenant_id": tenant_id, "subject": subject, "at": at})
    assert _jobs_named(subject) == 2


def test_while_something_listens_to_the_engine_sqlalchemy_runs_the_statements(database):
    engine = get_autocommit_engine()
    assert engine is not None
    sent: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        sent.append(statement)

    event.listen(engine, "after_cursor_execute", record)
    try:
        assert not driver.runs_on_driver(engine, _READ)
        assert read_first(_READ, {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": {}, "n": 1}).twice == 2
    finally:
        event.remove(engine, "after_cursor_execute", record)
    assert len(sent) == 1  # seen by the listener: it went through SQLAlchemy
    assert driver.runs_on_driver(engine, _READ)


def test_a_statement_whose_text_depends_on_its_values_runs_through_sqlalchemy(database):
    expanding = server_prepared(
        select(literal_column("n").label("n"))
        .select_from(text("generate_series(1, 5) AS n"))
        .where(literal_column("n").in_(bindparam("wanted", expanding=True)))
    )
    engine = get_autocommit_engine()
    assert engine is not None
    assert driver.driver_statement(expanding, engine.dialect, prepared=True) is None
    assert [row.n for row in read_all(expanding, {"wanted": [2, 4]})] == [2, 4]
    assert [row.n for row in read_all(expanding, {"wanted": [1, 3, 5]})] == [1, 3, 5]


@pytest.mark.parametrize("first", ["autocommit", "sessions"])
def test_a_connection_found_closed_on_one_engine_renews_the_other(database, first):
    """A database restart closes the connections of both engines: the first one found closed, on
    either, renews the other's pool, so its next statement meets a fresh connection."""
    autocommit = get_autocommit_engine()
    assert autocommit is not None
    sessions = get_engine()
    for engine in (autocommit, sessions):
        engine.dispose()
        _terminate_pooled(engine)  # each pool now holds one connection the server closed
    params = {"id": uuid.uuid4(), "at": dt.datetime.now(dt.UTC), "result": {}, "n": 4}
    if first == "autocommit":
        assert execute_once_more_on_disconnect(autocommit, _READ, params)["twice"] == 8  # found, run again
        with session_scope() as session:
            assert session.execute(text("SELECT 1")).scalar() == 1
    else:
        with pytest.raises(DBAPIError), session_scope() as session:
            session.execute(text("SELECT 1"))  # found closed: this unit fails, as before
        assert execute_durable(_READ, params).twice == 8  # never run twice: it met a renewed pool
