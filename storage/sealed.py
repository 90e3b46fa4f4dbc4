"""Columns of sealed values, as a key rotation reads and rewrites them (``domain/keys``).

A :class:`SealedColumn` names a table's column of envelopes (``storage.crypto``), the purpose they
are sealed for, the SQL expression of the resource id bound into each (usually the row's id) and the
column of its tenant. The statements here are plain SQLAlchemy: the same on PostgreSQL and SQLite.
An envelope's first five bytes name its data key version (``0x02`` + 4 bytes; the first layout,
``0x01``, is version 1), so a rotation finds the values still under an older version in SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Table, func, literal, select, text, tuple_
from sqlmodel import Session

from storage.db import rowcount

#: The leading bytes of an envelope of each data key version (:func:`version_head`).
_V1, _V2 = b"\x01", b"\x02"


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


def stale_rows(
    session: Session, spec: SealedColumn, tenant_id: uuid.UUID, version: int, limit: int, after: tuple | None = None
) -> Sequence[Any]:
    """Up to ``limit`` rows of the tenant whose value is not sealed under ``version``, in primary key
    order after the key ``after`` (a keyset: each chunk reads only its own rows, however far the
    rotation got), locked (rows another transaction holds are skipped): their key columns (``key``
    is the tuple to pass as the next ``after``), the value (``sealed``) and the resource id's columns."""
    key = spec._key
    columns = {c.name: c for c in key}
    for name in (*spec.resource_parts, spec.resource, spec.tenant):
        if name in spec.table.c:
            columns.setdefault(name, spec.table.c[name])
    statement = select(*columns.values(), spec.table.c[spec.column].label("sealed")).where(
        *_stale(spec, tenant_id, version)
    )
    if after is not None:
        bound = tuple_(*(literal(value, c.type) for value, c in zip(after, key, strict=True)))
        statement = statement.where(tuple_(*key) > bound)
    statement = statement.order_by(*key).limit(limit).with_for_update(skip_locked=True)
    return session.execute(statement).all()


def key_of(spec: SealedColumn, row: Any) -> tuple:
    """The primary key of a row read by :func:`stale_rows` (the ``after`` of the next chunk)."""
    return tuple(getattr(row, c.name) for c in spec._key)


def _pg_type(column: ColumnElement) -> str:
    """The PostgreSQL element type of a key column's array (``uuid``, ``text``, ``bigint``...)."""
    name = type(column.type).__name__.lower()
    return "uuid" if "uuid" in name else "bigint" if "int" in name else "text"


def _resealing_statement(spec: SealedColumn, dialect: str):
    """The one statement of :func:`write_resealed` for ``spec`` (its SQL built once per process):
    on PostgreSQL an ``UPDATE ... FROM unnest(arrays)`` taking the whole chunk as array parameters;
    elsewhere the single-row form run once per row (executemany). The rows were read
    ``FOR UPDATE`` in the same transaction, so no other writer changed them since."""
    cached = _STATEMENTS.get((spec.name, dialect))
    if cached is not None:
        return cached
    names = [c.name for c in spec._key]
    column = spec.column
    if dialect == "postgresql":
        arrays = ", ".join(
            [*(f"CAST(:k_{n} AS {_pg_type(spec.table.c[n])}[])" for n in names), "CAST(:new AS bytea[])"]
        )
        columns = ", ".join([*(f"k_{n}" for n in names), "new"])
        matches = " AND ".join(f't."{n}" = v.k_{n}' for n in names)
        # identifiers from the platform's own table metadata; every value is a bound parameter
        sql = (
            f'UPDATE "{spec.table.name}" AS t SET "{column}" = v.new '  # noqa: S608
            f"FROM unnest({arrays}) AS v({columns}) WHERE {matches}"
        )
    else:
        matches = " AND ".join(f'"{n}" = :k_{n}' for n in names)
        sql = f'UPDATE "{spec.table.name}" SET "{column}" = :new WHERE {matches}'  # noqa: S608
    statement = text(sql)
    _STATEMENTS[(spec.name, dialect)] = statement
    return statement


_STATEMENTS: dict[tuple[str, str], Any] = {}


def write_resealed(session: Session, spec: SealedColumn, rows: Sequence[Any], sealed: Sequence[bytes]) -> int:
    """Write each row's new value (the rows read by :func:`stale_rows` in the caller's transaction,
    locked since): on PostgreSQL in one statement for the whole chunk. Returns how many changed."""
    if not rows:
        return 0
    names = [c.name for c in spec._key]
    dialect = session.get_bind().dialect.name
    statement = _resealing_statement(spec, dialect)
    if dialect == "postgresql":
        params: dict[str, Any] = {
            f"k_{n}": [
                str(getattr(row, n)) if isinstance(getattr(row, n), uuid.UUID) else getattr(row, n) for row in rows
            ]
            for n in names
        }
        params["new"] = list(sealed)
        return rowcount(session.execute(statement, params))
    each = [{**{f"k_{n}": getattr(row, n) for n in names}, "new": new} for row, new in zip(rows, sealed, strict=True)]
    return sum(rowcount(session.execute(statement, one)) for one in each)
