"""The database engine and the session factory.

One engine per process, made on first use from the settings. A unit of work is::

    with session_scope() as session:
        ...  # commits on success, rolls back on any exception

SQLite (the embedded default) runs in WAL mode with a busy timeout so the api, the worker and beat
can share the file.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session as OrmSession
from sqlmodel import Session

from config.settings import get_settings


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
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


@functools.cache
def get_engine() -> Engine:
    """The process's engine for the configured database."""
    settings = get_settings()
    return make_engine(settings.effective_database_url, pool_size=settings.db_pool_size)


@functools.cache
def get_lease_engine() -> Engine | None:
    """The process's engine for statements whose loss in a database crash is harmless (taking a
    job's lease: lost, the job is taken again with the same idempotency key): PostgreSQL only,
    autocommit (one statement, one round trip) without waiting for the WAL flush
    (``synchronous_commit=off``). None on SQLite: use :func:`session_scope`."""
    settings = get_settings()
    if not settings.effective_database_url.startswith("postgresql"):
        return None
    return create_engine(settings.effective_database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_pool_size, pool_pre_ping=True, isolation_level="AUTOCOMMIT",
                         connect_args={"options": "-c synchronous_commit=off"})


def reset_engine() -> None:
    """Dispose of the process's engines (after a fork, or when tests change the settings)."""
    for cached in (get_engine, get_lease_engine):
        if cached.cache_info().currsize and cached() is not None:
            cached().dispose()
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


_ON_COMMIT = "tessera_on_commit"


def on_commit(session: OrmSession, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once ``session``'s transaction commits (dropped if it rolls back)."""
    callbacks = session.info.setdefault(_ON_COMMIT, [])
    if callback not in callbacks:
        callbacks.append(callback)


@event.listens_for(OrmSession, "after_commit")
def _run_on_commit(session: OrmSession) -> None:
    if session.in_nested_transaction():  # a SAVEPOINT ended; the real transaction goes on
        return
    for callback in session.info.pop(_ON_COMMIT, ()):
        callback()


@event.listens_for(OrmSession, "after_rollback")
def _drop_on_commit(session: OrmSession) -> None:
    if session.in_nested_transaction():
        return
    session.info.pop(_ON_COMMIT, None)
