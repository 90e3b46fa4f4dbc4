"""Loading what proxy expressions read: tokens, network tokens, token intents, encrypted payloads.

:class:`ValueLoader` is the interface detokenization resolves ids through; :class:`SqlValueLoader`
is the platform's implementation on the database (one query per kind of id, values decrypted with
the tenant's data key). No permission check and no log row here: :mod:`domain.proxy.detokenize`
checks rights on what is returned before any value is rendered.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import bindparam
from sqlalchemy import inspect as sa_inspect
from sqlmodel import Session, col, or_, select

from domain.client_keys.service import decrypt_encrypted_header
from domain.network_tokens import token_intents
from domain.network_tokens import views as network_tokens
from domain.tenancy.usage import record_token_activity, stage_token_activity
from domain.tokens.access import FULL
from domain.tokens.store import DATA_PURPOSE
from domain.tokens.views import token_view
from domain.wallets import service as wallets
from infra.lookup import parse_uuid
from storage.crypto import get_keyring
from storage.db import Rows
from storage.models import Token
from storage.models_network_tokens import NetworkToken, TokenIntent
from storage.states import NetworkTokenStatus
from storage.types import utcnow

TOKEN, NETWORK_TOKEN, TOKEN_INTENT = "token", "network_token", "token_intent"
WALLET_A, WALLET_B = wallets.WALLET_A, wallets.WALLET_B
KINDS: tuple[str, ...] = (TOKEN, NETWORK_TOKEN, TOKEN_INTENT, WALLET_A, WALLET_B)
#: The live tokens of a tenant among ``ids`` at ``now``, as plain rows of the columns the token's view and
#: its decryption read (attribute names as labels): a Core statement built once (no ORM objects, no
#: statement to build per request), run with ``tenant_id``, ``ids`` and ``now``.
_TOKEN_COLUMNS = sa_inspect(Token).columns
_TOKENS_BY_ID = select(
    *(
        _TOKEN_COLUMNS[name].label(name)
        for name in (
            "tenant_id",
            "id",
            "type",
            "data_ct",
            "mask",
            "containers",
            "meta",
            "search_indexes",
            "fingerprint",
            "fingerprint_expression",
            "deduplicate_token",
            "parent_id",
            "created_by",
            "created_at",
            "modified_by",
            "modified_at",
            "expires_at",
            "cvc_expires_at",
        )
    )
).where(
    _TOKEN_COLUMNS["tenant_id"] == bindparam("tenant_id"),
    _TOKEN_COLUMNS["id"].in_(bindparam("ids", expanding=True)),
    or_(_TOKEN_COLUMNS["expires_at"].is_(None), _TOKEN_COLUMNS["expires_at"] > bindparam("now")),
)
#: Where a token intent's card would be placed once converted: its rights are those of card tokens.
INTENT_CONTAINERS = ("/pci/high/",)


@dataclass(frozen=True)
class Loaded:
    """One resolved id.

    ``data`` is the plain data (``{{ <id> }}`` reads it); ``record`` the object the ``<kind>: <id>``
    forms read (``$.data.number``, ``$.metadata.x``...), JSON-ready (ids and times as strings);
    ``containers`` decide the right needed to use it (none for a network token); ``usable`` is
    False with ``reason`` for an id that exists but cannot be used (a network token that is not
    active).
    """

    kind: str
    id: str
    data: Any
    record: dict
    containers: tuple[str, ...]
    usable: bool = True
    reason: str | None = None


class ValueLoader(Protocol):
    """What detokenization needs from the platform."""

    def load(self, tenant_id: uuid.UUID, kind: str, ids: Sequence[str]) -> dict[str, Loaded]:
        """The live values of ``ids`` of one ``kind`` (:data:`KINDS`) in the tenant, in one query;
        ids not found (missing, expired, another tenant's) are absent from the result."""
        ...

    def open_encrypted(self, tenant_id: uuid.UUID, header_value: str) -> dict:
        """The decrypted ``<prefix>-ENCRYPTED`` payloads (Proxy rule 8): for the single form the
        payload ``{type, data, ...}``, for the multiple form ``{name: payload}``. Raises a 400
        problem with per-field errors when it cannot be opened."""
        ...


def _jsonable(value: Any) -> Any:
    if isinstance(value, (uuid.UUID,)):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"unsupported type {type(value).__name__}")


def plain(view: dict) -> dict:
    """``view`` with ids and timestamps as JSON strings, as an expression sees it (a copy: tuples as
    lists, keys as strings)."""
    return _plain(view)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return _jsonable(value)


