"""Statements run on the driver's cursor of a pooled connection, without SQLAlchemy's execution.

The job paths send a few statements each, built once per process (:func:`storage.db.server_prepared`),
one round trip apiece: a lease, an outcome, a recording. Through SQLAlchemy's ``Connection`` most
of a statement's CPU is SQLAlchemy's (its execution context and result, the connection's checkout
and return, the transaction it begins and rolls back on an autocommit connection): a job row read
by its id took 204 us of CPU that way and 144 us here (``benchmarks/statements.py``). Here the
statement is compiled once (its text, its bind and result processors kept), its values are
processed as SQLAlchemy would, and it runs as a server-side prepared statement
(:func:`prepared_text`, shared with the ``before_cursor_execute`` hook of the SQLAlchemy path: both
use the names a connection prepared). Its rows come back as SQLAlchemy rows (``.first()``,
``.mappings()``), its errors as SQLAlchemy's wrapped driver errors, a closed connection invalidating
the pool as SQLAlchemy does.

The path is taken only on PostgreSQL (psycopg2) and only while nothing listens to the engine's
statements (tracing, a test counting round trips): those listeners then see every statement through
SQLAlchemy as before (:func:`runs_on_driver`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import psycopg2
import psycopg2.extensions
from sqlalchemy.engine import Engine, Result
from sqlalchemy.engine.result import IteratorResult, SimpleResultMetaData
from sqlalchemy.exc import DBAPIError

log = logging.getLogger("tessera.db")

#: The execution option that runs a statement as a server-side prepared statement on PostgreSQL
#: (:func:`storage.db.server_prepared`).
SERVER_PREPARED = "tessera_server_prepared"
#: The execution option of a statement marked :data:`SERVER_PREPARED` naming SQL sent before it in the
#: same round trip (constants only, no ``%``; its rows are not read): the locks of ``storage.db``'s
#: gates.
PREFIX = "tessera_prefix"
_PREPARED_ON_CONNECTION = "tessera_prepared"
_PLACEHOLDER = re.compile(r"%%|%s|%\(([^)]+)\)s")


#: The most statements one connection prepares; beyond them a new statement runs as it is (its text
#: sent each time), so that statements composed per unit of work (``storage.db.flush_writes``) cannot
#: fill a long-lived connection with prepared statements.
MOST_PREPARED = 256


def prepared_text(info: dict, cursor: Any, statement: str, parameters: Any) -> tuple[str, Any]:
    """The ``EXECUTE`` of ``statement`` (its text, compiled, with psycopg2's ``%s`` or ``%(name)s``
    placeholders) and its ``parameters`` (a dict or a tuple), after its ``PREPARE`` on ``cursor``'s
    connection when that connection has not prepared it yet. ``info``: the pooled connection's
    ``info`` dict, where the names it prepared are kept (they go when the connection is closed or
    invalidated). A statement whose parameter types the server cannot tell without their values runs
    as it is (logged once per connection): inside a transaction its ``PREPARE`` goes behind a
    savepoint, in the same round trip, so that a failing one costs the transaction nothing. Past
    :data:`MOST_PREPARED` statements on the connection, a new one runs as it is."""
    prepared = info.setdefault(_PREPARED_ON_CONNECTION, {})
    if statement not in prepared:
        if len(prepared) >= MOST_PREPARED:
            return statement, parameters
        order: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match.group(0) == "%%":
                return "%"
            key = match.group(1) if match.group(1) is not None else str(len(order))
            if key not in order:
                order.append(key)
            return f"${order.index(key) + 1}"

        body = _PLACEHOLDER.sub(positional, statement)
        name = f"tessera_{len(prepared) + 1}"
        # the server's state, not the driver's mode: a transaction begun by a BEGIN of the platform's
        # own on an autocommit connection (storage.db.read_then_write) is one too
        in_transaction = cursor.connection.info.transaction_status != psycopg2.extensions.TRANSACTION_STATUS_IDLE
        try:
            if in_transaction:
                cursor.execute(f"SAVEPOINT {name}; PREPARE {name} AS {body}; RELEASE SAVEPOINT {name}")
            else:
                cursor.execute(f"PREPARE {name} AS {body}")
        except psycopg2.Error:
            if in_transaction:  # back to before the PREPARE: the transaction goes on
                cursor.execute(f"ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}")
            # a parameter whose type the server cannot tell without its value: run it as it is
            log.warning("a statement could not be prepared; it runs unprepared", exc_info=True)
            prepared[statement] = None
        else:
            prepared[statement] = (name, tuple(order))
    known = prepared[statement]
    if known is None:
        return statement, parameters
    name, order = known
    if not order:
        return f"EXECUTE {name}", parameters
    if isinstance(parameters, tuple):
        return f"EXECUTE {name} ({', '.join(['%s'] * len(order))})", parameters
    return f"EXECUTE {name} ({', '.join(f'%({key})s' for key in order)})", parameters


def execute_prepared(
    connection: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> tuple[str, Any]:
    """SQLAlchemy's ``before_cursor_execute`` hook (installed by ``storage.db`` where statements are
    server-prepared): the ``EXECUTE`` of a statement marked :data:`SERVER_PREPARED`, after its
    ``PREPARE`` when the connection has not prepared it yet (:func:`prepared_text`; a statement sent
    with ``exec_driver_sql`` is marked by that option in its ``execution_options``). The SQL a statement's
    :data:`PREFIX` option names goes before it, in the same round trip, prepared or not. Any other
    statement passes unchanged."""
    if context is None:
        return statement, parameters
    text, values = statement, parameters
    if not executemany and isinstance(parameters, dict | tuple) and context.execution_options.get(SERVER_PREPARED):
        text, values = prepared_text(connection.info, cursor, statement, parameters)
    prefix = context.execution_options.get(PREFIX)  # sent whether or not the statement is prepared
    return (f"{prefix}; {text}" if prefix else text), values


class DriverStatement:
    """A Core statement compiled once for a dialect: its text, its bind processors and, once it ran,
    its result's keys and processors (from the first run's cursor description). ``prepared``: it
    runs as a server-side prepared statement (else its text is sent each time)."""

    __slots__ = ("columns", "compiled", "dialect", "prepared", "text")

    def __init__(self, statement: Any, dialect: Any, prepared: bool) -> None:
        self.dialect = dialect
        self.prepared = prepared
        self.compiled: Any = statement.compile(dialect=dialect)
        self.text: str = self.compiled.string
        #: The result's keys and each column's result processor, set together on the first run (one
        #: assignment: a thread running it at the same time sees both or neither).
        self.columns: tuple[tuple[str, ...], tuple[Callable[[Any], Any] | None, ...]] | None = None

    def values(self, params: dict | None) -> dict[str, Any]:
        """``params`` as the driver takes them: every bind parameter's value (the statement's own
        where ``params`` names none), through its type's bind processor."""
        values = self.compiled.construct_params(params)
        for key, processor in self.compiled._bind_processors.items():
            if key in values:
                values[key] = processor(values[key])
        return values

    def result(self, cursor: Any) -> Result | None:
        """The rows of ``cursor``'s statement as SQLAlchemy's result (None when it returns none), each
        value through its column's result processor."""
        description = cursor.description
        if description is None:
            return None
        if self.columns is None:
            compiled = self.compiled._result_columns
            if len(compiled) != len(description):  # not the columns compiled: keys as the server names them
                self.columns = (tuple(item[0] for item in description), ())
            else:
                self.columns = (
                    tuple(str(column[0]) for column in compiled),
                    tuple(
                        column[3]._cached_result_processor(self.dialect, item[1])
                        for column, item in zip(compiled, description, strict=True)
                    ),
                )
        keys, processors = self.columns
        rows = cursor.fetchall()
        if any(processors):
            rows = [
                tuple(
                    value if processor is None else processor(value)
                    for processor, value in zip(processors, row, strict=True)
                )
                for row in rows
            ]
        return rows_result(keys, rows)


