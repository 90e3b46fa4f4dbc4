"""The database engine and the session factory.

One engine per process, made on first use from the settings. A unit of work is::

    with session_scope() as session:
        ...  # commits on success, rolls back on any exception

SQLite (the embedded default) runs in WAL mode with a busy timeout so the api, the worker and beat
can share the file.

The one-statement paths of the jobs (:func:`execute_once_more_on_disconnect`, :func:`execute_durable`,
:func:`execute_durable_together`, :func:`read_first`, :func:`read_all`, :func:`insert_rows_last`) run
a statement built once (:func:`server_prepared`) on the driver's cursor on PostgreSQL, without
SQLAlchemy's execution (:mod:`storage.driver`), with the same rows and errors; through SQLAlchemy
elsewhere, and while something listens to the engine's statements.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import decimal
import functools
import io
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Executor
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
from sqlalchemy import JSON, LargeBinary, Table, create_engine, event, insert, inspect, literal_column, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, CursorResult, Engine, Result
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import configure_mappers
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.dml import UpdateBase
from sqlalchemy.sql.elements import ColumnElement, TextClause
from sqlmodel import Session, SQLModel

from config.settings import get_settings
from storage import driver
from storage.driver import SERVER_PREPARED
from storage.types import table_of

log = logging.getLogger("tessera.db")

T = TypeVar("T")
ExecutableT = TypeVar("ExecutableT", bound=Executable)


def _pool_options(pool_size: int) -> dict[str, Any]:
    """The connection pool of a PostgreSQL engine: ``pool_size`` kept, as many more at a peak, each
    replaced after an hour, and handed out last in, first out. LIFO keeps the work on as few
    connections as the concurrency needs while the others idle: a server backend fills its catalog
    caches and plans each prepared statement on its first runs. Measured before prepared statements
    ran on their generic plan from the first run (:func:`_connect_args`): a rail outcome's first run
    on a connection took a median 11-22 ms, its second to sixth 3-9 ms, later ones 2.6-3.0 ms (a
    sibling's lock wait included); in the payment-method benchmark at one client (2,200 rail
    outcomes), handed out in turn (FIFO) they went to 39 connections, LIFO to 19: a mean of 5.2
    against 4.2 ms; the lease's median 0.83 against 0.59."""
    return {"pool_size": pool_size, "max_overflow": pool_size, "pool_recycle": 3600, "pool_use_lifo": True}


def _connect_args(**server: str) -> dict[str, Any]:
    """The driver's connect arguments that give each new server session the settings ``server``
    (name -> value), plus ``plan_cache_mode = force_generic_plan`` where statements are
    server-prepared (``db_prepared_statements``): a prepared statement is then planned once per
    connection, for any values. Left to itself the server plans each of a statement's first five
    runs for their values, then compares, so a statement a connection runs seldom is planned
    nearly every time: a rail's lease with its reads, 2 ms of planning for 0.7 ms of running, on
    each of the first six runs (one in three of a benchmark's rail retries). The statements
    prepared are built once with bind parameters and find their rows by key or by a partial index
    (``infra.fairness``): a plan for given values would be the same plan. Statements that are not
    prepared are planned for their values as before."""
    if get_settings().db_prepared_statements:
        server = {"plan_cache_mode": "force_generic_plan", **server}
    return {"options": " ".join(f"-c {name}={value}" for name, value in server.items())} if server else {}


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """Create an engine for ``url`` with the platform's connection settings.

    SQLite URLs get their parent folder created, WAL journaling and a 30 s busy timeout.
    """
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record):  # pragma: no cover - trivial
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    # No pre-ping: a SELECT 1 on every checkout is a round trip per unit of work. A connection the
    # server closed fails its one statement instead; SQLAlchemy then invalidates every pooled
    # connection older than it, so one request answers 500 after a database restart, not each.
    return _with_server_prepared(create_engine(url, **_pool_options(pool_size), connect_args=_connect_args()))


_PREPARED_OPTIONS = {SERVER_PREPARED: True}


def server_prepared(statement: T) -> T:
    """``statement`` marked to run as a server-side prepared statement on PostgreSQL: ``PREPARE`` on a
    connection's first run of it, then ``EXECUTE`` with its parameters, so the server plans it once
    per connection rather than on every run (a job's lease or outcome statement, with its CTEs and
    subqueries, spends more time being planned than being run; the one statement of
    :func:`insert_rows`, too). Only where the setting
    ``db_prepared_statements`` is on (off behind a pooler that does not keep a session's prepared
    statements); the results are read as usual. Elsewhere, and on SQLite, it runs as it is.

    Only for a statement built once per process (at import or behind ``functools.cache``), its values
    in bind parameters: its compiled form is then found by the identity of its cache key
    (:class:`BuiltOnceCache`), not by hashing the whole key on every run."""
    marked = cast(Any, statement).execution_options(**{SERVER_PREPARED: True})
    _BUILT_ONCE_KEYS.add(marked)
    return marked


class BuiltOnceCache(MutableMapping[Any, Any]):
    """SQLAlchemy's compiled cache for an engine (its ``compiled_cache`` execution option) that finds
    the statements built once per process (:func:`server_prepared`) by identity: the engine's own
    LRU cache hashes a statement's whole cache key, a nested tuple of its every clause, on every run
    (15 us for a rail outcome's statement, under the interpreter lock), where a statement built once
    keeps the one key it memoized. Any other statement goes to the engine's cache, ``fallback``.
    Thread-safe as a dict is (two threads compiling a statement at once each store a compiled form,
    both alike)."""

    def __init__(self, fallback: MutableMapping[Any, Any] | None) -> None:
        self._fallback: MutableMapping[Any, Any] = fallback if fallback is not None else {}
        self._entries: dict[tuple, tuple[Any, Any]] = {}

    @staticmethod
    def _identity(key: tuple) -> tuple | None:
        dialect, cache_key, *rest = key
        if id(cache_key) not in _BUILT_ONCE_KEYS.ids:
            return None
        return (id(dialect), id(cache_key), *rest)

    def get(self, key: tuple, default: Any = None) -> Any:
        """The compiled form stored under SQLAlchemy's ``key`` ``(dialect, cache key, column keys,
        schema translated, executemany)``, or ``default``."""
        identity = self._identity(key)
        if identity is None:
            return self._fallback.get(key, default)
        entry = self._entries.get(identity)  # keeps its dialect alive: that id names no other object
        return default if entry is None else entry[1]

    def __setitem__(self, key: tuple, compiled: Any) -> None:
        identity = self._identity(key)
        if identity is None:
            self._fallback[key] = compiled
        else:
            self._entries[identity] = (key[0], compiled)

    def __getitem__(self, key: tuple) -> Any:
        found = self.get(key, _MISSING)
        if found is _MISSING:
            raise KeyError(key)
        return found

    def __delitem__(self, key: tuple) -> None:
        identity = self._identity(key)
        if identity is None:
            del self._fallback[key]
        else:
            del self._entries[identity]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._fallback)

    def __len__(self) -> int:
        return len(self._entries) + len(self._fallback)

    def clear(self) -> None:
        """Forget every compiled form (``Engine.clear_compiled_cache``)."""
        self._entries.clear()
        self._fallback.clear()


_MISSING = object()


class _BuiltOnceKeys:
    """The cache keys of the statements :func:`server_prepared` marked, kept alive (so their ids are
    never reused) and known by id; at most :data:`MAX_BUILT_ONCE` (a caller building its statement
    per call would otherwise grow them without end: past the bound, statements are cached by the
    engine's LRU cache as usual)."""

    def __init__(self) -> None:
        self._keys: list[Any] = []
        self.ids: set[int] = set()

    def add(self, statement: Any) -> None:
        if len(self._keys) >= MAX_BUILT_ONCE:
            return
        cache_key = statement._generate_cache_key()  # memoized: the key each run of it finds
        if cache_key is not None:
            self._keys.append(cache_key.key)
            self.ids.add(id(cache_key.key))


#: The most statements a process finds by identity (:class:`BuiltOnceCache`); a process builds a few
#: dozen.
MAX_BUILT_ONCE = 1_000


_BUILT_ONCE_KEYS = _BuiltOnceKeys()


def in_constants(column: ColumnElement[Any], values: Iterable[str]) -> ColumnElement[bool]:
    """``column IN ('a', 'b')`` with ``values`` written into the SQL text as string literals, not bound:
    for the constants of a statement that looks for rows by them (the takeable statuses and the job
    kinds of a probe for waiting jobs). A prepared statement (:func:`server_prepared`) is run on a
    generic plan after its first five runs, and a generic plan cannot tell that ``status IN ($1, $2)``
    is the predicate of a partial index (``ix_jobs_takeable``), so it scans every index entry of all
    statuses, dead row versions included: measured 1.7-4.6 ms a lease's probes on a busy jobs table
    instead of 0.06 ms. Not for a statement that finds its rows by their key and only checks such a
    constant: there the literals let a generic plan prefer the partial index to the primary key, and
    walk all it holds. The text is built here once, so nothing is rendered per run. ``values`` must be
    constants of the code, never input (standard SQL quoting, ``'`` doubled, which PostgreSQL and
    SQLite read alike)."""
    quoted = [literal_column("'" + str(value).replace("'", "''") + "'", type_=column.type) for value in values]
    return column.in_(quoted)


