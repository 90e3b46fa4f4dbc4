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
from storage.db import get_autocommit_engine, get_engine, server_prepared
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
    engine = get_autocommit_engine()
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


@pytest.mark.parametrize("autocommit", [False, True], ids=["engine", "autocommit-engine"])
def test_a_prepared_statement_runs_on_its_generic_plan_from_its_first_run(database, autocommit):
    """``plan_cache_mode = force_generic_plan`` on every connection of both engines: no run of a
    prepared statement is planned for its values (``pg_prepared_statements`` counts the plans).
    Both engines' sessions commit as the server's setting says (durably here)."""
    engine = get_autocommit_engine() if autocommit else get_engine()
    assert engine is not None
    engine.dispose()  # a new connection: nothing prepared on it yet
    with engine.connect() as connection:
        for n in (1, 2, 3):
            connection.execute(_STATEMENT, {"id": uuid.uuid4(), "at": utcnow(), "result": {}, "n": n}).one()
        plans = connection.execute(
            text("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%100%%'")
        ).one()
        settings = connection.execute(
            text("SELECT current_setting('plan_cache_mode'), current_setting('synchronous_commit')")
        ).one()
    assert tuple(plans) == (3, 0)
    assert tuple(settings) == ("force_generic_plan", "on")


def test_a_statement_the_server_cannot_prepare_runs_as_it_is(database):
    """A parameter whose type the server cannot tell without its value: on an autocommit connection
    the statement runs unprepared (and is not tried again on that connection)."""
    untyped = server_prepared(select((bindparam("a") + bindparam("a")).label("x")))  # unknown + unknown
    engine = get_autocommit_engine()
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


def test_a_statement_built_once_is_compiled_once_and_found_by_identity(database, monkeypatch):
    """A marked statement's compiled form is kept by the engine's ``BuiltOnceCache`` under its own
    identity: the engine's LRU cache (which hashes a whole cache key) never sees it; an unmarked
    statement, built per call, still goes there; each is compiled once."""
    from storage import db

    engine = get_autocommit_engine()
    assert engine is not None
    cache = engine.get_execution_options()["compiled_cache"]
    assert isinstance(cache, db.BuiltOnceCache)
    compiled = []
    compile_element = type(_STATEMENT)._compiler

    def counting(self, dialect, **kw):
        compiled.append(self)
        return compile_element(self, dialect, **kw)

    marked = server_prepared(select(cast(bindparam("n", type_=Integer), Integer).label("n")))
    monkeypatch.setattr(type(marked), "_compiler", counting)
    hashed = []

    class Looked(dict):  # the engine's cache, each lookup noted
        def get(self, key, default=None):
            hashed.append(key[1])
            return super().get(key, default)

    monkeypatch.setattr(cache, "_fallback", Looked())
    with engine.connect() as connection:
        assert [connection.execute(marked, {"n": n}).scalar_one() for n in (1, 2, 3)] == [1, 2, 3]
        assert compiled == [marked]  # compiled at the first run only
        assert hashed == []  # never looked up in the engine's own cache
        plains = []
        for n in (4, 5):  # a statement built per call: the engine's cache, compiled once too
            plains.append(select(cast(bindparam("n", type_=Integer), Integer).label("m")))
            assert connection.execute(plains[-1], {"n": n}).scalar_one() == n
    assert len(hashed) == 2
    assert compiled == [marked, plains[0]]


def test_a_row_is_made_with_the_defaults_a_model_gives_without_an_instance():
    """``model_row``: the constructor's Python-side defaults (values and factories), the given values
    as they are, every column in table order; a column without a default must be given."""
    from storage.db import model_row
    from storage.models_agentic import PaymentMethodRail

    now = utcnow()
    values = {"tenant_id": uuid.uuid4(), "payment_method_id": "pm_1", "rail": "spt", "provider": "psp"}
    values.update(created_at=now, updated_at=now)
    built = PaymentMethodRail(**values)
    row = model_row(PaymentMethodRail, **values)
    columns = [column.name for column in table_of(PaymentMethodRail).columns]
    assert list(row) == columns
    assert {name: row[name] for name in columns if name != "id"} == {
        name: getattr(built, name) for name in columns if name != "id"
    }
    assert isinstance(row["id"], uuid.UUID) and row["id"] != model_row(PaymentMethodRail, **values)["id"]
    assert row["provider_ids"] == {}
    assert row["provider_ids"] is not model_row(PaymentMethodRail, **values)["provider_ids"]  # a factory's
    with pytest.raises(TypeError, match="no column 'nope'"):
        model_row(PaymentMethodRail, nope=1, **values)
    with pytest.raises(TypeError, match="payment_method_id has no default"):
        model_row(PaymentMethodRail, **{k: v for k, v in values.items() if k != "payment_method_id"})