def rows_result(keys: Sequence[str], rows: list) -> Result:
    """``rows`` (tuples of values in the order of ``keys``) as SQLAlchemy's result."""
    return IteratorResult(SimpleResultMetaData(list(keys)), iter(rows))


#: The compiled form of each statement run on the driver, per statement object (kept alive by it;
#: None: one that runs through SQLAlchemy).
_COMPILED: dict[int, tuple[Any, Any, bool, DriverStatement | None]] = {}


def driver_statement(statement: Any, dialect: Any, *, prepared: bool) -> DriverStatement | None:
    """``statement`` compiled for ``dialect`` (to run as a server-side prepared statement when
    ``prepared``), built on its first run and kept (bounded: the statements run here are built once
    per process); None when it cannot run here (its text depends on its values: an expanding ``IN``)."""
    kept = _COMPILED.get(id(statement))
    if kept is not None and kept[0] is statement and kept[1] is dialect and kept[2] == prepared:
        return kept[3]
    compiled: DriverStatement | None = DriverStatement(statement, dialect, prepared)
    assert compiled is not None
    if compiled.compiled.post_compile_params or compiled.compiled.literal_execute_params:
        log.debug("a statement whose text depends on its values runs through SQLAlchemy: %.80s", compiled.text)
        compiled = None
    if len(_COMPILED) >= 512:
        _COMPILED.clear()
    _COMPILED[id(statement)] = (statement, dialect, prepared, compiled)
    return compiled