def _with_server_prepared(engine: Engine) -> Engine:
    """Install :func:`storage.driver.execute_prepared` on a PostgreSQL ``engine`` when the setting allows; the
    engine's statements compiled through a :class:`BuiltOnceCache` either way (the engine returned
    shares ``engine``'s pool and events)."""
    if get_settings().db_prepared_statements:
        event.listen(engine, "before_cursor_execute", driver.execute_prepared, retval=True)
    return engine.execution_options(compiled_cache=BuiltOnceCache(engine._compiled_cache))


@functools.cache
def get_engine() -> Engine:
    """The process's engine for the configured database (its sessions' pool)."""
    settings = get_settings()
    return _renewing_the_other(make_engine(settings.effective_database_url, pool_size=settings.db_pool_size))


def _renewing_the_other(engine: Engine) -> Engine:
    """``engine``, made to renew the pool of the process's other engine (:func:`get_engine`,
    :func:`get_autocommit_engine`) when one of its connections turns out closed by the server: both
    reach one server, so that is a restart (or a lost network) for every connection of both. The
    pool where it was seen replaces its own older connections (SQLAlchemy's invalidation); the other
    is replaced whole (``dispose(close=False)``: connections in use finish, and are dropped when they
    come back), so that its first statement after the restart does not meet a dead connection."""

    def invalidated(_dbapi_connection: Any, _record: Any, exception: BaseException | None) -> None:
        if exception is None:  # invalidated on purpose, not found dead
            return
        for cached in (get_engine, get_autocommit_engine):
            other = cached() if cached.cache_info().currsize else None
            if other is not None and other.pool is not engine.pool:
                other.dispose(close=False)

    event.listen(engine, "invalidate", invalidated)
    return engine


#: SQL that, sent before a statement in the statement's round trip (one implicit transaction), commits
#: it without waiting for the WAL flush: for writes whose loss in a database crash is harmless (a
#: job's lease: lost, the job is taken again with the same idempotency key), made durable by the next
#: durable commit of the same server anyway (the WAL is flushed in order).
UNFLUSHED = "SET LOCAL synchronous_commit TO off"


@functools.cache
def get_autocommit_engine() -> Engine | None:
    """The process's engine for statements that are transactions of their own (one round trip: no
    ``BEGIN``, no ``COMMIT``) or that send their own ``BEGIN`` and ``COMMIT`` on the driver's
    cursor: PostgreSQL only, the driver in autocommit mode on every connection of its pool (never
    switched, unlike a connection of :func:`get_engine` taken for such a statement, whose mode
    switches each let go of the interpreter lock and waited to take it back), no pre-ping (a
    connection the server closed fails its statement and invalidates the pool: the caller runs it
    once more where it may, see :func:`execute_once_more_on_disconnect`). Its commits wait for the WAL
    flush as the server's setting says, unless the statement is sent after :data:`UNFLUSHED`. None on
    SQLite: use :func:`session_scope`."""
    settings = get_settings()
    if not settings.effective_database_url.startswith("postgresql"):
        return None
    return _renewing_the_other(
        _with_server_prepared(
            create_engine(
                settings.effective_database_url,
                **_pool_options(settings.db_pool_size),
                isolation_level="AUTOCOMMIT",
                connect_args=_connect_args(),
            )
        )
    )


def _on_driver(engine: Engine, statement: Any) -> driver.DriverStatement | None:
    """``statement`` compiled to run on the driver of ``engine``'s connections (:mod:`storage.driver`),
    or None when it runs through SQLAlchemy."""
    if not driver.runs_on_driver(engine, statement):
        return None
    return driver.driver_statement(statement, engine.dialect, prepared=get_settings().db_prepared_statements)


def _driver_once_more_on_disconnect(engine: Engine, run: Callable[[dict, Any], T]) -> T:
    """``run(info, cursor)`` on a driver cursor of ``engine`` (:func:`storage.driver.driver_cursor`),
    as :func:`_once_more_on_disconnect` runs it."""

    def attempt() -> T:
        with driver.driver_cursor(engine) as (info, cursor):
            return run(info, cursor)

    return _twice_on_disconnect(attempt)


def _once_more_on_disconnect(engine: Engine, run: Callable[[Connection], T]) -> T:
    """``run(connection)`` on a connection of ``engine``; once more on a fresh connection when the
    first turned out to be closed by the server (SQLAlchemy then invalidates the pool)."""

    def attempt() -> T:
        with engine.connect() as connection:
            return run(connection)

    return _twice_on_disconnect(attempt)


def _twice_on_disconnect(attempt: Callable[[], T]) -> T:
    """``attempt()``, once more when it raised with its connection invalidated (closed by the server);
    any other error, or a second failure, is raised."""
    for number in (1, 2):
        try:
            return attempt()
        except DBAPIError as exc:
            if number == 2 or not exc.connection_invalidated:
                raise
            log.info("a pooled connection was closed by the server; running the statement again")
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def execute_once_more_on_disconnect(
    engine: Engine,
    statement,
    params: dict | None = None,
    *,
    every_row: bool = False,
    after: str | None = None,
    unflushed: bool = False,
):
    """Run ``statement`` on a connection of ``engine`` (an autocommit engine such as
    :func:`get_autocommit_engine`) and return its first row as a mapping (None without rows, or when
    the statement returns none); ``every_row``: the list of all its rows as mappings instead (empty
    when none). When the connection turns out to be closed by the server (a database
    restart), SQLAlchemy invalidates the pool and the statement runs once more on a fresh
    connection; any other error is raised. Only for statements that bear running twice (a lease:
    the second run takes nothing the first one took). ``params``: values of the statement's bind
    parameters. ``after``: a statement sent just before it, in the same round trip where the driver
    runs it (a :func:`gate_wait`: the statement then runs once the gate's holder committed).
    ``unflushed``: its commit does not wait for the WAL flush (:data:`UNFLUSHED`, sent first in its
    round trip) where the driver runs it; through SQLAlchemy (while statements are listened to) it
    is committed durably."""

    def rows(result: Result | None):
        if every_row:
            return result.mappings().all() if result is not None else []
        return result.mappings().first() if result is not None else None

    def run(connection: Connection):
        if after is not None:
            connection.exec_driver_sql(after)
        result = connection.execute(statement, params)
        return rows(result if result.returns_rows else None)

    compiled = _on_driver(engine, statement)
    if compiled is None:
        return _once_more_on_disconnect(engine, run)
    prefix = "; ".join(part for part in (UNFLUSHED if unflushed else None, after) if part) or None
    return _driver_once_more_on_disconnect(
        engine, lambda info, cursor: rows(driver.execute(info, cursor, compiled, params, prefix=prefix))
    )


def execute_durable(statement, params: dict | None = None, *, every_row: bool = False):
    """Run one writing ``statement`` (``params``: values of its bind parameters) as a transaction of
    its own, durable when it returns, in one round trip (no ``BEGIN``, no ``COMMIT``), and return its
    first row (None without rows), or with ``every_row`` the list of its rows.
    PostgreSQL only: raises :class:`NotImplementedError` elsewhere (check
    :func:`one_statement_transactions` first). Not run again after a lost connection: whether it
    committed is then unknown, so the error is raised. Runs on :func:`get_autocommit_engine`."""
    rows = _all if every_row else _first
    engine = get_autocommit_engine()
    if engine is None:
        raise NotImplementedError("one-statement transactions need PostgreSQL")
    compiled = _on_driver(engine, statement)
    if compiled is not None:
        with driver.driver_cursor(engine) as (info, cursor):
            return rows(driver.execute(info, cursor, compiled, params))
    with engine.connect() as connection:
        result = connection.execute(statement, params)
        return rows(result if result.returns_rows else None)


def read_one_snapshot(session: OrmSession) -> None:
    """Make every statement of ``session``'s transaction read the same snapshot (``REPEATABLE READ`` on
    PostgreSQL, whose default gives each statement its own): a read made of several statements, a
    row then its children, then sees them as of one moment, never a child already changed beside its
    parent not yet (a payment method's rail enabled beside the payment method's earlier
    ``updated_at``). Call before the transaction's first statement. Elsewhere nothing: a SQLite
    transaction reads one snapshot already."""
    if session.get_bind().dialect.name == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})


