"""A unit of work that reads once, then writes (``storage.db.read_then_write``), on real PostgreSQL:
what it staged is written with its commit; an exception in its block writes nothing, leaves its
session without staged state and its connection outside any transaction."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import bindparam, insert, select
from sqlmodel import Session

from storage.db import get_engine, read_then_write, server_prepared, stage_write
from storage.types import utcnow
from tests.storage.test_driver_statements import _JOBS, _tenant_id

pytestmark = pytest.mark.worker

_READ_JOB = server_prepared(select(_JOBS.c.id).where(_JOBS.c.id == bindparam("id", type_=_JOBS.c.id.type)))
_LOCK_JOB = server_prepared(
    select(_JOBS.c.id).where(_JOBS.c.id == bindparam("id", type_=_JOBS.c.id.type)).with_for_update()
)
#: A staged write built once, its values given apart (``stage_write``'s ``params``): a settled job.
_STAGED_JOB = insert(_JOBS).values(
    id=bindparam("staged_id", type_=_JOBS.c.id.type),
    tenant_id=bindparam("staged_tenant", type_=_JOBS.c.tenant_id.type),
    kind="unit.test",
    subject_type="test",
    subject_id="unit",
    status="succeeded",  # settled: no sweep or relay of the shared test database picks it up
    attempts=0,
    max_attempts=1,
    due_at=bindparam("staged_at", type_=_JOBS.c.due_at.type),
    created_at=bindparam("staged_at", type_=_JOBS.c.created_at.type),
    updated_at=bindparam("staged_at", type_=_JOBS.c.updated_at.type),
)


class _Refused(Exception):
    """Raised by a test's block to roll its unit back."""


def _exists(job_id: uuid.UUID) -> bool:
    with Session(get_engine()) as session:
        return session.execute(select(_JOBS.c.id).where(_JOBS.c.id == job_id)).first() is not None


def _unit(session: Session, tenant: uuid.UUID, *, refuse: bool) -> uuid.UUID:
    """One unit: read a job that does not exist, stage a job's insert, refuse (raise) or not."""
    job_id = uuid.uuid4()
    with read_then_write(session, [job_id]) as unit:
        assert unit is not None  # PostgreSQL through psycopg2, statements prepared, nothing listening
        assert unit.read_first(_READ_JOB, {"id": job_id}) is None
        stage_write(session, _STAGED_JOB, {"staged_id": job_id, "staged_tenant": tenant, "staged_at": utcnow()})
        if refuse:
            raise _Refused
    return job_id


def test_what_a_unit_staged_is_written_with_its_commit_and_nothing_when_it_raises(database):
    tenant = _tenant_id()
    session = Session(get_engine())
    try:
        written = _unit(session, tenant, refuse=False)
        assert _exists(written)
        assert not session.in_transaction()  # the session's own transaction never began

        refused_id = uuid.uuid4()
        with pytest.raises(_Refused), read_then_write(session, [refused_id]) as unit:
            assert unit is not None
            assert unit.read_first(_LOCK_JOB, {"id": written}) is not None  # its row locked by the unit
            stage_write(session, _STAGED_JOB, {"staged_id": refused_id, "staged_tenant": tenant, "staged_at": utcnow()})
            raise _Refused
        assert not _exists(refused_id)
        assert not [key for key in session.info if key.startswith("tessera_staged")]  # nothing left staged
        with Session(get_engine()) as other:  # the unit's lock is gone with its transaction
            locked = select(_JOBS.c.id).where(_JOBS.c.id == written).with_for_update(nowait=True)
            assert other.execute(locked).first() is not None

        again = _unit(session, tenant, refuse=False)  # a connection left outside any transaction
        assert _exists(again)
        assert not _exists(refused_id)  # not committed by the next unit's COMMIT either
    finally:
        session.close()
