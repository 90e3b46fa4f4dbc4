"""The bulk-write path (``storage.db.insert_rows`` / ``insert_rows_unflushed``): from ``COPY_MIN_ROWS``
rows of a table PostgreSQL gets them by ``COPY``, which must store exactly what the ``INSERT`` path
stores, skip existing keys where asked and raise the same wrapped errors. Real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from storage import db
from storage.db import COPY_MIN_ROWS, Rows, insert_rows, insert_rows_unflushed, session_scope
from storage.models import AuditLog, Token
from storage.models_tenancy import TokenActivity
from storage.types import table_of

pytestmark = pytest.mark.api

TOKENS, LOGS, ACTIVITY = table_of(Token), table_of(AuditLog), table_of(TokenActivity)
AWKWARD = ["plain", "tab\there", "new\nline", "carriage\rreturn", "back\\slash \\N", "quote \" and ' é ✓", ""]


def _token(tenant_id: uuid.UUID, index: int, prefix: str) -> dict:
    """A token row whose values go through every kind of column: bytes (with every byte value), JSON,
    booleans, NULLs, timestamps, UUIDs and text needing escapes in ``COPY``'s text format."""
    text = AWKWARD[index % len(AWKWARD)]
    return {
        "tenant_id": tenant_id,
        "id": f"{prefix}-{index}",
        "type": "card",
        "data_ct": bytes(range(256)) + index.to_bytes(4, "big"),
        "mask": {"text": text, "n": index} if index % 3 else None,
        "containers": ["/pci/high/", text],
        "metadata": {"k": text, "nested": {"list": [1, 2.5, None, True]}},
        "search_indexes": [],
        "fingerprint": text or None,
        "fingerprint_expression": "{{ data.number }}",
        "deduplicate_token": [None, True, False][index % 3],
        "parent_id": None,
        "created_by": uuid.uuid4() if index % 2 else None,
        "created_at": dt.datetime(2026, 1, 2, 3, 4, 5, index, tzinfo=dt.UTC),
        "modified_by": None,
        "modified_at": dt.datetime(2026, 5, 6, 7, 8, 9, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
        "expires_at": None,
        "cvc_expires_at": None,
    }


def _no_insert(*_args):
    raise AssertionError("written by INSERT, not COPY")


def _stored(tenant_id: uuid.UUID, prefix: str) -> list[dict]:
    with session_scope() as session:
        rows = session.execute(
            select(TOKENS).where(TOKENS.c.tenant_id == tenant_id, TOKENS.c.id.like(f"{prefix}-%"))
        ).all()
    return sorted(({**row._asdict(), "id": row.id.split("-", 1)[1]} for row in rows), key=lambda r: int(r["id"]))


def test_copy_stores_what_the_insert_path_stores(tenant, monkeypatch):
    count = COPY_MIN_ROWS + 7
    copied, inserted = Rows(), Rows()
    for index in range(count):
        row = _token(tenant.id, index, "copy")
        copied.add(TOKENS, row)
        inserted.add(TOKENS, {**row, "id": f"insert-{index}"})
    with monkeypatch.context() as patched, session_scope() as session:
        patched.setattr(db, "_pg_insert", _no_insert)  # every value of the row is COPY's
        insert_rows(session, copied)
    monkeypatch.setattr(db, "COPY_MIN_ROWS", count + 1)  # the same rows, by INSERT statements
    with session_scope() as session:
        insert_rows(session, inserted)

    by_copy, by_insert = _stored(tenant.id, "copy"), _stored(tenant.id, "insert")
    assert len(by_copy) == count
    assert by_copy == by_insert
    assert by_copy[1]["data_ct"] == _token(tenant.id, 1, "x")["data_ct"]
    assert {r["fingerprint"] for r in by_copy} == {text or None for text in AWKWARD}


def test_copy_with_ignore_conflicts_skips_existing_keys_and_writes_children_after_parents(tenant):
    first = Rows()
    for index in range(COPY_MIN_ROWS):
        first.add(TOKENS, _token(tenant.id, index, "again"), ignore_conflicts=True)
    with session_scope() as session:
        insert_rows(session, first)
    before = _stored(tenant.id, "again")

    second = Rows()  # half of the keys exist (their new values must not land), half are new
    for index in range(COPY_MIN_ROWS // 2, COPY_MIN_ROWS + COPY_MIN_ROWS // 2):
        second.add(TOKENS, {**_token(tenant.id, index, "again"), "type": "changed"}, ignore_conflicts=True)
    for index in range(COPY_MIN_ROWS):  # a table named after, small: written after the copied one
        second.add(
            LOGS,
            {
                "id": uuid.uuid4(),
                "tenant_id": tenant.id,
                "actor_id": None,
                "actor_type": "application",
                "entity_type": "card",
                "entity_id": f"again-{index}",
                "operation": "create",
                "message": "Card created",
                "created_at": dt.datetime.now(dt.UTC),
            },
        )
    with session_scope() as session:
        insert_rows(session, second)
        insert_rows(session, Rows())  # nothing to write
    after = _stored(tenant.id, "again")
    assert len(after) == COPY_MIN_ROWS + COPY_MIN_ROWS // 2
    assert after[: len(before)] == before
    assert {r["type"] for r in after[len(before) :]} == {"changed"}
    with session_scope() as session:
        logs = session.scalars(
            select(AuditLog.entity_id).where(AuditLog.tenant_id == tenant.id, AuditLog.entity_id.like("again-%"))
        ).all()
    assert len(logs) == COPY_MIN_ROWS


def test_copy_of_an_existing_key_raises_the_wrapped_integrity_error_and_writes_nothing(tenant):
    rows = Rows()
    for index in range(COPY_MIN_ROWS):
        rows.add(TOKENS, _token(tenant.id, index, "twice"))
    with session_scope() as session:
        insert_rows(session, rows)
    duplicate = Rows()
    for index in range(COPY_MIN_ROWS, 2 * COPY_MIN_ROWS):
        duplicate.add(TOKENS, _token(tenant.id, index, "twice"))
    duplicate.add(TOKENS, _token(tenant.id, 0, "twice"))
    with pytest.raises(IntegrityError), session_scope() as session:
        insert_rows(session, duplicate)
    assert len(_stored(tenant.id, "twice")) == COPY_MIN_ROWS


def test_unflushed_copy_writes_once_when_run_twice(tenant):
    month = dt.date(2026, 2, 1)
    rows = Rows()
    for index in range(COPY_MIN_ROWS + 3):
        rows.add(ACTIVITY, {"tenant_id": tenant.id, "month": month, "token_id": f"t{index}"}, ignore_conflicts=True)
    insert_rows_unflushed(rows)
    insert_rows_unflushed(rows)  # a job's slow step run again
    with session_scope() as session:
        stored = session.scalars(
            select(TokenActivity.token_id).where(TokenActivity.tenant_id == tenant.id, TokenActivity.month == month)
        ).all()
    assert sorted(stored) == sorted(f"t{index}" for index in range(COPY_MIN_ROWS + 3))