def execute_durable_together(statements: Sequence[tuple[Any, dict]]) -> list:
    """Run the writing ``statements`` (each ``(statement, values of its bind parameters)``), in order,
    as one transaction of the process's engine, durable when it returns (one commit, one WAL flush for
    all; on the driver's cursor ``BEGIN`` goes in the first statement's round trip), and return the
    first row of each (None for one without rows). Used where several outcomes would otherwise commit
    one after the other, each waiting for the previous one's lock (the rails of one payment method).
    Raises the driver's error when one fails: nothing is written (at the commit itself, a lost
    connection leaves it unknown whether all was). PostgreSQL only, as :func:`execute_durable`."""
    engine = get_autocommit_engine()
    if engine is None:
        raise NotImplementedError("durable statements need PostgreSQL")
    compiled = [_on_driver(engine, statement) for statement, _ in statements]
    if all(each is not None for each in compiled):
        firsts: list = []
        with driver.driver_cursor(engine) as (info, cursor):

            def write() -> None:  # BEGIN in the first statement's round trip
                for n, (each, (_, params)) in enumerate(zip(compiled, statements, strict=True)):
                    assert each is not None  # checked above
                    firsts.append(_first(driver.execute(info, cursor, each, params, prefix=None if n else "BEGIN")))

            _one_transaction(write, cursor.execute)
        return firsts
    with get_engine().begin() as connection:  # SQLAlchemy's BEGIN and COMMIT (an autocommit engine sends none)
        rows = []
        for statement, params in statements:
            result = connection.execute(statement, params)
            rows.append(result.first() if result.returns_rows else None)
    return rows


def one_statement_transactions() -> bool:
    """Whether :func:`execute_durable` runs here (the database is PostgreSQL)."""
    return get_autocommit_engine() is not None


def read_first(statement, params: dict | None = None):
    """The first row of the read-only ``statement`` (None without rows), read in one round trip
    outside any transaction: on PostgreSQL on an autocommit connection of the
    :func:`get_autocommit_engine` (no ``BEGIN``, no ``COMMIT``; a read sees what was committed when it
    runs, as the first statement of a transaction does), elsewhere in a :func:`session_scope`.
    ``params``: values of its bind parameters (a statement built once, :func:`server_prepared`)."""
    engine = get_autocommit_engine()
    if engine is None:
        with session_scope() as session:
            return session.execute(statement, params).first()
    compiled = _on_driver(engine, statement)
    if compiled is not None:
        return _driver_once_more_on_disconnect(
            engine, lambda info, cursor: _first(driver.execute(info, cursor, compiled, params))
        )
    return _once_more_on_disconnect(engine, lambda connection: connection.execute(statement, params).first())


def _first(result: Result | None):
    """The first row of ``result`` (None without one, or without a result)."""
    return result.first() if result is not None else None


def read_all(statement, params: dict | None = None) -> list:
    """Every row of the read-only ``statement``, read like :func:`read_first`: in one round trip
    outside any transaction (one snapshot: the rows agree with each other)."""
    engine = get_autocommit_engine()
    if engine is None:
        with session_scope() as session:
            return list(session.execute(statement, params).all())
    compiled = _on_driver(engine, statement)
    if compiled is not None:
        return _driver_once_more_on_disconnect(
            engine, lambda info, cursor: _all(driver.execute(info, cursor, compiled, params))
        )
    return _once_more_on_disconnect(engine, lambda connection: list(connection.execute(statement, params).all()))


def _all(result: Result | None) -> list:
    """Every row of ``result`` (empty without a result)."""
    return list(result.all()) if result is not None else []


def execute_unflushed(statement) -> None:
    """Run one writing ``statement`` on its own, committed without waiting for the WAL flush: on
    PostgreSQL on the :func:`get_autocommit_engine` after :data:`UNFLUSHED` (one round trip; run once
    more after a closed connection, so it must bear running twice, e.g. ``INSERT ... ON CONFLICT DO
    NOTHING``), elsewhere in a :func:`session_scope`. For writes of a job's slow step that its later
    durable commit (the outcome or the failure, later in the WAL, so flushing it flushes this too)
    makes durable: a job that never gets there runs again and writes it again."""
    engine = get_autocommit_engine()
    if engine is None:
        with session_scope() as session:
            session.execute(statement)
        return
    execute_once_more_on_disconnect(engine, statement, unflushed=True)


def insert_rows_unflushed(rows: Rows) -> None:
    """:func:`insert_rows` outside any transaction, each table committed without waiting for the WAL
    flush (:func:`execute_unflushed`: so each must bear running twice, e.g. a table queued with
    ``ignore_conflicts``): one ``INSERT`` per table, or on PostgreSQL, for a table of at least
    :data:`COPY_MIN_ROWS` rows, its ``COPY`` (:func:`insert_rows`) in a transaction of its own on a
    connection of the :func:`get_autocommit_engine`, run once more after a closed connection."""
    engine = get_autocommit_engine()
    dialect_name = (engine or get_engine()).dialect.name
    for (table, ignore), batch in rows.tables.items():
        if not batch:
            continue
        if engine is not None and len(batch) >= COPY_MIN_ROWS:
            _once_more_on_disconnect(engine, functools.partial(_copy_in_transaction, table, ignore, batch))
            continue
        execute_unflushed(insert_statement(dialect_name, table, ignore_conflicts=ignore).values(batch))


def _copy_in_transaction(table: Table, ignore: bool, batch: list[dict], connection: Connection) -> None:
    """:func:`_pg_copy` on ``connection`` (of the :func:`get_autocommit_engine`) in a transaction of its
    own, so a table copied through a temporary one is written whole or not at all; committed without
    waiting for the WAL flush (:data:`UNFLUSHED`), as :func:`insert_rows_unflushed` says."""
    connection = connection.execution_options(isolation_level="READ COMMITTED")
    with connection.begin():
        connection.exec_driver_sql(UNFLUSHED)
        _pg_copy(connection, table, ignore, batch)


def reset_engine() -> None:
    """Dispose of the process's engines (after a fork, or when tests change the settings)."""
    for cached in (get_engine, get_autocommit_engine):
        engine = cached() if cached.cache_info().currsize else None
        if engine is not None:
            engine.dispose()
        cached.cache_clear()


