"""Jobs recorded together (``jobs.record(..., together=True)``): one message carries them, one task
run runs them side by side, each leased, settled, retried or failed on its own. Real PostgreSQL; the
task's ``run`` is called as the worker calls it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from celery.exceptions import Retry
from sqlalchemy import bindparam, delete, select, text, update
from sqlmodel import col

from domain.tenancy.tenants import create_tenant
from infra import jobs
from infra.celery import celery_app
from infra.dispatch import take_pending
from infra.jobs import PermanentError, TransientError
from infra.task import AttemptFailed, JobTask
from storage.db import session_scope
from storage.models import Job

pytestmark = pytest.mark.worker

#: Every ``together`` job of a run waits here for the others: they only all pass it side by side.
_MEETING: dict[str, threading.Barrier] = {}


class SiblingJob(JobTask):
    """Meets its siblings (subject ``<meeting>:<what>``), then succeeds, fails for good or is retried."""

    name = "tests.sibling_job"
    lease_seconds = 10

    def perform(self, job, inputs):
        meeting, what = job.subject_id.split(":")
        _MEETING[meeting].wait(timeout=10)  # BrokenBarrierError unless every sibling runs at once
        if what == "permanent":
            raise PermanentError("DECLINED", "the provider declined")
        if what == "transient":
            raise TransientError("the provider timed out", retry_after=3600)  # no message: left to the relay
        return {"done": what}

    def apply(self, session, job, outcome):
        return outcome


celery_app.register_task(SiblingJob())

_JOBS = Job.__table__
#: One sibling's outcome as one write, built once (as a task builds it): a count on a marker job's row.
_COUNTED = (
    update(_JOBS)
    .where(_JOBS.c.id == bindparam("marker_id", type_=_JOBS.c.id.type))
    .values(attempts=_JOBS.c.attempts + 1)
)


class SiblingWrite(JobTask):
    """Gives its outcome as one write (subject ``<marker job id>:<what>``): each sibling adds one to the
    marker job's ``attempts``; ``permanent`` fails for good instead."""

    name = "tests.sibling_write"
    lease_seconds = 10
    apply_to_leased_job = True

    def perform(self, job, inputs):
        marker, what = job.subject_id.split(":")
        if what == "permanent":
            raise PermanentError("DECLINED", "the provider declined")
        if what == "slow":
            time.sleep(0.5)  # a provider answering long after its sibling's
        return marker, what

    def outcome_write(self, job, outcome):
        marker, what = outcome
        return jobs.OutcomeWrite(_COUNTED, {"marker_id": uuid.UUID(marker)}, {"done": what})

    def apply(self, session, job, outcome):  # pragma: no cover - the write always changes its row here
        raise AssertionError("the outcome is written by its one statement")


celery_app.register_task(SiblingWrite())


def _together(*outcomes: str, meeting_of: int | None = None) -> tuple[list[uuid.UUID], list[tuple[str, dict]]]:
    """Jobs recorded together in one transaction, one per outcome; their ids and the messages the
    commit would send. ``meeting_of``: how many of them run and meet (default: all)."""
    meeting = uuid.uuid4().hex
    _MEETING[meeting] = threading.Barrier(meeting_of or len(outcomes))
    with session_scope() as session:
        tenant_id = create_tenant(session, name="siblings", owner_email=f"o-{meeting[:8]}@example.com").tenant_id
        ids = _recorded_together(session, SiblingJob.name, tenant_id, [f"{meeting}:{what}" for what in outcomes])
        messages = take_pending(session)  # this test is the worker
    return ids, messages


def _recorded_together(session, kind: str, tenant_id, subjects: list[str]) -> list[uuid.UUID]:
    """Jobs of ``kind`` recorded together in ``session``'s transaction, one per subject id; their ids."""
    return [
        jobs.record(
            session,
            kind=kind,
            tenant_id=tenant_id,
            subject_type="script",
            subject_id=subject,
            trace_id=None,
            together=True,
        ).id
        for subject in subjects
    ]


def _job(job_id) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _run(messages: list[tuple[str, dict]], task: str = SiblingJob.name) -> str:
    ((name, kwargs),) = messages
    assert name == task
    return celery_app.tasks[name].run(**kwargs)


def test_jobs_recorded_together_travel_in_one_message_and_run_side_by_side(database):
    ids, messages = _together("a", "b", "c")

    assert messages == [(SiblingJob.name, {"job_id": str(ids[0]), "sibling_ids": [str(ids[1]), str(ids[2])]})]
    assert _run(messages) == "succeeded"
    for job_id, what in zip(ids, "abc", strict=True):
        job = _job(job_id)
        assert (job.status, job.result, job.attempts, job.lease_owner) == ("succeeded", {"done": what}, 1, None)

    assert _run(messages) == "skipped"  # the message again (a redelivery): nothing runs twice
    assert [_job(job_id).attempts for job_id in ids] == [1, 1, 1]


def test_one_sibling_failing_for_good_leaves_the_others_settled_and_the_run_fails(database):
    ids, messages = _together("ok", "permanent")

    with pytest.raises(AttemptFailed):
        _run(messages)
    assert [_job(job_id).status for job_id in ids] == ["succeeded", "failed"]


def test_a_retried_sibling_is_retried_alone(database):
    ids, messages = _together("transient", "ok")

    with pytest.raises(Retry):
        _run(messages)
    retried, done = _job(ids[0]), _job(ids[1])
    assert (retried.status, retried.lease_owner, retried.attempts) == ("queued", None, 1)
    assert done.status == "succeeded"


