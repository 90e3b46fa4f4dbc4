"""Rows written without ORM objects (``storage.db.insert_rows``): on PostgreSQL each table's rows go
out as one JSON document expanded by ``json_populate_recordset``; what is stored must be what an ORM
insert of the same values stores. Real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import event, inspect, select, update
from sqlalchemy.engine import Engine

from storage.db import Rows, insert_rows, session_scope, stage_inserts, stage_write
from storage.models import AuditLog, Token
from storage.types import table_of

pytestmark = pytest.mark.api

TOKENS, LOGS = table_of(Token), table_of(AuditLog)
CREATOR = uuid.uuid4()
#: A zone other than UTC: stored as the same instant.
PARIS = dt.timezone(dt.timedelta(hours=1))
#: (attribute, column name) of every column of Token (``meta`` is the column ``metadata``).
COLUMNS = tuple((attribute.key, attribute.columns[0].name) for attribute in inspect(Token).column_attrs)


def _row(token: Token) -> dict:
    return {column: getattr(token, attribute) for attribute, column in COLUMNS}


def _token(tenant, token_id: str, **values) -> Token:
    defaults = {
        "type": "token",
        "data_ct": bytes(range(256)) + b"\\x00'\"",
        "mask": {"nested": ["a", 1, 2.5, True, None, {"é": '✓ "quoted" \\ back'}]},
        "containers": ["/general/high/"],
        "meta": {"order": "12'34", "empty": ""},
        "search_indexes": ["{{ data }}"],
        "fingerprint": "f" * 43,
        "fingerprint_expression": None,
        "deduplicate_token": False,
        "parent_id": None,
        "created_by": CREATOR,
        "created_at": dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=PARIS),
        "expires_at": dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
    }
    return Token(tenant_id=tenant.id, id=token_id, **{**defaults, **values})


def _stored(tenant, token_id: str) -> dict:
    with session_scope() as session:
        token = session.execute(select(Token).where(Token.tenant_id == tenant.id, Token.id == token_id)).scalar_one()
        return {column: getattr(token, attribute) for attribute, column in COLUMNS if column != "id"}


def _orm_twin(tenant, **values) -> dict:
    """What an ORM insert stores for a token made of ``values``."""
    token_id = f"orm-{uuid.uuid4()}"
    with session_scope() as session:
        session.add(_token(tenant, token_id, **values))
    return _stored(tenant, token_id)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"mask": "{{ data | reveal_last: 4 }}"},  # a JSON column holding a string
        {"mask": None, "deduplicate_token": None},  # SQL NULL, as the ORM path stores it
        {"mask": {"huge": 2**70}},  # beyond 64 bits: the rows go out as VALUES literals instead
    ],
    ids=["values", "json-string", "nulls", "huge-integer"],
)
@pytest.mark.parametrize("how", ["insert_rows", "stage_inserts", "stage_inserts beside a write"])
def test_rows_are_stored_as_an_orm_insert_stores_them(tenant, values, how):
    """``insert_rows`` writes at once; ``stage_inserts`` at the commit, in the one statement of the
    writes queued beside (``stage_write``): here an update of another token."""
    token_id = f"rows-{uuid.uuid4()}"
    rows = Rows()
    token = _token(tenant, token_id, **values)
    rows.add(TOKENS, _row(token))
    log_id = uuid.uuid4()
    rows.add(
        LOGS,
        {
            "id": log_id,
            "tenant_id": tenant.id,
            "actor_id": None,
            "actor_type": "application",
            "entity_type": "token",
            "entity_id": token_id,
            "operation": "create",
            "message": 'it\'s "made"',
            "created_at": token.created_at,
        },
    )
    other_id = f"other-{uuid.uuid4()}"
    if how == "stage_inserts beside a write":
        other = Rows()
        other.add(TOKENS, _row(_token(tenant, other_id)))
        with session_scope() as session:
            insert_rows(session, other)
    sent: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        sent.append(statement)

    event.listen(Engine, "before_cursor_execute", record)
    try:
        with session_scope() as session:
            if how == "insert_rows":
                insert_rows(session, rows)
            else:
                stage_inserts(session, rows)
                if how == "stage_inserts beside a write":
                    stage_write(
                        session,
                        update(TOKENS)
                        .where(TOKENS.c.tenant_id == tenant.id, TOKENS.c.id == other_id)
                        .values(metadata={"touched": True}),
                    )
                assert sent == []  # nothing is sent before the commit
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    assert len(sent) == 1, sent  # one statement: every table's rows (and the write beside them)
    assert _stored(tenant, token_id) == _orm_twin(tenant, **values)
    if how == "stage_inserts beside a write":
        assert _stored(tenant, other_id)["metadata"] == {"touched": True}
    with session_scope() as session:
        log = session.get(AuditLog, log_id)
        assert log is not None and log.message == 'it\'s "made"' and log.created_at == token.created_at


def test_rows_whose_key_exists_are_skipped_when_asked(tenant):
    token_id = f"rows-{uuid.uuid4()}"
    first = Rows()
    first.add(TOKENS, _row(_token(tenant, token_id)))
    with session_scope() as session:
        insert_rows(session, first)
    again = Rows()
    again.add(TOKENS, _row(_token(tenant, token_id, type="card")), ignore_conflicts=True)
    with session_scope() as session:
        insert_rows(session, again)
    assert _stored(tenant, token_id)["type"] == "token"
