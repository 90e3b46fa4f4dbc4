"""Token rows at rest: sealing and opening data, the rows a new token writes, reads as plain rows,
lookups (metadata and blind indexes), deletion, and the log rows and events of a change.

Data is sealed with ``keyring.encrypt(session, tenant, "token", id, json)``; search indexes are
``keyring.blind_index`` digests of rendered expressions (the values are never stored). The hot path
builds no ORM objects: a new token is a :class:`NewToken` staged as plain rows, and reads select the
columns of :class:`storage.models.Token` as rows (:func:`read_select`). A token whose ``expires_at``
has passed is not live (:func:`live`) and reads as missing everywhere at once.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import operator
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import orjson
from sqlalchemy import ColumnElement, FromClause, Select, and_, bindparam, delete, inspect, or_
from sqlalchemy import select as select_columns
from sqlmodel import Session, col, select

from config.settings import get_settings
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tenancy.usage import record_deleted_tokens
from domain.tokens.cards import without_cvc
from domain.webhooks import events
from infra.errors import not_found
from storage.crypto import get_keyring
from storage.db import Rows, read_first, server_prepared
from storage.models import Token, TokenMetadata, TokenSearchIndex
from storage.types import table_of, utcnow

#: The keyring purpose token data is sealed under (with the token's id as associated data).
DATA_PURPOSE = "token"


class TokenLike(Protocol):
    """What views, access rules, log rows and decryption read of a token: a :class:`Token`, a
    :class:`NewToken` or a row of :func:`read_select` (attribute names of :class:`Token`)."""

    @property
    def tenant_id(self) -> uuid.UUID: ...
    @property
    def id(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def data_ct(self) -> bytes: ...
    @property
    def mask(self) -> object: ...
    @property
    def containers(self) -> Sequence[Any]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...
    @property
    def search_indexes(self) -> Sequence[Any]: ...
    @property
    def fingerprint(self) -> str | None: ...
    @property
    def fingerprint_expression(self) -> str | None: ...
    @property
    def deduplicate_token(self) -> bool | None: ...
    @property
    def parent_id(self) -> str | None: ...
    @property
    def created_by(self) -> uuid.UUID | None: ...
    @property
    def created_at(self) -> dt.datetime: ...
    @property
    def modified_by(self) -> uuid.UUID | None: ...
    @property
    def modified_at(self) -> dt.datetime | None: ...
    @property
    def expires_at(self) -> dt.datetime | None: ...
    @property
    def cvc_expires_at(self) -> dt.datetime | None: ...


#: ``(attribute, column name)`` of every column of :class:`Token`: the one description of a token's row.
_COLUMNS = tuple((attribute.key, attribute.columns[0].name) for attribute in inspect(Token).column_attrs)
_COLUMN_NAMES = tuple(column for _, column in _COLUMNS)
_ATTRIBUTES = operator.attrgetter(*(attribute for attribute, _ in _COLUMNS))


@dataclass(slots=True)
class NewToken:
    """A token this unit of work writes as plain rows (no ORM object): the attributes of
    :class:`storage.models.Token` (its ``tokens`` row is :meth:`row`) and the rendered search index
    values whose blind-index rows go with it."""

    tenant_id: uuid.UUID
    id: str
    type: str
    data_ct: bytes
    mask: Any
    containers: list[str]
    meta: dict[str, str]
    search_indexes: list[str]
    fingerprint: str | None
    fingerprint_expression: str | None
    deduplicate_token: bool | None
    parent_id: str | None
    created_by: uuid.UUID | None
    created_at: dt.datetime
    expires_at: dt.datetime | None
    cvc_expires_at: dt.datetime | None
    index_values: list[str] = field(default_factory=list)
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = None

    def row(self) -> dict[str, Any]:
        """The ``tokens`` row: each column of :class:`Token` from the attribute of the same name."""
        return dict(zip(_COLUMN_NAMES, _ATTRIBUTES(self), strict=True))


def live(now: dt.datetime | ColumnElement[dt.datetime], tokens: FromClause | None = None) -> ColumnElement[bool]:
    """The condition of a live token: no ``expires_at``, or one after ``now`` (a time, or an SQL
    expression of one such as a lease statement's :data:`infra.jobs.LEASE_NOW`); over ``tokens``, an
    alias of the table, when given."""
    expires_at = (tokens if tokens is not None else table_of(Token)).c.expires_at  # Core statements use it too
    return or_(expires_at.is_(None), expires_at > now)


def seal(session: Session, tenant_id: uuid.UUID, token_id: str, data: Any) -> bytes:
    """The ciphertext of a token's data (compact UTF-8 JSON) under the tenant's key."""
    try:
        plain = orjson.dumps(data)
    except TypeError:  # an integer beyond 64 bits: the standard library writes it
        plain = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return get_keyring().encrypt(session, tenant_id, DATA_PURPOSE, token_id, plain)


def open_data(session: Session, token: TokenLike, now: dt.datetime) -> Any:
    """The plain data of a token; a card's cvc past its retention is left out even before the sweep."""
    return open_token_data(session, token.tenant_id, token.id, token.type, token.data_ct, token.cvc_expires_at, now=now)


def open_token_data(
    session: Session,
    tenant_id: uuid.UUID,
    token_id: str,
    type: str,
    data_ct: bytes,
    cvc_expires_at: dt.datetime | None,
    *,
    now: dt.datetime | None = None,
) -> Any:
    """The plain data of a token from its stored values (e.g. read by :func:`live_token_join`): a
    card's cvc past its retention is left out even before the sweep."""
    data = json.loads(get_keyring().decrypt(session, tenant_id, DATA_PURPOSE, token_id, data_ct))
    if cvc_expires_at is not None and cvc_expires_at <= (now or utcnow()):
        data = without_cvc(type, data)
    return data


@dataclass(frozen=True)
class LiveTokenJoin:
    """The live token a statement joins (:func:`live_token_join`): ``table``, to outer-join on the
    condition ``on``, and ``columns``, the values :func:`open_token_data` needs (``token_type``,
    ``token_data_ct``, ``token_cvc_expires_at``: NULL when the token is missing or expired)."""

    table: FromClause
    on: ColumnElement[bool]
    columns: dict[str, ColumnElement[Any]]


def live_token_join(tenant_id: Any, token_id: Any, now: ColumnElement[dt.datetime]) -> LiveTokenJoin:
    """What :func:`open_token_data` needs of the live token ``token_id`` of ``tenant_id`` (both SQL
    expressions over the statement's other tables, e.g. a payment method's columns), as a join by
    the tokens' primary key for one statement that reads the token beside its owner: a lease
    (:class:`infra.jobs.LeaseReads`) or a retry's read. Live at ``now``: the statement's own time,
    such as :data:`infra.jobs.LEASE_NOW`, never a time fixed when the statement was built, since a
    worker builds it once and keeps it. Like ``domain.tokens.service.load_token_data``, no
    permission check and no log row; the caller also counts the token's activity."""
    token = table_of(Token).alias("live_token")
    return LiveTokenJoin(
        token,
        and_(token.c.tenant_id == tenant_id, token.c.id == token_id, live(now, token)),
        {f"token_{name}": token.c[name] for name in ("type", "data_ct", "cvc_expires_at")},
    )


@functools.cache
def _live_token_read() -> Select:
    """The stored values :func:`open_token_data` needs of a tenant's live token (built once, planned
    once per connection)."""
    tokens = table_of(Token)
    now = bindparam("now", type_=tokens.c.created_at.type)
    return server_prepared(
        select_columns(tokens.c.type, tokens.c.data_ct, tokens.c.cvc_expires_at).where(
            tokens.c.tenant_id == bindparam("tenant_id", type_=tokens.c.tenant_id.type),
            tokens.c.id == bindparam("token_id", type_=tokens.c.id.type),
            live(now),
        )
    )


def live_token_data(
    session: Session,
    tenant_id: uuid.UUID,
    token_id: str,
    now: dt.datetime,
    *,
    read: Callable[[Any, dict], Any] = read_first,
) -> tuple[str, Any] | None:
    """``(type, plain data)`` of the live token ``token_id`` of ``tenant_id`` at ``now`` (what
    ``domain.tokens.service.load_token_data`` reads, for a hot path): one prepared statement read
    outside the session's transaction (``storage.db.read_first``: it sees what was committed, as a
    first statement in the transaction would, and leaves the session without a transaction, so a
    unit of work whose only write follows can send it as its whole transaction), no ORM object, or
    by ``read`` (``(statement, params) -> first row``: ``storage.db.ReadThenWrite.read_first``, the first
    statement of a unit of work that reads once, then inserts). The session is the tenant's key's
    (read through it on a cache miss). None when the token is missing or expired. No permission
    check, no log row and no activity: the caller does them."""
    row = read(_live_token_read(), {"tenant_id": tenant_id, "token_id": token_id, "now": now})
    if row is None:
        return None
    kind, data_ct, cvc_expires_at = row
    return kind, open_token_data(session, tenant_id, token_id, kind, data_ct, cvc_expires_at, now=now)


def cvc_expiry(kind: str, data: Any, now: dt.datetime) -> dt.datetime | None:
    """When a card's ``cvc`` is dropped (``cvc_retention_seconds`` after ``now``); None without one."""
    if kind == "card" and isinstance(data, dict) and data.get("cvc"):
        return now + dt.timedelta(seconds=get_settings().cvc_retention_seconds)
    return None


def get_live(session: Session, tenant_id: uuid.UUID, token_id: str, now: dt.datetime, *, lock: bool = False) -> Token:
    """The live token (ORM object, row-locked with ``lock``); a 404 problem when missing or expired."""
    stmt = select(Token).where(Token.tenant_id == tenant_id, Token.id == token_id, live(now))
    token = session.exec(stmt.with_for_update() if lock else stmt).first()
    if token is None:
        raise not_found("token")
    return token


def read_select() -> Select:
    """``SELECT`` of every column of tokens as plain rows, not ORM objects, for reads (attribute
    names of :class:`Token`)."""
    return select_columns(*(getattr(Token, attribute) for attribute, _ in _COLUMNS))


def read_rows(session: Session, stmt: Select) -> list[TokenLike]:
    """The rows of a :func:`read_select` statement: plain rows with the attributes of :class:`Token`."""
    return cast("list[TokenLike]", session.execute(stmt).all())


def get_live_row(session: Session, tenant_id: uuid.UUID, token_id: str, now: dt.datetime) -> TokenLike:
    """A live token as a plain row (404 problem when missing or expired), for reads."""
    where = (col(Token.tenant_id) == tenant_id, col(Token.id) == token_id, live(now))
    rows = read_rows(session, read_select().where(*where).limit(1))
    if not rows:
        raise not_found("token")
    return rows[0]


def descendants(session: Session, tenant_id: uuid.UUID, root: Token) -> list[Token]:
    """``root`` and every token below it (children, their children ...), each once."""
    found = {root.id: root}
    frontier = [root.id]
    while frontier:
        rows = session.exec(
            select(Token).where(col(Token.tenant_id) == tenant_id, col(Token.parent_id).in_(frontier))
        ).all()
        frontier = [t.id for t in rows if t.id not in found]
        found.update((t.id, t) for t in rows)
    return list(found.values())


def write_lookups(session: Session, token: Token, index_values: Iterable[str], *, replace: bool) -> None:
    """(Re)write the metadata rows and blind-index rows of a stored ``token``."""
    if replace:
        session.flush()  # rows of this token still pending must be written before they are replaced
        _delete_lookups(session, token.tenant_id, [token.id])
    session.add_all(
        TokenMetadata(tenant_id=token.tenant_id, token_id=token.id, key=k, value=v)
        for k, v in (token.meta or {}).items()
    )
    keyring = get_keyring()
    digests = {keyring.blind_index(session, token.tenant_id, value) for value in index_values}
    session.add_all(TokenSearchIndex(tenant_id=token.tenant_id, token_id=token.id, digest=d) for d in digests)


_TOKENS, _METADATA, _INDEXES = table_of(Token), table_of(TokenMetadata), table_of(TokenSearchIndex)


def stage_new_token(session: Session, rows: Rows, token: NewToken) -> None:
    """Queue the ``tokens`` row of a new token with its metadata and blind-index rows."""
    rows.add(_TOKENS, token.row())
    for key, value in token.meta.items():
        rows.add(_METADATA, {"tenant_id": token.tenant_id, "token_id": token.id, "key": key, "value": value})
    keyring = get_keyring()
    for digest in dict.fromkeys(keyring.blind_index(session, token.tenant_id, v) for v in token.index_values):
        rows.add(_INDEXES, {"tenant_id": token.tenant_id, "token_id": token.id, "digest": digest})


def delete_rows(session: Session, tenant_id: uuid.UUID, token_ids: list[str]) -> None:
    """Delete tokens with their metadata and blind-index rows; each stays counted as active in the
    month it was created (``domain.tenancy.usage.record_deleted_tokens``)."""
    _delete_lookups(session, tenant_id, token_ids)
    gone = session.execute(
        delete(Token)
        .where(col(Token.tenant_id) == tenant_id, col(Token.id).in_(token_ids))
        .returning(col(Token.id), col(Token.created_at))
    ).all()
    record_deleted_tokens(session, tenant_id, gone)


def _delete_lookups(session: Session, tenant_id: uuid.UUID, token_ids: list[str]) -> None:
    """Delete the metadata and blind-index rows of tokens."""
    for table in (TokenMetadata, TokenSearchIndex):
        session.execute(delete(table).where(col(table.tenant_id) == tenant_id, col(table.token_id).in_(token_ids)))


def touch(session: Session, rows: Rows, caller: Caller, token: TokenLike, operation: str, event: str | None) -> None:
    """Queue in ``rows`` a log row for ``operation`` and, when ``event`` is named, the event
    ``token.<event>`` (written only when a webhook of the tenant subscribes to it). Events carry
    ``{"token": {"id", "type"}}`` only, never data."""
    audit.stage(rows, caller, entity_type=token.type, entity_id=token.id, operation=operation)
    if event:
        events.emit(
            session,
            tenant_id=token.tenant_id,
            type=f"token.{event}",
            data={"token": {"id": token.id, "type": token.type}},
            trace_id=caller.trace_id,
            rows=rows,
        )