def test_a_row_instance_holds_the_row_as_the_orm_loads_it(database):
    """``row_instance``: the job a lease returns (its ``RETURNING`` row) has every field the ORM
    loads for the same row, with the same types, and belongs to no session; the job ``record``
    describes when its row goes out with the caller's rows holds that row."""
    from sqlalchemy import inspect as orm_state
    from sqlmodel import Session

    from infra import jobs
    from storage.db import Rows, session_scope

    name = f"row-{uuid.uuid4().hex[:8]}"
    with session_scope() as session:
        tenant = create_tenant(session, name=name, owner_email=f"{name}@example.com")
        stored = Job(kind="test.row_instance", tenant_id=tenant.tenant_id, subject_type="test", subject_id="s")
        session.add(stored)  # no message: nothing runs it but the lease below
    leased = jobs.lease(stored.id, "owner-1", lease_seconds=30)
    assert leased is not None
    job, inputs = leased
    assert inputs == {} and orm_state(job).transient
    columns = [column.name for column in _JOBS.columns]
    with Session(get_engine()) as session:
        loaded = session.get(Job, stored.id)
        assert loaded is not None
        assert {name: getattr(job, name) for name in columns} == {name: getattr(loaded, name) for name in columns}
        assert {name: type(getattr(job, name)) for name in columns} == {
            name: type(getattr(loaded, name)) for name in columns
        }
    assert job.status == "running" and job.lease_owner == "owner-1" and job.attempts == 1

    rows = Rows()
    with Session(get_engine()) as session:  # closed without a commit: the job's message is dropped
        described = jobs.record(
            session,
            rows=rows,
            kind="test.row_instance",
            tenant_id=None,
            subject_type="test",
            subject_id="t",
            trace_id=None,
        )
        assert not session.new
    [row] = next(iter(rows.tables.values()))
    assert {name: getattr(described, name) for name in columns} == row and orm_state(described).transient


def test_a_lazy_session_is_made_only_when_used_and_ends_as_a_session_scope_does(database, monkeypatch):
    """``lazy_session``: a block that runs no statement makes no session at all; one that does gets
    a real session, committed when the block ends; one that raises has its writes rolled back."""
    from sqlmodel import Session

    from storage import db
    from storage.db import lazy_session, session_scope

    made = []
    real_session = db.Session

    def counted(*args, **kwargs):
        made.append(args)
        return real_session(*args, **kwargs)

    monkeypatch.setattr(db, "Session", counted)
    with lazy_session() as session:
        assert not isinstance(session, Session)
    assert made == []

    name = f"lazy-{uuid.uuid4().hex[:8]}"
    with lazy_session() as session:
        tenant = create_tenant(session, name=name, owner_email=f"{name}@example.com")
    assert len(made) == 1
    with session_scope() as session:
        assert (
            session.execute(text("select name from tenants where id = :id"), {"id": tenant.tenant_id}).scalar() == name
        )

    with pytest.raises(RuntimeError), lazy_session() as session:
        session.execute(text("update tenants set name = 'renamed' where id = :id"), {"id": tenant.tenant_id})
        raise RuntimeError("the block failed")
    with session_scope() as session:
        assert (
            session.execute(text("select name from tenants where id = :id"), {"id": tenant.tenant_id}).scalar() == name
        )


def test_a_row_instance_made_before_any_query_of_its_process_reads_its_fields():
    """A fresh process (a worker's first lease returns its job before the ORM ran any query) gets a
    job whose fields read: ``row_instance`` configures the mappers first, as a query would."""
    import subprocess
    import sys

    script = (
        "import uuid\n"
        "from storage.db import row_instance\n"
        "from storage.models import Job\n"
        "job_id = uuid.uuid4()\n"
        "job = row_instance(Job, {'id': job_id, 'kind': 'k'})\n"
        "assert (job.id, job.kind) == (job_id, 'k')\n"
        "print('read')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "read"), done.stderr
