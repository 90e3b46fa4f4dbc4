"""Which commits wait for the WAL flush, on real PostgreSQL: on the autocommit engine
(``storage.db.get_autocommit_engine``) a statement commits as the server's setting says (durably
here), unless it is sent after ``storage.db.UNFLUSHED`` in its round trip; a job's lease is sent so,
its outcome and a unit of work's commit are not. Each statement reads the setting its own transaction
commits with (``current_setting('synchronous_commit')``) on the driver's cursor, as the platform's
statements run."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select
from sqlmodel import Session

from infra import jobs
from storage.db import (
    execute_durable,
    execute_once_more_on_disconnect,
    get_autocommit_engine,
    get_engine,
    read_then_write,
    server_prepared,
)

pytestmark = pytest.mark.worker

#: The setting the transaction of the statement that reads it commits with.
_COMMIT_MODE = server_prepared(select(func.current_setting("synchronous_commit").label("mode")))


def test_an_autocommit_statement_commits_durably_unless_sent_unflushed(database):
    engine = get_autocommit_engine()
    assert engine is not None
    assert execute_once_more_on_disconnect(engine, _COMMIT_MODE)["mode"] == "on"
    assert execute_once_more_on_disconnect(engine, _COMMIT_MODE, unflushed=True)["mode"] == "off"
    # the setting lasted for that statement's transaction only: the connection is as it was
    assert execute_once_more_on_disconnect(engine, _COMMIT_MODE)["mode"] == "on"
    assert execute_durable(_COMMIT_MODE)[0] == "on"


def test_a_unit_of_work_commits_durably(database):
    with Session(get_engine()) as session, read_then_write(session, [uuid.uuid4()]) as unit:
        assert unit is not None  # PostgreSQL through psycopg2, statements prepared, nothing listening
        assert unit.read_first(_COMMIT_MODE, None)[0] == "on"


def test_a_jobs_lease_is_sent_unflushed(database, monkeypatch):
    sent = []

    def recorded(*args, **kwargs):
        sent.append(kwargs.get("unflushed", False))
        return execute_once_more_on_disconnect(*args, **kwargs)

    monkeypatch.setattr(jobs, "execute_once_more_on_disconnect", recorded)  # a spy: the real statement runs
    assert jobs.lease(uuid.uuid4(), "test-owner", lease_seconds=30) is None  # no such job: nothing taken
    assert jobs.lease_together([uuid.uuid4(), uuid.uuid4()], "test-owner", lease_seconds=30) == {}
    assert sent == [True, True]
