"""The statement-level forms of the job protocol on real PostgreSQL: staged job rows, leases that
survive a closed connection, outcomes written without ORM objects, one-statement events, reads and
activity rows outside a transaction."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import bindparam, event, func, select, text, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from config.settings import get_settings
from domain.tenancy.tenants import create_tenant
from domain.tenancy.usage import record_token_activity_unflushed
from domain.webhooks.events import emit
from infra import jobs
from infra.celery import DELIVER_TASK, celery_app
from infra.dispatch import take_pending
from infra.fairness import others_wait
from infra.jobs import PermanentError
from infra.task import JobTask
from storage.db import (
    Rows,
    get_autocommit_engine,
    get_engine,
    read_all,
    read_first,
    session_scope,
    stage_changes,
    stage_rows,
    stage_write,
)
from storage.models import Event, Job, Tenant, Webhook, WebhookDelivery
from storage.models_tenancy import TokenActivity
from tests.helpers import wait_until

pytestmark = pytest.mark.worker


class LeasedJob(JobTask):
    """Succeeds with its subject as result, or fails for good when the subject is ``permanent``;
    its outcome is written by statements (``apply_to_leased_job``)."""

    name = "tests.leased_job"
    lease_seconds = 5
    apply_to_leased_job = True

    def perform(self, job, inputs):
        if job.subject_id == "permanent":
            raise PermanentError("DECLINED", "the provider declined")
        return {"subject": job.subject_id}

    def apply(self, session, job, outcome):
        assert job not in session  # the leased job, not an ORM load
        return outcome


celery_app.register_task(LeasedJob())


def _tenant_id() -> uuid.UUID:
    with session_scope() as session:
        return create_tenant(session, name="statements", owner_email=f"o-{uuid.uuid4().hex[:8]}@example.com").tenant_id


def _job(job_id) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


@contextlib.contextmanager
def _one_connection_on_generic_plans() -> Iterator[Engine]:
    """The autocommit engine down to one pooled connection that runs every prepared statement on its
    generic plan from the first run (as a statement runs after its first five), disposed of again
    at the end."""
    engine = get_autocommit_engine()
    assert engine is not None
    engine.dispose()
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        yield engine
    finally:
        engine.dispose()


def _generic_plans(engine: Engine, like: str) -> dict[str, str]:
    """The generic plan (``EXPLAIN``) of each statement prepared on ``engine``'s one connection whose
    text is ``like``, by its name."""
    with engine.connect() as connection:
        prepared = connection.execute(
            text(
                "SELECT name, cardinality(parameter_types) FROM pg_prepared_statements"
                " WHERE statement LIKE :like AND generic_plans > 0"
            ),
            {"like": like},
        ).all()
        return {
            name: "\n".join(
                connection.exec_driver_sql(f"EXPLAIN EXECUTE {name}({', '.join(['NULL'] * parameters)})").scalars()
            )
            for name, parameters in prepared
        }


def _insert_jobs(session: Session, tenant_id: uuid.UUID, kind: str, status: str, count: int) -> None:
    """``count`` jobs of ``kind`` in ``status`` for ``tenant_id``, due a minute ago, written by one
    statement in ``session`` (rows the test needs in bulk, not jobs it runs)."""
    session.execute(
        text(
            "INSERT INTO jobs (id, tenant_id, kind, status, attempts, max_attempts, due_at, created_at, updated_at)"
            " SELECT gen_random_uuid(), :tenant_id, :kind, :status, 0, 5, now() - interval '1 minute', now(), now()"
            " FROM generate_series(1, :count)"
        ),
        {"tenant_id": tenant_id, "kind": kind, "status": status, "count": count},
    )


def _recorded(*subjects: str, tenant_id: uuid.UUID | None = None) -> list[Job]:
    """One job of :class:`LeasedJob` per subject, recorded in one transaction, their messages taken
    back (no worker: the test takes the leases itself)."""
    with session_scope() as session:
        recorded = [
            jobs.record(
                session, kind=LeasedJob.name, tenant_id=tenant_id, subject_type="script", subject_id=s, trace_id=None
            )
            for s in subjects
        ]
        take_pending(session)
    return recorded


def test_a_new_job_row_has_every_column_of_a_job():
    row = jobs.new_row(kind="tests.leased_job", tenant_id=None, subject_type="script", subject_id=7, trace_id="t")
    assert set(row) == {column.name for column in Job.__table__.columns}
    assert (row["status"], row["attempts"], row["max_attempts"], row["subject_id"]) == ("queued", 0, 5, "7")


def test_a_staged_job_is_written_with_the_rows_and_its_task_is_sent_on_commit(database):
    rows = Rows()
    with session_scope() as session:
        job_id = jobs.record(
            session,
            rows=rows,
            kind=LeasedJob.name,
            tenant_id=None,
            subject_type="script",
            subject_id="staged",
            trace_id="trace-1",
            max_attempts=3,
        ).id
        stage_rows(session, rows)
        assert take_pending(session) == [(LeasedJob.name, {"job_id": str(job_id)})]
    job = _job(job_id)
    assert (job.kind, job.status, job.attempts, job.max_attempts, job.subject_type, job.subject_id, job.trace_id) == (
        LeasedJob.name,
        "queued",
        0,
        3,
        "script",
        "staged",
        "trace-1",
    )
    assert job.due_at <= dt.datetime.now(dt.UTC)


def test_a_leased_job_outcome_is_written_by_statements(worker):
    with session_scope() as session:
        done = jobs.record(
            session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id="ok", trace_id=None
        )
        refused = jobs.record(
            session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id="permanent", trace_id=None
        )
    job = wait_until(lambda: (found := _job(done.id)).status == "succeeded" and found)
    assert job.result == {"subject": "ok"}
    assert (job.attempts, job.lease_owner, job.lease_expires_at) == (1, None, None)
    failed = wait_until(lambda: (found := _job(refused.id)).status == "failed" and found)
    assert failed.result == {"code": "DECLINED", "status": 422}


def test_the_jobs_of_one_transaction_are_sent_back_to_back_on_one_producer(database, monkeypatch):
    """Two jobs recorded in one transaction (a payment method's rails): nothing is sent before the
    commit, then both messages go out one after the other on one producer taken from the pool once."""
    sent = []

    def send_task(name, *, kwargs, producer, **options):
        sent.append((name, kwargs, producer))

    monkeypatch.setattr(celery_app, "send_task", send_task)
    with session_scope() as session:
        first, second = (
            jobs.record(
                session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id=name, trace_id=None
            )
            for name in ("first", "second")
        )
        session.flush()
        assert sent == []
    assert [(name, kwargs) for name, kwargs, _ in sent] == [
        (LeasedJob.name, {"job_id": str(first.id)}),
        (LeasedJob.name, {"job_id": str(second.id)}),
    ]
    assert sent[0][2] is not None and sent[0][2] is sent[1][2]


def test_staged_writes_go_out_together_just_before_the_commit(database):
    """Writes queued with ``stage_write`` and ``stage_changes`` are not sent while the transaction
    runs; its commit sends them (one statement on PostgreSQL) after the ORM's own changes."""
    first, second, third = _recorded("a", "b", "c")
    statements = []

    def record(connection, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    engine = get_engine()
    event.listen(engine, "before_cursor_execute", record)
    try:
        with session_scope() as session:
            table = Job.__table__
            stage_write(session, update(table).where(table.c.id == first.id).values(last_error="first"))
            stage_write(session, update(table).where(table.c.id == second.id).values(last_error="second"))
            loaded = session.get(Job, third.id)
            loaded.last_error = "third"
            stage_changes(session, loaded)
            assert loaded not in session
            assert read_first(select(Job.last_error).where(Job.id == first.id)).last_error is None
            sent_before_commit = len(statements)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    written = [statement for statement in statements[sent_before_commit:] if "last_error" in statement]
    assert len(written) == 1 and written[0].lstrip().startswith("WITH")
    for job, error in ((first, "first"), (second, "second"), (third, "third")):
        assert _job(job.id).last_error == error


def test_a_lease_runs_again_on_a_connection_the_server_closed(database):
    engine = get_autocommit_engine()
    engine.dispose()  # one pooled connection from here on
    with engine.connect() as connection:
        closed_pid = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    with session_scope() as session:
        assert session.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": closed_pid}).scalar()
        job = jobs.record(
            session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id="x", trace_id=None
        )
        take_pending(session)  # no worker: the test takes the lease itself
    leased = jobs.lease(job.id, "tests:owner", lease_seconds=5, reads={"kind": Job.kind})
    assert leased is not None
    assert (leased[0].status, leased[0].lease_owner, leased[1]) == ("running", "tests:owner", {"kind": LeasedJob.name})
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT pg_backend_pid()").scalar() != closed_pid


def test_a_lease_reads_the_tables_joined_to_the_job_row_and_nulls_where_a_row_is_missing(database):
    """``LeaseReads``: the joined tenant is read beside the job by each form of the lease (one job on
    the autocommit engine, a list of jobs, one job in the caller's transaction); a job whose join finds no
    row is leased all the same, its reads NULL."""
    tenant_id = _tenant_id()
    tenants = Tenant.__table__
    reads = jobs.LeaseReads(
        {"tenant_name": tenants.c.name, "kind": Job.kind}, ((tenants, tenants.c.id == Job.tenant_id),)
    )
    with session_scope() as session:
        alone, owned, orphan, in_session = (
            jobs.record(
                session, kind=LeasedJob.name, tenant_id=owner, subject_type="script", subject_id=s, trace_id=None
            )
            for owner, s in ((tenant_id, "j1"), (tenant_id, "j2"), (None, "j3"), (tenant_id, "j4"))
        )
        take_pending(session)  # no worker: the test takes the leases itself
        here = jobs.lease(in_session.id, "tests:owner", lease_seconds=5, reads=reads, session=session)
        assert here is not None and here[1] == {"tenant_name": "statements", "kind": LeasedJob.name}
    one = jobs.lease(alone.id, "tests:owner", lease_seconds=5, reads=reads)
    assert one is not None and (one[0].id, one[0].status, one[0].attempts) == (alone.id, "running", 1)
    assert one[1] == {"tenant_name": "statements", "kind": LeasedJob.name}
    together = jobs.lease_together([owned.id, orphan.id, alone.id], "tests:owner", lease_seconds=5, reads=reads)
    assert set(together) == {owned.id, orphan.id}  # `alone` is leased already
    assert together[owned.id][1] == {"tenant_name": "statements", "kind": LeasedJob.name}
    assert together[orphan.id][1] == {"tenant_name": None, "kind": LeasedJob.name}
    assert together[orphan.id][0].lease_owner == "tests:owner" and _job(orphan.id).status == "running"
    assert jobs.lease(owned.id, "tests:other", lease_seconds=5, reads=reads) is None


def test_the_lease_probes_of_other_tenants_keep_the_partial_index_under_a_generic_plan(database):
    """A prepared statement runs on a generic plan after its first five runs: the probes of
    ``others_wait`` must still use the partial index of takeable jobs, not walk the status index over
    every finished job (their statuses written as literals; bound, the generic plan scanned the index
    entries of 22,000 jobs, dead versions included, 1.7-4.6 ms a lease instead of 0.06 ms)."""
    tenant_id = _tenant_id()
    with session_scope() as session:
        _insert_jobs(session, tenant_id, LeasedJob.name, "succeeded", 5000)
        job = jobs.record(
            session, kind=LeasedJob.name, tenant_id=tenant_id, subject_type="script", subject_id="g", trace_id=None
        )
        take_pending(session)
        session.execute(text("ANALYZE jobs"))
    with _one_connection_on_generic_plans() as engine:
        reads = {"others_wait": others_wait([LeasedJob.name], jobs.LEASE_NOW)}
        leased = jobs.lease(job.id, "tests:owner", lease_seconds=5, reads=reads)
        assert leased is not None and leased[1] == {"others_wait": False}
        plans = _generic_plans(engine, "%waiting_jobs%")
    assert len(plans) == 1, plans
    plan = next(iter(plans.values()))
    assert plan.count("using ix_jobs_takeable on jobs waiting_jobs") == 2, plan


def test_a_lease_finds_its_jobs_by_the_primary_key_under_a_generic_plan_behind_a_backlog(database):
    """The lease of one job and of a list of jobs (each a prepared statement run on a generic plan)
    read their jobs through the primary key, not through the partial index of takeable jobs: with the
    statistics of a moment when few jobs waited, a plan through that index walked every queued job
    due by now to find the ids (3.4 ms a lease behind 20,000 queued deliveries, instead of 0.06 ms)."""
    tenant_id = _tenant_id()
    one, first, second = _recorded("alone", "first", "second", tenant_id=tenant_id)
    with session_scope() as session:
        session.execute(text("ANALYZE jobs"))  # statistics of a quiet moment: a handful of jobs wait
    with session_scope() as session:  # then a backlog arrives, before the next ANALYZE
        _insert_jobs(session, tenant_id, "tests.backlog", "queued", 3000)
    try:
        with _one_connection_on_generic_plans() as engine:
            assert jobs.lease(one.id, "tests:owner", lease_seconds=5) is not None
            pair = [first.id, second.id]
            assert set(jobs.lease_together(pair, "tests:owner", lease_seconds=5)) == set(pair)
            plans = _generic_plans(engine, "%UPDATE jobs SET%lease_owner%")
    finally:
        with session_scope() as session:  # nothing of the backlog is left for the relay of later tests
            session.execute(text("DELETE FROM jobs WHERE kind = 'tests.backlog'"))
    assert len(plans) == 2, plans  # the lease of one job and the lease of a list
    for plan in plans.values():
        assert "ix_jobs_takeable" not in plan and "jobs_pkey" in plan, plan


def test_read_first_sees_committed_rows_outside_a_transaction(database):
    with session_scope() as session:
        job = jobs.record(
            session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id="r", trace_id=None
        )
        take_pending(session)
    assert tuple(read_first(select(Job.status, Job.subject_id).where(Job.id == job.id))) == ("queued", "r")
    assert read_first(select(Job.status).where(Job.id == uuid.uuid4())) is None
    assert [tuple(row) for row in read_all(select(Job.subject_id).where(Job.id == job.id))] == [("r",)]
    assert read_all(select(Job.status).where(Job.id == uuid.uuid4())) == []


def test_an_event_in_one_statement_is_delivered_to_the_enabled_webhooks_subscribed_to_it(database):
    tenant_id = _tenant_id()
    with session_scope() as session:
        hooks = {
            name: Webhook(
                tenant_id=tenant_id, name=name, url=f"https://example.com/{name}", events=events, status=status
            )
            for name, events, status in (
                ("subscribed", ["network-token.created", "token.created"], "enabled"),
                ("other-type", ["token.created"], "enabled"),
                ("disabled", ["network-token.created"], "disabled"),
            )
        }
        session.add_all(hooks.values())
    with session_scope() as session:
        event_id = emit(
            session,
            tenant_id=tenant_id,
            type="network-token.created",
            data={"network_token": {"id": "n1", "status": "active"}},
            trace_id="trace-2",
        )
        sent = take_pending(session)
    with session_scope() as session:
        event = session.get(Event, event_id)
        deliveries = session.exec(select(WebhookDelivery).where(WebhookDelivery.event_id == event_id)).scalars().all()
        delivery_jobs = [session.get(Job, d.id) for d in deliveries]
    assert (event.type, event.data, event.trace_id) == (
        "network-token.created",
        {"network_token": {"id": "n1", "status": "active"}},
        "trace-2",
    )
    assert [(d.webhook_id, d.status, d.tenant_id) for d in deliveries] == [
        (hooks["subscribed"].id, "pending", tenant_id)
    ]
    # the delivery's work is the job with its id, written by the same statement
    assert [
        (j.kind, j.status, j.attempts, j.max_attempts, j.tenant_id, j.subject_type, j.subject_id, j.trace_id)
        for j in delivery_jobs
    ] == [
        (
            DELIVER_TASK,
            "queued",
            0,
            len(get_settings().webhook_retry_delays) + 1,
            tenant_id,
            "webhook",
            str(hooks["subscribed"].id),
            "trace-2",
        )
    ]
    assert sent == [(DELIVER_TASK, {"delivery_ids": [str(deliveries[0].id)]})]


def test_an_event_without_a_subscribed_webhook_is_recorded_and_sends_nothing(database):
    tenant_id = _tenant_id()
    with session_scope() as session:
        event_id = emit(
            session,
            tenant_id=tenant_id,
            type="network-token.deleted",
            data={"network_token": {"id": "n2", "status": "deleted"}},
            trace_id=None,
        )
        assert take_pending(session) == []
    with session_scope() as session:
        assert session.get(Event, event_id).type == "network-token.deleted"


def test_token_activity_outside_a_transaction_is_counted_once(database):
    tenant_id = _tenant_id()
    record_token_activity_unflushed(tenant_id, ["tok_a", "tok_a", "tok_b"])
    record_token_activity_unflushed(tenant_id, ["tok_a"])
    with session_scope() as session:
        count = session.execute(
            select(func.count()).select_from(TokenActivity).where(TokenActivity.tenant_id == tenant_id)
        ).scalar()
    assert count == 2


def _leased_pair() -> tuple[Job, Job]:
    """A job leased by this test (no worker takes it) and a second, queued job whose ``last_error``
    the first one's outcome writes."""
    with session_scope() as session:
        first, second = (
            jobs.record(
                session, kind=LeasedJob.name, tenant_id=None, subject_type="script", subject_id=name, trace_id=None
            )
            for name in ("owner", "other")
        )
        take_pending(session)
    leased = jobs.lease(first.id, "tests:owner", lease_seconds=30)
    assert leased is not None
    return leased[0], second


_OTHER_JOB = Job.__table__
#: Built once, as a task builds its outcome's write: the other job's ``last_error`` set while it is null.
_WRITE_OTHER = (
    update(_OTHER_JOB)
    .where(_OTHER_JOB.c.id == bindparam("other_id", type_=_OTHER_JOB.c.id.type), _OTHER_JOB.c.last_error.is_(None))
    .values(last_error=bindparam("written"))
)


def _outcome_on(other: Job) -> jobs.OutcomeWrite:
    return jobs.OutcomeWrite(_WRITE_OTHER, {"other_id": other.id, "written": "written"}, {"subject": "done"})


def test_an_outcome_write_and_the_job_settle_are_one_statement_locking_the_job_first(database):
    """``settle_with``: the job's row is locked before the write touches its row (the lock order of an
    outcome: a create handler holding the job's lock makes the worker wait without it holding the
    row it writes), then the write and the settle are one durable statement, and the outcome is
    published to a waiting request."""
    import threading

    from infra.redis_clients import redis_client
    from infra.wait import channel_prefix

    job, other = _leased_pair()
    subscriber = redis_client(get_settings()).pubsub()  # the run's Redis, plain or behind Sentinel
    subscriber.subscribe(channel_prefix(get_settings().redis_key_prefix) + str(job.id))
    subscriber.get_message(timeout=2)  # the subscription's confirmation
    statements: list[str] = []

    def record(connection, cursor, statement, parameters, context, executemany):
        # the statement's SQL, whether it goes out as itself or as the EXECUTE of its prepared form
        statements.append(context.compiled.string if context is not None and context.compiled else statement)

    done: list[bool] = []
    holder = get_engine().connect()
    holder_transaction = holder.begin()
    holder.execute(select(Job.id).where(Job.id == job.id).with_for_update())  # as a create handler deciding
    durable = get_autocommit_engine()  # where an outcome's one statement runs
    assert durable is not None
    event.listen(durable, "before_cursor_execute", record)
    try:
        writer = threading.Thread(target=lambda: done.append(jobs.settle_with(job, _outcome_on(other))))
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and not done  # waits for the job's lock ...
        with get_engine().connect() as probe:  # ... without holding the row it writes
            probe.execute(text("SET lock_timeout = '100ms'"))
            assert probe.execute(select(Job.id).where(Job.id == other.id).with_for_update(nowait=True)).all()
            probe.rollback()
        holder_transaction.rollback()
        writer.join(10)
    finally:
        holder.close()
        event.remove(durable, "before_cursor_execute", record)
    assert done == [True]
    written = [statement for statement in statements if "UPDATE jobs" in statement]
    assert len(written) == 1 and written[0].lstrip().startswith("WITH locked_job")
    settled = _job(job.id)
    assert (settled.status, settled.result, settled.lease_owner, settled.lease_expires_at) == (
        "succeeded",
        {"subject": "done"},
        None,
        None,
    )
    assert (job.status, job.result) == ("succeeded", {"subject": "done"})  # the leased job follows
    assert _job(other.id).last_error == "written"
    message = wait_until(lambda: subscriber.get_message(timeout=0.2), timeout=5)
    subscriber.close()
    assert json.loads(message["data"]) == {"job_id": str(job.id), "status": "succeeded", "result": {}}


def test_an_outcome_write_that_changes_nothing_settles_nothing(database):
    """The write finds nothing to change (here its row no longer matches): nothing is written, the job
    is still leased by its worker, and the caller writes the outcome in a transaction instead."""
    job, other = _leased_pair()
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == other.id).values(last_error="changed meanwhile"))
    assert jobs.settle_with(job, _outcome_on(other)) is False
    kept = _job(job.id)
    assert (kept.status, kept.lease_owner, kept.result) == ("running", "tests:owner", None)
    assert job.status == "running"
    assert _job(other.id).last_error == "changed meanwhile"
