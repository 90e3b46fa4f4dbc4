"""Gates (``storage.db.hold_gates``) on real PostgreSQL: a statement sent behind a job's gate
(``gate_wait``) while a transaction that holds it has not committed waits for the commit, then reads
what it wrote; after a rollback it reads nothing; nobody waits at a gate nobody holds."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import time
import uuid

import pytest
from sqlalchemy import bindparam, select

from storage.db import (
    before_commit,
    execute_once_more_on_disconnect,
    gate_key,
    gate_wait,
    get_autocommit_engine,
    hold_gates,
    server_prepared,
    session_scope,
)
from tests.storage.test_driver_statements import _INSERT, _JOBS, _tenant_id

pytestmark = pytest.mark.worker

_READ_JOB = server_prepared(
    select(_JOBS.c.id, _JOBS.c.subject_id).where(_JOBS.c.id == bindparam("id", type_=_JOBS.c.id.type))
)
#: How long the holder waits, with the reader started, before it commits (seconds): the reader is
#: still waiting then, at the gate.
_HELD = 0.3


class _Told(Exception):
    """Raised by a test's callback to roll its transaction back."""


def _read_behind_gate(job_id: uuid.UUID):
    engine = get_autocommit_engine()
    assert engine is not None
    return execute_once_more_on_disconnect(engine, _READ_JOB, {"id": job_id}, after=gate_wait(job_id))


def _record_behind_gate(job_id: uuid.UUID, reading: dict, *, then_fail: bool = False) -> None:
    """Insert job ``job_id`` in a transaction holding its gate; its before-commit callback starts a
    reader behind the gate (``reading["future"]``), waits :data:`_HELD` s and notes whether the reader
    was still waiting (``reading["waiting"]``); ``then_fail``: it then raises :class:`_Told` (the
    transaction rolls back)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def tell() -> None:
        reading["future"] = pool.submit(_read_behind_gate, job_id)
        time.sleep(_HELD)
        reading["waiting"] = not reading["future"].done()
        if then_fail:
            raise _Told

    at = dt.datetime.now(dt.UTC)
    try:
        with session_scope() as session:
            session.execute(_INSERT, {"job_id": job_id, "tenant_id": _tenant_id(), "subject": "gated", "at": at})
            assert hold_gates(session, [job_id])
            before_commit(session, tell)
    finally:
        pool.shutdown(wait=False)


def test_a_statement_behind_the_gate_waits_for_the_commit_and_reads_what_it_wrote(database):
    job_id, reading = uuid.uuid4(), {}
    _record_behind_gate(job_id, reading)
    assert reading["waiting"]  # the transaction had not committed: the reader was still at the gate
    row = reading["future"].result(timeout=10)
    assert row is not None and row["id"] == job_id and row["subject_id"] == "gated"


def test_after_a_rollback_the_statement_behind_the_gate_was_held_then_reads_nothing(database):
    job_id, reading = uuid.uuid4(), {}
    with pytest.raises(_Told):
        _record_behind_gate(job_id, reading, then_fail=True)
    assert reading["waiting"]
    assert reading["future"].result(timeout=10) is None


def test_nobody_waits_at_a_gate_nobody_holds(database):
    job_id = uuid.uuid4()
    at = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        session.execute(_INSERT, {"job_id": job_id, "tenant_id": _tenant_id(), "subject": "open", "at": at})
    row = _read_behind_gate(job_id)
    assert row is not None and row["subject_id"] == "open"
    assert _read_behind_gate(uuid.uuid4()) is None


def test_a_gate_key_is_the_job_ids_last_32_bits_signed():
    assert gate_key(uuid.UUID(int=0x7FFFFFFF)) == 0x7FFFFFFF
    assert gate_key(str(uuid.UUID(int=0xFFFFFFFF))) == -1
    assert gate_key(uuid.UUID(int=1 << 64)) == 0
    with pytest.raises(ValueError):
        gate_key("not a uuid")
