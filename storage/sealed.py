"""Columns of sealed values, as a key rotation reads and rewrites them (``domain/keys``).

A :class:`SealedColumn` names a table's column of envelopes (``storage.crypto``), the purpose they
are sealed for, the SQL expression of the resource id bound into each (usually the row's id) and the
column of its tenant. The reads are plain SQLAlchemy, the same on PostgreSQL and SQLite; the write of
a chunk is one ``UPDATE ... FROM unnest`` on PostgreSQL (rows found by ``ctid``), one statement per
row elsewhere.
An envelope's first five bytes name its data key version (``0x02`` + 4 bytes; the first layout,
``0x01``, is version 1), so a rotation finds the values still under an older version in SQL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import ColumnElement, String, Table, cast, func, literal, literal_column, select, text, tuple_
from sqlmodel import Session

from storage.crypto import DecryptionError, Keyring, envelope_version
from storage.db import rowcount

#: The leading bytes of an envelope of each data key version (:func:`version_head`), and the sizes
#: of its nonce and tag (``storage.crypto``).
_V1, _V2 = b"\x01", b"\x02"
_NONCE, _TAG = 12, 16


def version_head(version: int) -> bytes:
    """The first five bytes of an envelope sealed under ``version`` with today's layout."""
    return _V2 + version.to_bytes(4, "big")


def version_of_head(head: bytes) -> int:
    """The version named by an envelope's first bytes (1 for the first layout)."""
    return int.from_bytes(head[1:5], "big") if head[:1] == _V2 else 1


@dataclass(frozen=True)
class SealedColumn:
    """One column of sealed values: ``table``'s ``column`` holds envelopes sealed for ``purpose``,
    bound to the resource id ``resource(table)`` (an SQL expression, a string) of tenant
    ``tenant`` (a column name)."""

    table: Table
    column: str
    purpose: str
    resource: str = "id"
    tenant: str = "tenant_id"
    #: The resource id built from several columns, joined by ``:`` (instead of ``resource``).
    resource_parts: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.table.name}.{self.column}"

    def resource_of(self, row: Any) -> str:
        """The resource id of a row read by :func:`stale_rows`."""
        if self.resource_parts:
            return ":".join(str(getattr(row, part)) for part in self.resource_parts)
        return str(getattr(row, self.resource))

    @property
    def _key(self) -> list[ColumnElement]:
        return [self.table.c[name] for name in (c.name for c in self.table.primary_key.columns)]


def _stale(spec: SealedColumn, tenant_id: uuid.UUID, version: int) -> list[ColumnElement]:
    column = spec.table.c[spec.column]
    return [
        spec.table.c[spec.tenant] == tenant_id,
        column.is_not(None),
        func.substr(column, 1, 5) != literal(version_head(version)),
    ]


def count_stale(session: Session, spec: SealedColumn, tenant_id: uuid.UUID, version: int) -> int:
    """How many values of a tenant in this column are not sealed under ``version``."""
    return session.execute(
        select(func.count()).select_from(spec.table).where(*_stale(spec, tenant_id, version))
    ).scalar_one()


def count_by_version(session: Session, spec: SealedColumn, tenant_id: uuid.UUID) -> dict[int, int]:
    """The tenant's values in this column by the data key version that sealed them."""
    column = spec.table.c[spec.column]
    head = func.substr(column, 1, 5)
    rows = session.execute(
        select(head, func.count()).where(spec.table.c[spec.tenant] == tenant_id, column.is_not(None)).group_by(head)
    ).all()
    counted: dict[int, int] = {}
    for found, number in rows:
        version = version_of_head(bytes(found))
        counted[version] = counted.get(version, 0) + number
    return counted


def _is_uuid(column: ColumnElement) -> bool:
    return "uuid" in type(column.type).__name__.lower()


