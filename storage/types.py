"""Column types shared by the models."""

from __future__ import annotations

import datetime as dt
import os
import threading
import uuid

from sqlalchemy import Column, DateTime, Table, Uuid
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeDecorator
from sqlmodel import AutoString, SQLModel


def utcnow() -> dt.datetime:
    """The current time as an aware UTC datetime (microsecond precision)."""
    return dt.datetime.now(dt.UTC)


#: Random bytes fetched per ``os.urandom`` call by :func:`random_bytes` (256 ids).
_RANDOM_BATCH = 4096
_random = threading.local()
_forks = 0  # counts forks into this process: a child drops the bytes it inherited


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def random_bytes(count: int) -> bytes:
    """``count`` bytes of ``os.urandom`` output (AES-GCM nonces, ids), taken from a per-thread buffer
    refilled 4 KiB at a time: one system call per few hundred values instead of one per value.
    Each such call releases the interpreter lock, and under load the thread then waits for another
    to hand it back (up to the switch interval, 5 ms): a unit of work sealing and naming a few
    values per token would wait that long several times. Bytes are handed out once: never to two
    threads, never twice, and a forked child never uses those of its parent (it would repeat its
    nonces and ids). ``count`` above 1 KiB goes to ``os.urandom`` directly."""
    if count > 1024:
        return os.urandom(count)
    state = _random
    buffer = getattr(state, "buffer", b"")
    offset = getattr(state, "offset", 0)
    if offset + count > len(buffer) or state.forks != _forks:
        buffer = state.buffer = os.urandom(_RANDOM_BATCH)
        state.forks = _forks
        offset = 0
    state.offset = offset + count
    return buffer[offset : offset + count]


def random_uuid() -> uuid.UUID:
    """A random (version 4) UUID, as ``uuid.uuid4()`` makes it, from :func:`random_bytes`.

    Its 128-bit value is set directly, with the version and variant bits ``uuid.UUID(bytes=...,
    version=4)`` sets: that constructor's checks of its arguments cost about twice the rest, three
    times per token created (the token's id, its log row's, its event's)."""
    value = object.__new__(uuid.UUID)
    _set(value, "int", int.from_bytes(random_bytes(16)) & _NOT_VERSION_OR_VARIANT | _VERSION_4_RFC_4122)
    _set(value, "is_safe", uuid.SafeUUID.unknown)
    return value


_set = object.__setattr__  # uuid.UUID refuses attribute assignment (it is immutable)
_NOT_VERSION_OR_VARIANT = ((1 << 128) - 1) & ~((0xF000 << 64) | (0xC000 << 48))
_VERSION_4_RFC_4122 = (4 << 76) | (0x8000 << 48)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL stores ``timestamptz``; SQLite stores text without a zone, so values are normalised to
    UTC on the way in and given ``tzinfo=UTC`` on the way out. Naive datetimes are refused.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


def ts_column(*, nullable: bool = False, index: bool = False) -> Column:
    """A UTC timestamp column for a SQLModel field's ``sa_column``."""
    return Column(UTCDateTime(), nullable=nullable, index=index)


class TextAsUuid(FunctionElement):
    """A text column holding a UUID (``"1b4e28ba-2fa1-11d2-883f-0016d3cca427"``) compared with a UUID
    column in SQL: ``CAST(x AS UUID)`` on PostgreSQL; on SQLite, where UUIDs are stored as 32 hex
    digits, ``x`` without its dashes."""

    type = Uuid()
    inherit_cache = True
    name = "text_as_uuid"


@compiles(TextAsUuid)
def _text_as_uuid(element: TextAsUuid, compiler, **kw) -> str:
    return f"CAST({compiler.process(next(iter(element.clauses)), **kw)} AS UUID)"


@compiles(TextAsUuid, "sqlite")
def _text_as_uuid_sqlite(element: TextAsUuid, compiler, **kw) -> str:
    return f"lower(replace({compiler.process(next(iter(element.clauses)), **kw)}, '-', ''))"


def state_type(length: int = 16) -> AutoString:
    """The column type of a state field annotated with a ``StrEnum`` of :mod:`storage.states`: plain
    ``VARCHAR(length)`` (SQLModel would otherwise make a database enum type of it)."""
    return AutoString(length=length)


def table_of(model: type[SQLModel]) -> Table:
    """The Core table of a SQLModel table class, typed (SQLModel sets ``__table__`` without declaring it)."""
    return model.__table__  # type: ignore[attr-defined]  # set by SQLModel's metaclass on table=True classes