@contextlib.contextmanager
def session_scope() -> Iterator[Session]:
    """A session whose transaction commits when the block ends and rolls back on an exception."""
    session = Session(get_engine(), expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


class _LazySession:
    """A stand-in for the :class:`Session` of :func:`lazy_session`: a :func:`session_scope` entered
    into ``scopes`` on first use."""

    __slots__ = ("made", "scopes")

    def __init__(self, scopes: contextlib.ExitStack) -> None:
        self.scopes = scopes
        self.made: Session | None = None

    def __getattr__(self, name: str) -> Any:
        if self.made is None:
            self.made = self.scopes.enter_context(session_scope())
        return getattr(self.made, name)


@contextlib.contextmanager
def lazy_session() -> Iterator[Session]:
    """:func:`session_scope` for a block that usually runs no statement (a tenant's key or a list of
    subscriptions a per-process cache holds, say): the session scope is entered only when the block
    first uses its session, and ends with the block (commit, or rollback on an exception); a block
    that never used it costs nothing (making and closing a session costs about 20 us). What the block
    gets is a stand-in that passes every attribute to the session: ``isinstance(..., Session)`` is
    False."""
    with contextlib.ExitStack() as scopes:
        yield cast(Session, _LazySession(scopes))


_ON_COMMIT = "tessera_on_commit"
_STATE_KEYS = "tessera_transaction_state"


def on_commit(session: OrmSession, callback: Callable[[], object]) -> None:
    """Run ``callback()`` once ``session``'s transaction commits (dropped if it rolls back).

    The platform's one after-commit hook: ``infra.dispatch`` sends recorded work's messages with it.
    """
    callbacks = session.info.setdefault(_ON_COMMIT, [])
    if callback not in callbacks:
        callbacks.append(callback)


def transaction_state(session: OrmSession, key: str, factory: Callable[[], T]) -> tuple[T, bool]:
    """The object stored under ``key`` for ``session``'s current transaction, made by ``factory()``
    on first use; returns ``(object, made_now)``. Dropped when the transaction commits or rolls back."""
    state = session.info.get(key)
    if state is not None:
        return state, False
    state = session.info[key] = factory()
    session.info.setdefault(_STATE_KEYS, set()).add(key)
    return state, True


def _end_transaction(session: OrmSession) -> list[Callable[[], None]]:
    for key in session.info.pop(_STATE_KEYS, ()):
        session.info.pop(key, None)
    return session.info.pop(_ON_COMMIT, [])


@event.listens_for(OrmSession, "after_commit")
def _run_on_commit(session: OrmSession) -> None:
    if session.in_nested_transaction():  # a SAVEPOINT ended; the real transaction goes on
        return
    for callback in _end_transaction(session):
        callback()


@event.listens_for(OrmSession, "after_rollback")
def _drop_on_commit(session: OrmSession) -> None:
    if session.in_nested_transaction():
        return
    _end_transaction(session)


# ---- gates: what waits for a commit may be told before it -------------------------------------------

#: The first key of the advisory locks that are gates (``pg_advisory_xact_lock(GATE_CLASS, key)``); no
#: other lock of the platform uses it.
GATE_CLASS = 0x7E55
_GATES = "tessera_gates"


def gate_key(subject: uuid.UUID | str) -> int:
    """The second key of the gate of ``subject`` (a job id, as a UUID or its text): its last 32 bits,
    signed (PostgreSQL's ``integer``). Raises ValueError for text that is not a UUID."""
    return int.from_bytes(uuid.UUID(str(subject)).bytes[-4:], "big", signed=True)


def gate_wait(subject: uuid.UUID | str) -> str:
    """The statement that waits while a transaction holds the gate of ``subject`` (:func:`hold_gates`)
    and passes at once otherwise: a shared lock, released when its own transaction ends. Sent just
    before a statement in the same round trip, on PostgreSQL (:func:`execute_once_more_on_disconnect`),
    that statement runs after the holder's commit and sees what it wrote (each statement of a
    transaction in ``READ COMMITTED`` reads the database as it is when the statement starts). Its
    text holds two integers, nothing else."""
    return f"SELECT pg_advisory_xact_lock_shared({GATE_CLASS}, {gate_key(subject)})"


class _Gates:
    """The gates a transaction holds or will hold, and what runs once they are held."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.held: set[int] = set()
        self.callbacks: list[Callable[[], object]] = []

    def hold_text(self) -> str | None:
        """The statement locking the gates not held yet (in key order), marking them held; None when
        all are."""
        keys = sorted(self.keys - self.held)
        if not keys:
            return None
        self.held.update(keys)
        return "SELECT " + ", ".join(f"pg_advisory_xact_lock({GATE_CLASS}, {key})" for key in keys)

    def run(self) -> None:
        """The callbacks, in order, each once."""
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


def hold_gates(session: OrmSession, subjects: Iterable[uuid.UUID | str]) -> bool:
    """Have ``session``'s transaction hold the gates of ``subjects`` (job ids) from before the
    callbacks of :func:`before_commit` until it ends (commit or rollback): who waits at one of them
    (:func:`gate_wait`) waits for the commit and then sees what it wrote. The locks are taken with the
    transaction's last write when they can be (in its round trip), else by one statement just before
    the callbacks. False, and nothing held, where there are no gates (a database other than
    PostgreSQL): the caller then waits for the commit itself (:func:`on_commit`)."""
    if session.get_bind().dialect.name != "postgresql":
        return False
    gates, _ = transaction_state(session, _GATES, _Gates)
    gates.keys.update(gate_key(subject) for subject in subjects)
    return True


def with_gates(session: OrmSession, statement: ExecutableT) -> ExecutableT:
    """``statement`` with the locks of the gates ``session``'s transaction is to hold
    (:func:`hold_gates`) and does not hold yet sent before it, in its round trip
    (:data:`storage.driver.PREFIX`; they are then held), for a transaction that names its jobs before
    its first read: their :func:`before_commit` callbacks then go out before its writes instead of
    after them. ``statement`` itself when there is no lock to take, or where statements are not
    server-prepared (the locks are then taken as :func:`hold_gates` says)."""
    gates = session.info.get(_GATES)
    if gates is None or not get_settings().db_prepared_statements:
        return statement
    hold = gates.hold_text()
    return statement if hold is None else statement.execution_options(**{driver.PREFIX: hold})


def before_commit(session: OrmSession, callback: Callable[[], object]) -> None:
    """Run ``callback()`` once the gates ``session``'s transaction holds are locked, just before its
    ``COMMIT`` (dropped if it rolls back first): what may be told before the commit because whoever
    acts on it waits at a gate (``infra.dispatch``: the messages of recorded jobs, whose lease waits
    for the commit). The transaction's staged writes (:func:`stage_write`) go first, their round trip
    carrying the locks, unless every gate was held already (:func:`with_gates`): then the callbacks
    go first, and whoever they tell waits at the gate while the writes and the ``COMMIT`` run. Only
    after :func:`hold_gates` returned True; an exception it raises rolls the transaction back."""
    gates, _ = transaction_state(session, _GATES, _Gates)
    gates.callbacks.append(callback)


def _open_gates(session: OrmSession) -> None:
    """Lock the gates not held yet (one statement) and run the :func:`before_commit` callbacks."""
    gates = session.info.pop(_GATES, None)
    if gates is None:
        return
    hold = gates.hold_text()
    if hold is not None:
        session.execute(text(hold))
    gates.run()


# ---- writes sent together before the commit ----------------------------------------------------------

_WRITES = "tessera_staged_writes"
_ROWS = "tessera_staged_insert_rows"


def stage_write(session: OrmSession, statement: UpdateBase, params: Mapping[str, Any] | None = None) -> None:
    """Queue the writing ``statement`` (an ``UPDATE``, ``DELETE`` or ``INSERT`` without ``RETURNING``,
    its values bound in it, or given by ``params``) to go out with the other writes queued in
    ``session``'s transaction, in one round trip just before it commits (:func:`flush_writes`), after
    everything else the transaction did (the ORM's pending changes are flushed first): the outcome of
    a job written in one statement. On PostgreSQL the queued writes are one prepared statement (each
    but the last a data-modifying ``WITH``), so each sees the rows as they were when that statement
    began and none sees another's changes: no two may change the same row, none may depend on
    another's effect. Elsewhere they run one by one, in order. Dropped on rollback.

    ``params``: the values of ``statement``'s bind parameters, for a statement built once (a module's
    ``functools.cache``; its parameter names unique among what one transaction stages). When every
    queued write comes so, their one statement is built once per shape too, not per transaction:
    no statement object made, no cache key walked (:func:`_staged_statement`)."""
    writes, _ = transaction_state(session, _WRITES, list)
    writes.append((statement, params))


def stage_changes(session: OrmSession, instance: Any) -> None:
    """Queue what ``instance`` (an ORM object loaded in ``session``) has changed as one ``UPDATE`` of
    its row by primary key (:func:`stage_write`) instead of the ORM's own flush, and take it out of
    ``session``. Nothing is queued when nothing changed (or the ORM already flushed it)."""
    state = inspect(instance)
    mapper = state.mapper
    values = {
        column.name: getattr(instance, attribute.key)
        for attribute in mapper.column_attrs
        for column in attribute.columns[:1]
        if state.attrs[attribute.key].history.has_changes()
    }
    session.expunge(instance)
    if values:
        table = mapper.local_table
        key = [
            table.c[column.name] == getattr(instance, mapper.get_property_by_column(column).key)
            for column in mapper.primary_key
        ]
        stage_write(session, update(table).where(*key).values(values))


def flush_writes(session: OrmSession) -> None:
    """Send the writes queued by :func:`stage_write` and the rows queued by :func:`stage_inserts` now
    (the ORM's pending changes first); nothing when none is queued. Runs by itself before every
    commit. On PostgreSQL one statement: each table's rows one ``INSERT`` from a JSON document (the
    text of :func:`insert_rows`, made once per shape), in a data-modifying ``WITH`` beside the queued
    writes; elsewhere one statement a write, then one ``INSERT`` a row."""
    writes: list[tuple[UpdateBase, Mapping[str, Any] | None]] = session.info.get(_WRITES) or []
    rows = session.info.get(_ROWS)
    if not writes and not rows:
        return
    statements = [statement for statement, _ in writes]
    params: dict[str, Any] = {}
    for _, values in writes:
        params.update(values or {})
    batches = [(table, ignore, batch) for (table, ignore), batch in rows.tables.items() if batch] if rows else []
    session.info.pop(_WRITES, None)
    session.info.pop(_ROWS, None)
    if not statements and not batches:
        return
    session.flush()
    connection = session.connection()
    dialect = connection.dialect
    if dialect.name != "postgresql":
        for statement, values in [*writes, *((row, None) for row in _row_statements(dialect.name, batches))]:
            session.execute(statement, values)
        return
    if not statements:  # rows only: the one statement of insert_rows
        _pg_insert(connection, batches)
        return
    # prepared: its text is the same for each unit of work of one shape (the values are bound), and
    # the server would otherwise plan its CTEs again each time (storage.driver.prepared_text)
    options: dict[str, Any] = dict(_PREPARED_OPTIONS)
    gates = session.info.get(_GATES)
    if gates is not None and get_settings().db_prepared_statements:  # the gates' locks in its round trip
        options[driver.PREFIX] = gates.hold_text()
    statement, _ = _pg_staged(writes, batches, dialect, params)
    session.execute(statement.execution_options(**options), params or None)


def _pg_staged(
    writes: list[tuple[UpdateBase, Mapping[str, Any] | None]],
    batches: list[tuple[Table, bool, list[dict]]],
    dialect: Any,
    params: dict[str, Any],
) -> tuple[UpdateBase, bool]:
    """The one PostgreSQL statement of :func:`flush_writes` for ``writes`` (at least one) and the
    rows ``batches``, each table's rows one JSON document added to ``params`` as ``rows_<n>``, and
    whether it was built once (every write built once, :func:`_staged_statement`: it may run
    prepared)."""
    statements = [statement for statement, _ in writes]
    try:  # each table's rows one JSON document, bound as rows_<n>
        params.update({f"rows_{n}": _json_rows(table, batch, dialect) for n, (table, _, batch) in enumerate(batches)})
        shape = tuple((table, ignore, tuple(batch[0])) for table, ignore, batch in batches)
    except TypeError:  # a value JSON cannot carry: one statement a row, beside the writes
        statements += _row_statements(dialect.name, batches)
        shape = ()
    if all(values is not None for _, values in writes) and len(statements) == len(writes):
        return _staged_statement(tuple(statements), shape), True  # every write built once: so is the statement
    return _staged_statement.__wrapped__(tuple(statements), shape), False


@functools.lru_cache(maxsize=64)
def _staged_statement(statements: tuple[UpdateBase, ...], shape: tuple[tuple[Table, bool, tuple[str, ...]], ...]):
    """The one statement of :func:`flush_writes` for ``statements`` (each built once, its values
    bound by name at run time) and rows of ``shape`` (per table, in order: the table, whether
    conflicts are skipped, the rows' keys; each table's JSON document bound as ``rows_<n>``): each
    statement but the last, then each table's ``INSERT``, a data-modifying ``WITH`` of the last.
    Kept per shape when every statement was built once (the same objects each time: SQLAlchemy's
    compiled form is found by identity of the parts, and the server plans it once per connection);
    :func:`flush_writes` builds it anew (``__wrapped__``) for statements with their values bound in."""
    *first, last = statements
    ctes = [statement.cte(f"staged_{n}") for n, statement in enumerate(first)]
    ctes += [
        _json_insert_clause(table, ignore, names, n).columns().cte(f"staged_rows_{n}")
        for n, (table, ignore, names) in enumerate(shape)
    ]
    return last.add_cte(*ctes) if ctes else last


@functools.lru_cache(maxsize=2_000)
def _json_insert_clause(table: Table, ignore: bool, names: tuple[str, ...], n: int) -> TextClause:
    """:func:`_pg_json_insert` as a textual clause whose document is the bind parameter ``rows_<n>``
    (parsed once per shape)."""
    return text(_pg_json_insert(table, ignore, names, f":rows_{n}"))


def _row_statements(dialect_name: str, batches: list[tuple[Table, bool, list[dict]]]) -> list[UpdateBase]:
    """One ``INSERT`` statement a row of ``batches`` (:func:`insert_statement`), in order."""
    return [
        insert_statement(dialect_name, table, ignore_conflicts=ignore).values(row)
        for table, ignore, batch in batches
        for row in batch
    ]


@event.listens_for(OrmSession, "before_commit")
def _flush_writes_before_commit(session: OrmSession) -> None:
    gates = session.info.get(_GATES)
    if gates is not None and not gates.keys - gates.held and not session.in_nested_transaction():
        _open_gates(session)  # every gate is held: tell before the writes (:func:`with_gates`)
    if session.info.get(_WRITES) or session.info.get(_ROWS):
        flush_writes(session)
    if not session.in_nested_transaction():
        _open_gates(session)


# ---- rows written without ORM objects --------------------------------------------------------------


class Rows:
    """Rows to insert, by table, in the order the tables were first named (a parent's table before
    its children's). Each row is a complete dict of column values (column defaults of the models are
    Python-side and do not apply); the rows of one table share one set of keys. A table named with
    ``ignore_conflicts`` skips the rows whose key exists (``ON CONFLICT DO NOTHING``)."""

    __slots__ = ("tables",)

    def __init__(self) -> None:
        self.tables: dict[tuple[Table, bool], list[dict]] = {}

    def add(self, table: Table, row: dict, *, ignore_conflicts: bool = False) -> None:
        """Queue one row of ``table``."""
        self.tables.setdefault((table, ignore_conflicts), []).append(row)

    def merge(self, other: Rows) -> None:
        """Queue every row of ``other`` after these."""
        for key, rows in other.tables.items():
            self.tables.setdefault(key, []).extend(rows)

    def __bool__(self) -> bool:
        return any(self.tables.values())


def insert_statement(dialect_name: str, table: Table, *, ignore_conflicts: bool = False):
    """``INSERT INTO table``, skipping rows whose key exists when ``ignore_conflicts`` (PostgreSQL and
    SQLite ``ON CONFLICT DO NOTHING``)."""
    if not ignore_conflicts:
        return insert(table)
    if dialect_name == "postgresql":
        return pg_insert(table).on_conflict_do_nothing()
    if dialect_name == "sqlite":
        return sqlite_insert(table).on_conflict_do_nothing()
    return insert(table).prefix_with("IGNORE")  # MySQL-like backends


def model_row(model: type[SQLModel], **values: Any) -> dict[str, Any]:
    """The complete row of a new ``model`` instance made of ``values``, keyed by column name (what
    :meth:`Rows.add` takes), its other columns given the model's Python-side defaults as its
    constructor gives them (a table model's constructor validates nothing), without building the
    instance and its ORM state, which cost more than the row (a rail's: 78 us against 5). Raises
    TypeError for a name that is not a column, or a column without a default left out."""
    columns = _defaults_of(model)
    unknown = values.keys() - columns.keys()
    if unknown:
        raise TypeError(f"{model.__name__} has no column {sorted(unknown)[0]!r}")
    row: dict[str, Any] = {}
    for name, (kind, default) in columns.items():
        if name in values:
            row[name] = values[name]
        elif kind is _FACTORY:
            row[name] = default()
        elif kind is _FACTORY_OF_DATA:
            row[name] = default(row)
        elif kind is _VALUE:
            row[name] = default
        else:
            raise TypeError(f"{model.__name__}.{name} has no default: give it")
    return row


_VALUE, _FACTORY, _FACTORY_OF_DATA, _REQUIRED = "value", "factory", "factory of the data", "required"


@functools.cache
def _defaults_of(model: type[SQLModel]) -> dict[str, tuple[str, Any]]:
    """Each column of ``model``'s table (in order) and its default: ``(kind, value or factory)``,
    told apart once per model (pydantic inspects a factory's signature at each call)."""
    defaults: dict[str, tuple[str, Any]] = {}
    for column in table_of(model).columns:
        info = model.model_fields.get(column.name)
        if info is None or info.is_required():
            defaults[column.name] = (_REQUIRED, None)
        elif info.default_factory is not None:
            kind = _FACTORY_OF_DATA if info.default_factory_takes_validated_data else _FACTORY
            defaults[column.name] = (kind, info.default_factory)
        else:
            defaults[column.name] = (_VALUE, info.default)
    return defaults


M = TypeVar("M", bound=SQLModel)


def row_instance(model: type[M], row: dict[str, Any]) -> M:
    """An instance of the table model ``model`` holding ``row`` (column name -> value, typed as the
    database driver returns them or as :func:`model_row` makes them) the way the ORM holds a row it
    loaded: no validation, no change tracking, in no session. For a row a statement of its own read
    (a job's lease returns its row) or one the caller writes itself (a job recorded into
    :class:`Rows`): about 2 us, where ``model.model_validate`` takes about 45 and the constructor
    more. Not for ``session.add``: nothing in it counts as a change, so a flush would write none of
    its values. The mappers are configured on a process's first call (as the ORM's first query would
    configure them), so an instance made before any query still reads its attributes."""
    if model not in _CONFIGURED_MODELS:
        configure_mappers()
        _CONFIGURED_MODELS.add(model)
    instance = cast(M, inspect(model).class_manager.new_instance())
    instance.__dict__.update(row)
    return instance


#: The models :func:`row_instance` has seen with their mappers configured.
_CONFIGURED_MODELS: set[type] = set()


def insert_rows(session: OrmSession, rows: Rows) -> None:
    """Insert ``rows`` in the session's transaction. On PostgreSQL, when every table has fewer than
    :data:`COPY_MIN_ROWS` rows, one statement (each further table an ``INSERT`` in a data-modifying
    ``WITH``; foreign keys are checked when the statement ends) whose text is made once per shape
    (tables and columns) and whose values pass through their columns' bind processors, so what is
    stored is what SQLAlchemy would store; each table's rows travel as one JSON parameter that
    PostgreSQL expands with ``json_populate_recordset`` (one string to quote and parse instead of one
    literal per value), or, when a value does not fit JSON (an integer beyond 64 bits), as ``VALUES``
    literals. A bulk write (a table of at least :data:`COPY_MIN_ROWS` rows, e.g. an account updater
    chunk's tokens) writes each table on its own, in the order the tables were named (a parent's rows
    before its children's): a table of at least that many rows by ``COPY ... FROM STDIN`` (its values
    through the same bind processors, in ``COPY``'s text format; a table queued with
    ``ignore_conflicts`` is copied into a temporary table first, then inserted from it with ``ON
    CONFLICT DO NOTHING``), a smaller one in ``INSERT`` statements of at most
    :data:`MAX_STATEMENT_ROWS` rows. Elsewhere one multi-row ``INSERT`` per table. Raises
    SQLAlchemy's wrapped driver errors (IntegrityError...)."""
    batches = [(table, ignore, batch) for (table, ignore), batch in rows.tables.items() if batch]
    if not batches:
        return
    connection = session.connection()
    dialect = connection.dialect
    if dialect.name != "postgresql":
        for table, ignore, batch in batches:
            connection.execute(insert_statement(dialect.name, table, ignore_conflicts=ignore), batch)
        return
    if all(len(batch) < COPY_MIN_ROWS for _, _, batch in batches):
        _pg_insert(connection, batches)
        return
    for table, ignore, batch in batches:
        if len(batch) >= COPY_MIN_ROWS:
            _pg_copy(connection, table, ignore, batch)
            continue
        for start in range(0, len(batch), MAX_STATEMENT_ROWS):
            _pg_insert(connection, [(table, ignore, batch[start : start + MAX_STATEMENT_ROWS])])


MAX_STATEMENT_ROWS = 1_000
"""The most rows of one table :func:`insert_rows` writes in one PostgreSQL ``INSERT`` (statement texts
are cached per row count, and a statement's parameters stay far below the driver's limits)."""

COPY_MIN_ROWS = 200
"""From this many rows of one table, :func:`insert_rows` and :func:`insert_rows_unflushed` write the
table with PostgreSQL's ``COPY`` (below it, one ``INSERT`` costs less than a ``COPY``'s set-up)."""


def _pg_copy(connection: Connection, table: Table, ignore: bool, batch: list[dict]) -> None:
    """``COPY`` the rows of ``batch`` into ``table`` on ``connection`` (PostgreSQL, psycopg2), in the
    transaction the connection is in. With ``ignore``, into a temporary table of the same columns, then
    ``INSERT ... SELECT ... ON CONFLICT DO NOTHING`` from it (``COPY`` itself cannot skip rows). A value
    of a type the text format is not written for here (an interval, an array...) sends the table by
    ``INSERT`` statements instead. Raises SQLAlchemy's wrapped driver errors."""
    names = tuple(batch[0])
    try:
        data = _copy_data(table, names, batch, connection.dialect)
    except _NotCopyable:
        for start in range(0, len(batch), MAX_STATEMENT_ROWS):
            _pg_insert(connection, [(table, ignore, batch[start : start + MAX_STATEMENT_ROWS])])
        return
    columns = ", ".join(f'"{name}"' for name in names)
    target = f'"{table.name}"'
    statements: list[str] = []
    if ignore:
        staging = f'"tessera_copy_{table.name}"'
        statements.append(f"CREATE TEMPORARY TABLE {staging} (LIKE {target}) ON COMMIT DROP")
        copy = f"COPY {staging} ({columns}) FROM STDIN"
        after = [
            f"INSERT INTO {target} ({columns}) SELECT {columns} FROM {staging} ON CONFLICT DO NOTHING",  # noqa: S608 - names from the tables
            f"DROP TABLE {staging}",
        ]
    else:
        copy, after = f"COPY {target} ({columns}) FROM STDIN", []
    cursor = connection.connection.cursor()
    statement = copy
    try:
        for statement in statements:
            cursor.execute(statement)
        statement = copy
        cursor.copy_expert(copy, io.StringIO(data))
        for statement in after:
            cursor.execute(statement)
    except connection.dialect.loaded_dbapi.Error as exc:
        raise DBAPIError.instance(statement, None, exc, connection.dialect.loaded_dbapi.Error) from exc
    finally:
        cursor.close()


class _NotCopyable(Exception):
    """A value that :func:`_copy_value` does not write in ``COPY``'s text format."""


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_value(value: Any) -> str:
    """One value (after its column's bind processor) in ``COPY``'s text format: ``\\N`` for NULL,
    backslash escapes for text, ``\\x`` hex for bytes; raises :class:`_NotCopyable` for other types
    than text, numbers, booleans, UUIDs, dates and times, and bytes."""
    if value is None:
        return "\\N"
    if isinstance(value, str):
        return value.translate(_COPY_ESCAPES)
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (int, float, decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "\\\\x" + bytes(value).hex()
    raise _NotCopyable(type(value).__name__)


def _copy_data(table: Table, names: tuple[str, ...], batch: list[dict], dialect) -> str:
    """The rows of ``batch`` (columns ``names``) as ``COPY`` text: values through their columns' bind
    processors, tab-separated, one line each."""
    columns = tuple(zip(names, _copy_processors(table, names, dialect), strict=True))
    escapes = _COPY_ESCAPES
    lines = []
    for row in batch:
        fields: list[str] = []
        add = fields.append
        for name, process in columns:
            value = row[name]
            if value is None:
                add("\\N")
                continue
            if process is not None:
                value = process(value)
            kind = type(value)  # the common types first, without the checks of _copy_value
            if kind is str:
                add(value.translate(escapes))
            elif kind is uuid.UUID or kind is int:
                add(str(value))
            else:
                add(_copy_value(value))
        lines.append("\t".join(fields))
    lines.append("")
    return "\n".join(lines)


@functools.cache
def _copy_processors(table: Table, names: tuple[str, ...], dialect) -> tuple:
    """The bind processors of ``names`` for ``COPY``: those of :func:`_processors`, but none for binary
    columns (whose processor wraps the bytes for the driver's own quoting)."""
    return tuple(
        None if isinstance(table.c[name].type, LargeBinary) else process
        for name, process in zip(names, _processors(table, names, dialect), strict=True)
    )


def _pg_insert(connection: Connection, batches: list[tuple[Table, bool, list[dict]]]) -> None:
    """One PostgreSQL statement inserting ``batches`` (``(table, ignore_conflicts, rows)``, in order):
    each table's rows as one JSON document, else (a value JSON cannot carry) as ``VALUES`` literals."""
    json_insert = _pg_json_statement(batches, connection.dialect)
    if json_insert is None:
        _pg_values_insert(connection, batches)
        return
    connection.exec_driver_sql(*json_insert, execution_options=_PREPARED_OPTIONS)


def _pg_json_statement(batches: list[tuple[Table, bool, list[dict]]], dialect) -> tuple[str, tuple] | None:
    """The text and parameters of the one statement inserting ``batches`` from JSON documents
    (:func:`_pg_insert`), or None when a value cannot travel as JSON (e.g. an integer beyond 64 bits
    in a JSON column)."""
    try:
        documents = tuple(_json_rows(table, batch, dialect) for table, _, batch in batches)
    except TypeError:
        return None
    return _pg_json_text(tuple((table, ignore, tuple(batch[0])) for table, ignore, batch in batches)), documents


def _json_rows(table: Table, batch: list[dict], dialect) -> str:
    """The rows of one table as a JSON array of objects keyed by column name, each value as
    PostgreSQL's input function reads it back: a JSON column's value as it is, bytes as ``\\x`` and
    hex digits, every other value through its column's bind processor (then datetimes in ISO 8601
    with their offset, UUIDs and decimals as strings). TypeError when a value does not fit JSON."""
    names = tuple(batch[0])
    kinds = _json_kinds(table, names, dialect)
    rows = []
    for row in batch:
        out = {}
        for name, (kind, process) in zip(names, kinds, strict=True):
            value = row[name]
            if value is not None:
                if kind == _BINARY:
                    value = "\\x" + bytes(value).hex()
                elif process is not None:
                    value = process(value)
            out[name] = value
        rows.append(out)
    return orjson.dumps(rows, default=_json_default, option=orjson.OPT_NON_STR_KEYS).decode()


_BINARY, _AS_IS, _PROCESSED = "binary", "as is", "processed"


@functools.cache
def _json_kinds(table: Table, names: tuple[str, ...], dialect) -> tuple[tuple[str, Any], ...]:
    """Per column of ``names``: how its values go into the JSON document, and its bind processor."""
    kinds: list[tuple[str, Any]] = []
    for name in names:
        column_type = table.c[name].type
        if isinstance(column_type, LargeBinary):
            kinds.append((_BINARY, None))
        elif isinstance(column_type, JSON):
            kinds.append((_AS_IS, None))  # the document carries the JSON value itself
        else:
            kinds.append((_PROCESSED, column_type._cached_bind_processor(dialect)))
    return tuple(kinds)


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@functools.lru_cache(maxsize=2_000)
def _pg_json_text(shape: tuple) -> str:
    """The text of one PostgreSQL statement inserting rows of ``shape`` (one ``%s`` JSON document per table)."""
    return _one_statement([_pg_json_insert(table, ignore, names, "%s") for table, ignore, names in shape])


@functools.lru_cache(maxsize=2_000)
def _pg_json_insert(table: Table, ignore: bool, names: tuple[str, ...], document: str) -> str:
    """``INSERT INTO table (names)`` of the rows of the JSON document ``document`` (its placeholder:
    ``%s``, ``:name``), skipping rows whose key exists when ``ignore``."""
    columns = ", ".join(f'"{name}"' for name in names)
    conflict = " ON CONFLICT DO NOTHING" if ignore else ""
    source = f'json_populate_recordset(NULL::"{table.name}", {document})'
    return f'INSERT INTO "{table.name}" ({columns}) SELECT {columns} FROM {source}{conflict}'  # noqa: S608 - names from the tables


def _pg_values_insert(connection: Connection, batches: list[tuple[Table, bool, list[dict]]]) -> None:
    """:func:`_pg_insert` with every value a ``VALUES`` literal."""
    dialect = connection.dialect
    shape = tuple((table, ignore, tuple(batch[0]), len(batch)) for table, ignore, batch in batches)
    sql = _pg_text(shape)
    params: list = []
    for table, _, batch in batches:
        names = tuple(batch[0])
        processors = _processors(table, names, dialect)
        for row in batch:
            for name, process in zip(names, processors, strict=True):
                value = row[name]
                if value is not None and process is not None:
                    value = process(value)
                params.append(str(value) if isinstance(value, uuid.UUID) else value)
    connection.exec_driver_sql(sql, tuple(params))


@functools.cache
def _processors(table: Table, names: tuple[str, ...], dialect) -> tuple:
    return tuple(table.c[name].type._cached_bind_processor(dialect) for name in names)


@functools.lru_cache(maxsize=2_000)  # shapes vary with row counts: the cache stays bounded
def _pg_text(shape: tuple) -> str:
    """The text of one PostgreSQL statement inserting rows of ``shape`` (positional ``%s`` values)."""
    inserts = []
    for table, ignore, names, count in shape:
        row = "(" + ", ".join(["%s"] * len(names)) + ")"
        columns = ", ".join(f'"{name}"' for name in names)
        conflict = " ON CONFLICT DO NOTHING" if ignore else ""
        values = ", ".join([row] * count)
        inserts.append(f'INSERT INTO "{table.name}" ({columns}) VALUES {values}{conflict}')  # noqa: S608 - names from the tables
    return _one_statement(inserts)


def _one_statement(inserts: list[str]) -> str:
    """``inserts`` (statement texts) as one PostgreSQL statement: each but the last a data-modifying
    ``WITH``."""
    *first, last = inserts
    if not first:
        return last
    return "WITH " + ", ".join(f"w{n} AS ({text})" for n, text in enumerate(first)) + " " + last


def stage_inserts(session: OrmSession, rows: Rows) -> None:
    """Queue ``rows`` to be inserted with the other writes queued in ``session``'s transaction
    (:func:`stage_write`), just before the commit (:func:`flush_writes`): on PostgreSQL they and those
    writes are one statement (foreign keys are checked when it ends, so a row may name one inserted
    beside it), each table's rows one ``INSERT`` from a JSON document whose text is made once per
    shape: no statement object is built and no cache key walked per value (a rail retry's writes
    took 0.87 ms of CPU to stage and send, against 1.09 ms with one Core ``INSERT`` a row;
    ``benchmarks/README.md``). Rows of one table
    queued by several calls share one set of keys (:class:`Rows`). For a unit of work's few rows;
    :func:`insert_rows` writes many."""
    staged, _ = transaction_state(session, _ROWS, Rows)
    staged.merge(rows)


_STAGED = "tessera_staged_rows"


def is_staging(session: OrmSession) -> bool:
    """True while ``session`` runs a group of units of work (:class:`GroupCommit`): rows given to
    :func:`stage_rows` wait for the group's one statement before its commit."""
    return _STAGED in session.info


def stage_rows(session: OrmSession, rows: Rows) -> None:
    """Insert ``rows`` now, or, when ``session`` runs a group of units of work
    (:class:`GroupCommit`), with the rows of the whole group in one statement before its commit."""
    staged = session.info.get(_STAGED)
    if staged is None:
        insert_rows(session, rows)
    else:
        staged.merge(rows)


def insert_rows_last(session: OrmSession, rows: Rows) -> None:
    """Insert ``rows`` as the last write of ``session``'s unit of work (nothing in it writes after
    them). When the session has done nothing yet (no statement, no pending ORM change) on PostgreSQL
    and the rows fit one statement (:func:`insert_rows`), that statement is the whole transaction:
    sent at once in autocommit mode, durable when it returns, no ``BEGIN`` and no ``COMMIT`` (two
    round trips fewer); what waits for the commit (:func:`on_commit`: the recorded jobs' messages)
    runs when the session commits, as usual. Otherwise as :func:`stage_rows` (with the group's rows
    when the session runs a :class:`GroupCommit`). Raises SQLAlchemy's wrapped driver errors."""
    if (
        session.in_transaction()
        or _STAGED in session.info
        or not one_statement_transactions()
        or any(len(batch) >= COPY_MIN_ROWS for batch in rows.tables.values())
    ):
        stage_rows(session, rows)
        return
    batches = [(table, ignore, batch) for (table, ignore), batch in rows.tables.items() if batch]
    if not batches:
        return
    engine = get_autocommit_engine()
    assert engine is not None  # one_statement_transactions(), checked above
    on_driver = driver.runs_on_driver(engine)
    gates = session.info.get(_GATES)
    json_insert = _pg_json_statement(batches, engine.dialect) if on_driver or gates is not None else None
    if gates is not None:
        if json_insert is None:  # a value JSON cannot carry: in the session's transaction
            stage_rows(session, rows)
        else:
            _insert_behind_gates(session, engine, json_insert, gates, on_driver=on_driver)
        return
    if json_insert is not None:
        with driver.driver_cursor(engine) as (info, cursor):
            driver.execute_text(info, cursor, *json_insert, prepared=get_settings().db_prepared_statements)
        return
    with engine.connect() as connection:  # a value JSON cannot carry: VALUES literals
        _pg_insert(connection, batches)


def _insert_behind_gates(
    session: OrmSession, engine: Engine, json_insert: tuple[str, tuple], gates: _Gates, *, on_driver: bool
) -> None:
    """:func:`insert_rows_last`'s one statement when ``session``'s transaction holds gates: ``BEGIN``,
    the gates' locks and the statement in one round trip (on the driver's cursor, else through
    SQLAlchemy, unprepared), the :func:`before_commit` callbacks, then ``COMMIT``: two round trips
    (the session's own transaction, empty, then ends without any)."""
    session.info.pop(_GATES, None)
    begin = f"BEGIN; {gates.hold_text()}"
    if on_driver:
        with driver.driver_cursor(engine) as (info, cursor):
            _one_transaction(
                lambda: driver.execute_text(
                    info, cursor, *json_insert, prepared=get_settings().db_prepared_statements, prefix=begin
                ),
                cursor.execute,
                gates.run,
            )
        return
    with engine.connect() as connection:  # autocommit: the BEGIN and COMMIT are sent here
        _one_transaction(
            lambda: connection.exec_driver_sql(f"{begin}; {json_insert[0]}", json_insert[1]),
            connection.exec_driver_sql,
            gates.run,
        )


class ReadThenWrite:
    """A unit of work that reads once, then writes what it staged in its session
    (:func:`stage_write`, :func:`stage_inserts`), as one transaction on the driver's cursor
    (:func:`read_then_write`). Its jobs' messages go out between the two, behind their gates."""

    def __init__(self, session: OrmSession, engine: Engine, info: dict, cursor: Any, gates: _Gates) -> None:
        self._session, self._engine, self._info, self._cursor, self._gates = session, engine, info, cursor, gates
        self.begun = False

    def _read(self, statement: Any, params: dict | None) -> Result | None:
        if self.begun:
            raise RuntimeError("a unit of read_then_write reads once")
        compiled = _on_driver(self._engine, statement)
        if compiled is None:
            raise TypeError("read_then_write reads a statement built once, server-prepared")
        hold = self._gates.hold_text()
        self.begun = True
        begin = f"BEGIN; {hold}" if hold else "BEGIN"
        return driver.execute(self._info, self._cursor, compiled, params, prefix=begin)

    def read_first(self, statement: Any, params: dict | None = None) -> Any:
        """The first row of ``statement`` (a read built once, :func:`server_prepared`; None without
        rows), the transaction's first statement: ``BEGIN`` and the locks of its gates go in its
        round trip. Once only (:meth:`read_all` counts). Raises SQLAlchemy's wrapped driver errors
        (the block then rolls back)."""
        return _first(self._read(statement, params))

    def read_all(self, statement: Any, params: dict | None = None) -> list:
        """Every row of ``statement``, read as :meth:`read_first` reads."""
        return _all(self._read(statement, params))

    def finish(self) -> None:
        """The end of the block: the gates' :func:`before_commit` callbacks (the jobs' messages; any
        gate named since the read is locked first, by one statement), then what the session staged
        (the one statement of :func:`flush_writes`) and ``COMMIT`` in one round trip."""
        if not self.begun:
            return
        later = self._session.info.pop(_GATES, None)  # the jobs recorded since the read, their messages
        for gates in (self._gates, later):
            if gates is None:
                continue
            gates.held |= self._gates.held
            hold = gates.hold_text()
            if hold is not None:
                self._cursor.execute(hold)
            gates.run()
        writes: list[tuple[UpdateBase, Mapping[str, Any] | None]] = self._session.info.pop(_WRITES, None) or []
        rows: Rows | None = self._session.info.pop(_ROWS, None)
        batches = [(table, ignore, batch) for (table, ignore), batch in rows.tables.items() if batch] if rows else []
        dialect, prepared = self._engine.dialect, get_settings().db_prepared_statements
        if writes:
            params: dict[str, Any] = {}
            for _, values in writes:
                params.update(values or {})
            statement, built_once = _pg_staged(writes, batches, dialect, params)
            compiled = driver.driver_statement(statement, dialect, prepared=prepared and built_once)
            if compiled is None:
                raise TypeError("a staged write whose text depends on its values")
            driver.execute(self._info, self._cursor, compiled, params, suffix="COMMIT")
            return
        json_insert = _pg_json_statement(batches, dialect) if batches else None
        if json_insert is not None:
            driver.execute_text(self._info, self._cursor, *json_insert, prepared=prepared, suffix="COMMIT")
            return
        for statement in _row_statements(dialect.name, batches):  # a value JSON cannot carry
            row_insert = driver.driver_statement(statement, dialect, prepared=False)
            assert row_insert is not None  # an INSERT of one row's values: its text does not depend on them
            driver.execute(self._info, self._cursor, row_insert, None)
        self._cursor.execute("COMMIT")


@contextlib.contextmanager
def read_then_write(session: OrmSession, subjects: Iterable[uuid.UUID | str]) -> Iterator[ReadThenWrite | None]:
    """A unit of work of ``session`` that reads once, then writes what it staged
    (:class:`ReadThenWrite`), as one transaction of two round trips on the driver's cursor:
    ``BEGIN``, the locks of the gates of ``subjects`` (the ids of the jobs it is to record, drawn
    before the read) and the read; then, once the block's code ran, its jobs' messages (the worker's
    lease waits at the gate), then its staged writes (:func:`stage_write`, :func:`stage_inserts`:
    one statement) and ``COMMIT``. The session's own transaction never begins: the block reads
    and writes through the unit and the staging functions only (a key read through ``session`` on a
    cache miss is a transaction of its own, committed with the session). An exception in the block
    rolls the unit back (``ROLLBACK``; its messages and staged writes are dropped). None, and nothing
    begun, where this does not run (a database other than PostgreSQL through psycopg2, statements
    not server-prepared, a session that began a transaction or has statements listened to): the
    block then reads and writes through ``session`` as usual."""
    engine = get_autocommit_engine()
    if (
        engine is None
        or session.in_transaction()
        or not get_settings().db_prepared_statements
        or not driver.runs_on_driver(engine)
        or not hold_gates(session, subjects)
    ):
        yield None
        return
    gates = session.info.pop(_GATES)
    with driver.driver_cursor(engine) as (info, cursor):
        unit = ReadThenWrite(session, engine, info, cursor, gates)
        try:
            yield unit
            unit.finish()
        except BaseException:
            _end_transaction(session)  # its staged writes, its messages, what waited for its commit
            if unit.begun:
                with contextlib.suppress(Exception):  # the error raised says what went wrong
                    cursor.execute("ROLLBACK")
            raise


def _one_transaction(
    write: Callable[[], object], send: Callable[[str], object], before_commit: Callable[[], object] | None = None
) -> None:
    """On a connection in the driver's autocommit mode: ``write()`` (whose first statement goes with
    ``BEGIN`` in its round trip), ``before_commit()``, then ``COMMIT`` sent by ``send``; ``ROLLBACK``
    instead when any of them raised (then re-raised). A transaction without psycopg2's own ``BEGIN``
    round trip."""
    try:
        write()
        if before_commit is not None:
            before_commit()
        send("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):  # the error raised says what went wrong
            send("ROLLBACK")
        raise


class GroupCommit:
    """Units of work submitted within ``window`` seconds of each other share one transaction: they
    run one after the other in one session (each in its own submitter's context), their staged rows
    (:func:`stage_rows`) go out in one statement, and one commit ends them all. When none of them
    sent a statement (what they read was cached: ``POST /tokenize`` under load), that statement is
    the whole transaction, sent in autocommit mode (:func:`insert_rows_last`: no ``BEGIN``, no
    ``COMMIT``). When any of them raises, or the shared statement or commit fails, the group is
    rolled back and each unit of work runs again alone, in a transaction of its own, so each
    answers exactly as it would have alone (a 409 for the one whose id was taken, success for the
    others).

    A unit of work is ``fn(session, *args, **kwargs)``: it must not commit, and whatever it does
    outside the transaction must bear being done twice (a unit may run again alone). Rows staged by
    a unit are not visible to the units after it in the group. ``window`` 0 runs every unit alone at
    once. When no group is running, a unit does not wait for the window: it starts at the end of the
    event loop's current turn with whatever was submitted in that turn (a lone request pays no
    window; under load, what arrives while groups run forms the next group). At most ``max_group``
    units share a transaction, and at most ``max_running`` groups run at a time: what arrives
    meanwhile waits for one of them to end and goes in the next group. One by default: the group's
    insert and commit are where the next group forms, so groups grow with the load and the
    database's round trip instead of overlapping; two at a time cost more of every part per
    request (``POST /tokenize`` with 64 clients on 2 cores: api CPU 0.31 against 0.29 ms,
    PostgreSQL's 0.08 against 0.07 ms, the same p99; ``benchmarks/README.md``).
    """

    def __init__(self, executor: Executor, *, window: float = 0.001, max_group: int = 64, max_running: int = 1) -> None:
        self._executor = executor
        self._window = window
        self._max_group = max_group
        self._max_running = max_running
        self._running = 0
        self._pending: list[tuple[contextvars.Context, Callable, tuple, dict, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def run(self, fn: Callable, /, *args, **kwargs):
        """Run ``fn(session, *args, **kwargs)`` in a shared (or its own) transaction; returns its
        result or raises its exception."""
        loop = asyncio.get_running_loop()
        if self._window <= 0:
            return await loop.run_in_executor(self._executor, _alone, contextvars.copy_context(), fn, args, kwargs)
        future = loop.create_future()
        self._pending.append((contextvars.copy_context(), fn, args, kwargs, future))
        if len(self._pending) >= self._max_group:
            self._flush()
        elif self._timer is None and self._running < self._max_running:
            # idle: at the end of this turn of the loop; else within the window. With every group
            # slot taken, no timer: the group that ends first sends what is pending (``_ended``).
            self._timer = loop.call_later(self._window if self._running else 0, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._running >= self._max_running:
            return  # sent when a running group ends, with whatever arrived meanwhile
        group, self._pending = self._pending[: self._max_group], self._pending[self._max_group :]
        if not group:
            return
        self._running += 1
        done = asyncio.get_running_loop().run_in_executor(self._executor, _run_group, group)
        done.add_done_callback(functools.partial(self._ended, group))

    def _ended(self, group: list, done: asyncio.Future) -> None:
        self._running -= 1
        _settle(group, done)
        if self._pending and self._timer is None:
            self._flush()


def _alone(context: contextvars.Context, fn: Callable, args: tuple, kwargs: dict):
    def unit():
        with session_scope() as session:
            return fn(session, *args, **kwargs)

    return context.run(unit)


def _run_group(group: list) -> list[tuple[bool, object]]:
    """``(ok, result or exception)`` per unit of work of ``group``."""
    if len(group) > 1:
        try:
            with session_scope() as session:
                staged = session.info[_STAGED] = Rows()
                results = [context.run(fn, session, *args, **kwargs) for context, fn, args, kwargs, _ in group]
                del session.info[_STAGED]
                insert_rows_last(session, staged)
            return [(True, result) for result in results]
        except Exception:
            log.debug("a shared transaction failed; its units of work run again alone", exc_info=True)
    outcomes: list[tuple[bool, object]] = []
    for context, fn, args, kwargs, _ in group:
        try:
            outcomes.append((True, _alone(context, fn, args, kwargs)))
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            outcomes.append((False, exc))
    return outcomes


def _settle(group: list, done: asyncio.Future) -> None:
    exc = done.exception()
    outcomes = [(False, exc)] * len(group) if exc is not None else done.result()
    for (*_, future), (ok, value) in zip(group, outcomes, strict=True):
        if future.done():  # the request was cancelled meanwhile
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def rowcount(result: Result[Any]) -> int:
    """The rows an ``UPDATE`` or ``DELETE`` run by ``Session.execute`` changed (the session types its
    answer as a ``Result``; for those statements it is a ``CursorResult``, which counts them)."""
    return cast(CursorResult[Any], result).rowcount


def name_transaction(session: OrmSession, name: str) -> None:
    """Show ``name`` as the ``application_name`` of ``session``'s connection until its transaction
    ends (``SET LOCAL``; PostgreSQL only, elsewhere nothing): :func:`others_at_work` leaves such
    sessions out."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT set_config('application_name', :name, true)"), {"name": name})


def others_at_work(session: OrmSession, leaving_out: str) -> int:
    """How many other sessions of the database run a statement at this instant, leaving out
    ``session``'s own and those named ``leaving_out`` (:func:`name_transaction`): a sign that
    someone waits for the database. Always 0 on a database without ``pg_stat_activity``."""
    if session.get_bind().dialect.name != "postgresql":
        return 0
    return int(
        session.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND backend_type = 'client backend' AND state = 'active' "
                "AND pid <> pg_backend_pid() AND application_name <> :leaving_out"
            ),
            {"leaving_out": leaving_out},
        ).scalar_one()
    )