def stale_rows(
    session: Session, spec: SealedColumn, tenant_id: uuid.UUID, version: int, limit: int, after: tuple | None = None
) -> Sequence[Any]:
    """Up to ``limit`` rows of the tenant whose value is not sealed under ``version``, in primary key
    order after the key ``after`` (a keyset: each chunk reads only its own rows, however far the
    rotation got): their key columns (:func:`key_of` gives the next ``after``), the value
    (``sealed``) and the resource id's columns; on PostgreSQL also where the row was read
    (``row_ctid``), and UUID columns as text (no object per row). Nothing is locked:
    :func:`write_resealed` writes a row only if its value is still the one read here, so the
    tenant's own writes never wait for a rotation's reads."""
    key = spec._key
    postgresql = session.get_bind().dialect.name == "postgresql"
    columns = {c.name: c for c in key}
    for name in (*spec.resource_parts, spec.resource, spec.tenant):
        if name in spec.table.c:
            columns.setdefault(name, spec.table.c[name])
    selected: list[Any] = [
        cast(c, String).label(name) if postgresql and _is_uuid(c) else c for name, c in columns.items()
    ]
    selected.append(spec.table.c[spec.column].label("sealed"))
    if postgresql:
        selected.append(literal_column("ctid", String).label("row_ctid"))  # where write_resealed finds it
    statement = select(*selected).where(*_stale(spec, tenant_id, version))
    if after is not None:
        # With the key's leading tenant column fixed by ``_stale``, only the columns after it are
        # compared: PostgreSQL starts the index scan at ``after`` then, where ``(tenant, id) > (...)``
        # beside ``tenant = ...`` starts it at the tenant's first row (each chunk read the longer
        # the farther the sweep got).
        compared = list(zip(after, key, strict=True))
        if key[0].name == spec.tenant:
            compared = compared[1:]
            if not compared:  # the key is the tenant's own: its one row is done
                return []
        if len(compared) == 1:
            value, column = compared[0]
            statement = statement.where(column > literal(value, column.type))
        else:
            bound = tuple_(*(literal(value, c.type) for value, c in compared))
            statement = statement.where(tuple_(*(c for _, c in compared)) > bound)
    statement = statement.order_by(*key).limit(limit)
    return session.execute(statement).all()


def reseal_values(
    keyring: Keyring,
    session: Session,
    tenant_id: uuid.UUID,
    purpose: str,
    resource_ids: Sequence[str],
    envelopes: Sequence[bytes],
    version: int,
) -> list[bytes]:
    """:meth:`~storage.crypto.Keyring.reseal` of a chunk of one tenant's values of one purpose: the
    ``i``-th envelope, bound to ``resource_ids[i]``, sealed again under ``version``, in the same
    order. Each key is looked up and its AES-GCM object made once per chunk, and the nonces are
    drawn in one read of the system's random source. Raises
    :class:`~storage.crypto.DecryptionError` like :meth:`~storage.crypto.Keyring.decrypt`."""
    target = AESGCM(keyring.data_key(session, tenant_id, version))
    head = version_head(version)
    openers: dict[bytes, AESGCM] = {}
    prefix = f"{purpose}:{tenant_id}:"
    nonces = os.urandom(_NONCE * len(envelopes))
    resealed: list[bytes] = []
    append = resealed.append
    for index, (resource_id, envelope) in enumerate(zip(resource_ids, envelopes, strict=True)):
        start = 5 if envelope[:1] == _V2 else 1
        opener = openers.get(envelope[:start])
        if opener is None:
            opener = openers[envelope[:start]] = AESGCM(
                keyring.data_key(session, tenant_id, envelope_version(envelope))
            )
        if len(envelope) < start + _NONCE + _TAG:
            raise DecryptionError("malformed envelope")
        aad = (prefix + resource_id).encode()
        try:
            plain = opener.decrypt(envelope[start : start + _NONCE], envelope[start + _NONCE :], aad)
        except InvalidTag as exc:
            raise DecryptionError("ciphertext does not authenticate") from exc
        nonce = nonces[index * _NONCE : (index + 1) * _NONCE]
        append(head + nonce + target.encrypt(nonce, plain, aad))
    return resealed


def key_of(spec: SealedColumn, row: Any) -> tuple:
    """The primary key of a row read by :func:`stale_rows` (the ``after`` of the next chunk)."""
    return key_from(spec, [getattr(row, c.name) for c in spec._key])


