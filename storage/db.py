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
from typing import TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session as OrmSession
from sqlmodel import Session

from config.settings import get_settings

T = TypeVar("T")


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


def reset_engine() -> None:
    """Dispose of the process's engine (after a fork, or when tests change the settings)."""
    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()


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
_STATE_KEYS = "tessera_transaction_state"


def on_commit(session: OrmSession, callback: Callable[[], None]) -> None:
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