@pytest.mark.parametrize("autocommit_engine", [True, False], ids=["one-statement", "one-lease-each"])
def test_the_takeable_siblings_are_leased_with_their_reads(database, monkeypatch, autocommit_engine):
    """On PostgreSQL one statement; without the autocommit engine (as on SQLite, which has no ``ANY``:
    here the engine is withheld on PostgreSQL) one lease per job, with the same outcome."""
    if not autocommit_engine:
        monkeypatch.setattr(jobs, "get_autocommit_engine", lambda: None)
    ids, _ = _together("a", "b", "c")
    assert jobs.lease(ids[1], "another-worker", lease_seconds=60) is not None  # held elsewhere

    leased = jobs.lease_together(
        [*ids, uuid.uuid4()], "this-worker", lease_seconds=60, reads={"subject": Job.__table__.c.subject_id}
    )

    assert set(leased) == {ids[0], ids[2]}  # not the one held elsewhere, nor an unknown id
    for job_id in (ids[0], ids[2]):
        job, inputs = leased[job_id]
        assert (job.id, job.status, job.lease_owner, job.attempts) == (job_id, "running", "this-worker", 1)
        assert inputs == {"subject": job.subject_id}
        assert job.lease_expires_at is not None
    assert _job(ids[1]).lease_owner == "another-worker"
    assert jobs.lease_together(ids, "a-third-worker", lease_seconds=60) == {}  # all held now
    with session_scope() as session:
        session.execute(delete(Job).where(col(Job.id).in_(ids)))


def test_a_sibling_held_by_another_worker_is_left_to_it_and_the_others_run(database):
    ids, messages = _together("a", "b", "c", meeting_of=2)
    assert jobs.lease(ids[0], "another-worker", lease_seconds=60) is not None  # the message's own job

    assert _run(messages) == "skipped"  # its own job was not taken; its siblings ran side by side
    assert [_job(job_id).status for job_id in ids] == ["running", "succeeded", "succeeded"]
    assert _job(ids[0]).lease_owner == "another-worker"
    with session_scope() as session:
        session.execute(delete(Job).where(col(Job.id).in_(ids)))


def _written_together(*outcomes: str) -> tuple[uuid.UUID, list[uuid.UUID], list[tuple[str, dict]]]:
    """A marker job, then jobs of :class:`SiblingWrite` recorded together, one per outcome."""
    with session_scope() as session:
        marker = jobs.record(
            session, kind="tests.marker", tenant_id=None, subject_type="script", subject_id="marker", trace_id=None
        ).id
        take_pending(session)  # the marker is never run
        ids = _recorded_together(session, SiblingWrite.name, None, [f"{marker}:{what}" for what in outcomes])
        messages = take_pending(session)
    return marker, ids, messages


def test_the_siblings_outcome_writes_commit_in_one_transaction(database):
    marker, ids, messages = _written_together("a", "b", "c")

    assert _run(messages, SiblingWrite.name) == "succeeded"

    assert [(_job(job_id).status, _job(job_id).result) for job_id in ids] == [
        ("succeeded", {"done": what}) for what in "abc"
    ]
    assert _job(marker).attempts == 3  # each sibling's write ran once
    with session_scope() as session:  # rows written by one transaction carry its id as their xmin
        writers = session.execute(
            select(text("xmin::text")).select_from(_JOBS).where(_JOBS.c.id.in_([*ids, marker]))
        ).scalars()
        assert len(set(writers)) == 1
    assert _run(messages, SiblingWrite.name) == "skipped"  # a redelivery writes nothing twice
    assert _job(marker).attempts == 3
    _forget(marker)


def test_a_sibling_answered_long_after_the_others_is_written_alone(database):
    marker, ids, messages = _written_together("a", "slow")

    assert _run(messages, SiblingWrite.name) == "succeeded"

    fast, slow = _job(ids[0]), _job(ids[1])
    assert (fast.status, slow.status) == ("succeeded", "succeeded")
    assert (slow.updated_at - fast.updated_at).total_seconds() > 0.3  # not held back for its sibling
    with session_scope() as session:
        writers = session.execute(select(text("xmin::text")).select_from(_JOBS).where(_JOBS.c.id.in_(ids))).scalars()
        assert len(set(writers)) == 2
    assert _job(marker).attempts == 2
    _forget(marker)


def test_a_sibling_that_fails_leaves_the_joint_write_to_the_others(database):
    marker, ids, messages = _written_together("a", "permanent", "c")

    with pytest.raises(AttemptFailed):
        _run(messages, SiblingWrite.name)

    assert [_job(job_id).status for job_id in ids] == ["succeeded", "failed", "succeeded"]
    assert _job(marker).attempts == 2
    _forget(marker)


def _forget(marker: uuid.UUID) -> None:
    """Delete the marker job, never run (left queued, a later test's relay would send it)."""
    with session_scope() as session:
        session.execute(delete(Job).where(col(Job.id) == marker))


def test_jobs_not_recorded_together_go_one_message_each(database):
    with session_scope() as session:
        first, second = (
            jobs.record(
                session, kind=SiblingJob.name, tenant_id=None, subject_type="script", subject_id=f"x:{n}", trace_id=None
            )
            for n in (1, 2)
        )
        messages = take_pending(session)
    assert messages == [
        (SiblingJob.name, {"job_id": str(first.id)}),
        (SiblingJob.name, {"job_id": str(second.id)}),
    ]
    with session_scope() as session:  # never run: left queued, a later test's relay would send them
        session.execute(delete(Job).where(col(Job.id).in_([first.id, second.id])))