def key_from(spec: SealedColumn, values: Sequence[Any]) -> tuple:
    """A primary key of ``spec``'s table from its values as JSON keeps them (UUIDs as text)."""
    return tuple(
        uuid.UUID(value) if isinstance(value, str) and _is_uuid(c) else value
        for c, value in zip(spec._key, values, strict=True)
    )


#: The leading bytes of an envelope that hold its nonce (``0x02`` + version + nonce; the first
#: layout's are its nonce and the start of its ciphertext): equal only for the very value read.
_NONCE_PREFIX = 17


def _resealing_statement(spec: SealedColumn, dialect: str):
    """The one statement of :func:`write_resealed` for ``spec`` (its SQL built once per process).

    On PostgreSQL an ``UPDATE ... FROM unnest(arrays)`` taking the whole chunk as three array
    parameters: each row is found by the ``ctid`` it was read at (no index lookup; a row updated
    since has another and is not matched), and written only where its value still begins with the
    nonce read (a value the tenant wrote meanwhile is kept; a later sweep of the rotation finds it
    if it is still under an older version). Elsewhere the single-row form run once per row, by
    primary key and the whole value read."""
    cached = _STATEMENTS.get((spec.name, dialect))
    if cached is not None:
        return cached
    column = spec.column
    if dialect == "postgresql":
        # identifiers from the platform's own table metadata; every value is a bound parameter
        sql = (
            f'UPDATE "{spec.table.name}" AS t SET "{column}" = v.new '  # noqa: S608
            "FROM unnest(CAST(:ctid AS tid[]), CAST(:old AS bytea[]), CAST(:new AS bytea[])) AS v(row_ctid, old, new) "
            f'WHERE t.ctid = v.row_ctid AND t."{spec.tenant}" = CAST(:tenant AS uuid) '
            f'AND substr(t."{column}", 1, {_NONCE_PREFIX}) = v.old'
        )
    else:
        matches = " AND ".join([*(f'"{c.name}" = :k_{c.name}' for c in spec._key), f'"{column}" = :old'])
        sql = f'UPDATE "{spec.table.name}" SET "{column}" = :new WHERE {matches}'  # noqa: S608
    statement = text(sql)
    _STATEMENTS[(spec.name, dialect)] = statement
    return statement


_STATEMENTS: dict[tuple[str, str], Any] = {}


def _array_literal(items: Iterable[str]) -> str:
    """A PostgreSQL array literal of already quoted elements (one text parameter, parsed at once)."""
    return "{" + ",".join(items) + "}"


def write_resealed(
    session: Session, spec: SealedColumn, tenant_id: uuid.UUID, rows: Sequence[Any], sealed: Sequence[bytes]
) -> int:
    """Write each row's new value (``sealed[i]`` for ``rows[i]``, the tenant's rows read by
    :func:`stale_rows`) where the row still holds the value read: on PostgreSQL in one statement
    for the whole chunk. Returns how many changed (a row the tenant rewrote since it was read is not)."""
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    statement = _resealing_statement(spec, dialect)
    if dialect == "postgresql":
        # A chunk's commit need not wait for its WAL flush: lost in a crash, it is resealed again (its
        # progress is lost with it), and the commit that destroys a retiring key flushes it first.
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))
        params = {
            "tenant": str(tenant_id),
            "ctid": _array_literal(f'"{row.row_ctid}"' for row in rows),
            "old": _array_literal(f'"\\\\x{row.sealed[:_NONCE_PREFIX].hex()}"' for row in rows),
            "new": _array_literal(f'"\\\\x{new.hex()}"' for new in sealed),
        }
        return rowcount(session.execute(statement, params))
    names = [c.name for c in spec._key]
    each = [
        {**{f"k_{n}": getattr(row, n) for n in names}, "old": row.sealed, "new": new}
        for row, new in zip(rows, sealed, strict=True)
    ]
    return sum(rowcount(session.execute(statement, one)) for one in each)