class SqlValueLoader:
    """:class:`ValueLoader` on the database, in the caller's session (one query per kind).

    Detokenized tokens are counted as used this month (``token_activity``, the usage report): written
    at once, or queued in ``rows`` when given (for the caller to insert with its other rows in one
    statement, :func:`storage.db.stage_rows`).
    """

    def __init__(self, session: Session, *, now: dt.datetime | None = None, rows: Rows | None = None):
        self.session = session
        self.now = now or utcnow()
        self.rows = rows

    def load(self, tenant_id: uuid.UUID, kind: str, ids: Sequence[str]) -> dict[str, Loaded]:
        """See :meth:`ValueLoader.load`."""
        if not ids:
            return {}
        if kind == TOKEN:
            return self._tokens(tenant_id, ids)
        if kind == NETWORK_TOKEN:
            return self._network_tokens(tenant_id, ids)
        if kind == TOKEN_INTENT:
            return self._intents(tenant_id, ids)
        if kind in (WALLET_A, WALLET_B):  # reading a wallet token is its cryptogram's one use
            found = wallets.load_for_proxy(self.session, tenant_id, kind, ids, now=self.now)
            return {i: Loaded(kind, i, record["data"], record, ()) for i, record in found.items()}
        raise ValueError(f"unknown kind {kind!r}")

    def _decrypt(self, tenant_id: uuid.UUID, purpose: str, resource_id: object, ciphertext: bytes) -> Any:
        return json.loads(get_keyring().decrypt(self.session, tenant_id, purpose, str(resource_id), ciphertext))

    def _tokens(self, tenant_id: uuid.UUID, ids: Sequence[str]) -> dict[str, Loaded]:
        rows = (
            self.session.connection()
            .execute(  # in the session's transaction
                _TOKENS_BY_ID, {"tenant_id": tenant_id, "ids": list(ids), "now": self.now}
            )
            .all()
        )
        found = {}
        for row in rows:
            data = self._decrypt(tenant_id, DATA_PURPOSE, row.id, row.data_ct)
            if row.cvc_expires_at is not None and row.cvc_expires_at <= self.now and isinstance(data, dict):
                data.pop("cvc", None)  # past its retention, as everywhere else
            record = plain(token_view(row, data, None, access=FULL))  # type: ignore[arg-type]
            record["data"] = data
            found[row.id] = Loaded(TOKEN, row.id, data, record, tuple(row.containers or ()))
        if self.rows is not None:
            stage_token_activity(self.rows, tenant_id, list(found), now=self.now)
        else:
            record_token_activity(self.session, tenant_id, list(found), now=self.now)
        return found

    def _network_tokens(self, tenant_id: uuid.UUID, ids: Sequence[str]) -> dict[str, Loaded]:
        wanted = {parse_uuid(i): i for i in ids if parse_uuid(i) is not None}
        if not wanted:
            return {}
        rows = self.session.exec(
            select(NetworkToken).where(col(NetworkToken.tenant_id) == tenant_id, col(NetworkToken.id).in_(list(wanted)))
        ).all()
        found = {}
        for row in rows:
            data = (
                self._decrypt(tenant_id, network_tokens.DATA_PURPOSE, row.id, row.data_ct)
                if row.data_ct is not None
                else None
            )
            record = plain(network_tokens.network_token_view(row, data, reveal=True))
            usable = row.status == NetworkTokenStatus.ACTIVE and data is not None
            found[wanted[row.id]] = Loaded(
                NETWORK_TOKEN,
                wanted[row.id],
                record.get("data"),
                record,
                (),
                usable,
                None if usable else f"The network token {row.id} is {row.status}; it cannot be used.",
            )
        return found

    def _intents(self, tenant_id: uuid.UUID, ids: Sequence[str]) -> dict[str, Loaded]:
        wanted = {parse_uuid(i): i for i in ids if parse_uuid(i) is not None}
        if not wanted:
            return {}
        rows = self.session.exec(
            select(TokenIntent).where(
                col(TokenIntent.tenant_id) == tenant_id,
                col(TokenIntent.id).in_(list(wanted)),
                col(TokenIntent.expires_at) > self.now,
            )
        ).all()
        found = {}
        for row in rows:
            data = self._decrypt(tenant_id, token_intents.DATA_PURPOSE, row.id, row.data_ct)
            if row.cvc_expires_at is not None and row.cvc_expires_at <= self.now:
                data.pop("cvc", None)
            record = plain(token_intents.intent_view(row, data))
            record["data"] = data
            found[wanted[row.id]] = Loaded(TOKEN_INTENT, wanted[row.id], data, record, INTENT_CONTAINERS)
        return found

    def open_encrypted(self, tenant_id: uuid.UUID, header_value: str) -> dict:
        """See :meth:`ValueLoader.open_encrypted` (the client-encryption-key service decrypts)."""
        return decrypt_encrypted_header(self.session, tenant_id, header_value, now=self.now).value