def runs_on_driver(engine: Engine, statement: Any = None) -> bool:
    """Whether ``engine``'s statements may run here: PostgreSQL through psycopg2, nothing listening
    to its connections or statements (beyond the prepared statements' own hook), and ``statement``
    (when given) marked :data:`SERVER_PREPARED`."""
    if engine.dialect.driver != "psycopg2":
        return False
    if statement is not None and not statement._execution_options.get(SERVER_PREPARED):
        return False
    dispatch = engine.dispatch
    if dispatch.engine_connect or dispatch.after_cursor_execute:
        return False
    return all(listener is execute_prepared for listener in dispatch.before_cursor_execute)


#: The server's transaction states of a connection inside a transaction (libpq's).
_OPEN = (psycopg2.extensions.TRANSACTION_STATUS_INTRANS, psycopg2.extensions.TRANSACTION_STATUS_INERROR)


@contextmanager
def driver_cursor(engine: Engine) -> Iterator[tuple[dict, Any]]:
    """The ``info`` dict and a cursor of a connection from ``engine``'s pool, for the block; the
    connection goes back to the pool after it, in the driver's mode the pool handed it out in
    (``storage.db.get_autocommit_engine``'s: autocommit), outside any transaction (one the block
    began and left open is rolled back). A driver error is raised as SQLAlchemy's
    wrapped error, without the query the driver sent (its values are interpolated into it); one
    that shows the server closed the connection invalidates the pool (the connections made before
    it are replaced), as SQLAlchemy's own execution does, and is raised with
    ``connection_invalidated`` set."""
    raw = engine.raw_connection()
    driver: Any = raw.dbapi_connection
    assert driver is not None  # a connection just checked out of the pool
    cursor = None
    try:
        cursor = driver.cursor()
        yield raw.info, cursor
    except psycopg2.Error as exc:
        closed = engine.dialect.is_disconnect(exc, driver, cursor)
        if closed:
            engine.pool._invalidate(raw, exc)
        raise DBAPIError.instance(
            None,  # not the cursor's query: the driver interpolated the values into it
            None,
            exc,
            psycopg2.Error,
            hide_parameters=True,
            connection_invalidated=closed,
            dialect=engine.dialect,
        ) from exc
    finally:
        if cursor is not None and not cursor.closed:
            cursor.close()
        if not driver.closed and driver.info.transaction_status in _OPEN:
            # a transaction the block began with its own BEGIN and could not end: not handed on
            with suppress(psycopg2.Error), driver.cursor() as ending:
                ending.execute("ROLLBACK")
        raw.close()


def execute(
    info: dict,
    cursor: Any,
    statement: DriverStatement,
    params: dict | None,
    *,
    prefix: str | None = None,
    suffix: str | None = None,
) -> Result | None:
    """Run ``statement`` with ``params`` (values of its bind parameters) on ``cursor``, as a
    prepared statement when it was compiled so; its rows (None when it returns none). ``prefix``: SQL
    sent before it in the same round trip (as :data:`PREFIX`); ``suffix``: after it (a ``COMMIT``,
    skipped by the server when ``statement`` fails; its rows are then not read: the driver keeps
    the last statement's)."""
    text, values = statement.text, statement.values(params)
    if statement.prepared:
        text, values = prepared_text(info, cursor, text, values)
    if prefix:
        text = f"{prefix}; {text}"
    cursor.execute(f"{text}; {suffix}" if suffix else text, values)
    return None if suffix else statement.result(cursor)


def execute_text(
    info: dict,
    cursor: Any,
    text: str,
    parameters: tuple,
    *,
    prepared: bool,
    prefix: str | None = None,
    suffix: str | None = None,
) -> None:
    """Run the driver-level SQL ``text`` with its positional ``parameters`` on ``cursor`` (as a
    prepared statement when ``prepared``); its rows are not read. ``prefix``: SQL sent before it in
    the same round trip (as :data:`PREFIX`); ``suffix``: after it (a ``COMMIT``: when ``text`` fails,
    the server skips it)."""
    if prepared:
        text, parameters = prepared_text(info, cursor, text, parameters)
    if prefix:
        text = f"{prefix}; {text}"
    cursor.execute(f"{text}; {suffix}" if suffix else text, parameters)
