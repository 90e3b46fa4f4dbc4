"""The job template on a real worker: leases, transient retries, permanent failures, dead letters."""

from __future__ import annotations

import datetime as dt

from infra import jobs, outbox
from infra.celery import celery_app
from infra.jobs import PermanentError, TransientError
from infra.task import JobTask
from storage.db import session_scope
from storage.models import Job
from tests.helpers import wait_until


class ScriptedJob(JobTask):
    """Fails as its subject says: ``transient:N`` fails N times then succeeds, ``permanent`` always
    fails for good, ``forever`` is always transient."""

    name = "tests.scripted_job"
    lease_seconds = 5

    def perform(self, job):
        mode, _, count = (job.subject_id or "").partition(":")
        if mode == "permanent":
            raise PermanentError("DECLINED", "the provider declined")
        if mode == "forever" or (mode == "transient" and job.attempts <= int(count)):
            raise TransientError("provider answered 503", retry_after=0.2)
        return {"attempt": job.attempts}

    def apply(self, session, job, outcome):
        return outcome

    def on_job_failure(self, session, job, error):
        job.result = {**(job.result or {}), "on_failure": type(error).__name__}
        session.add(job)


celery_app.register_task(ScriptedJob())


def _record(subject: str, max_attempts: int = 5) -> Job:
    with session_scope() as session:
        return jobs.record(session, kind=ScriptedJob.name, tenant_id=None, subject_id=subject, trace_id=None,
                           max_attempts=max_attempts)


def _job(job_id) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _settled(job_id, status: str, timeout: float = 20) -> Job:
    return wait_until(lambda: (job := _job(job_id)).status == status and job, timeout=timeout)


def test_transient_failures_are_retried_until_success(worker):
    job = _settled(_record("transient:2").id, "succeeded")
    assert job.attempts == 3
    assert job.result == {"attempt": 3}


def test_a_permanent_failure_is_recorded_and_not_retried(worker):
    job = _settled(_record("permanent").id, "failed")
    assert job.attempts == 1
    assert job.last_error.startswith("DECLINED")
    assert job.result["on_failure"] == "PermanentError"


def test_exhausted_retries_make_a_dead_letter_that_can_be_replayed(worker):
    job = _settled(_record("forever", max_attempts=2).id, "dead")
    assert job.attempts == 2
    assert "503" in job.last_error
    assert job.result == {"on_failure": "TransientError"}
    with session_scope() as session:
        row = session.get(Job, job.id)
        row.subject_id = "transient:0"
        jobs.requeue(session, row)
    assert _settled(job.id, "succeeded").attempts == 1


def test_only_one_worker_wins_the_lease(database):
    with session_scope() as session:
        job = Job(kind=ScriptedJob.name, subject_id="transient:0")
        session.add(job)
    with session_scope() as session:
        assert jobs.lease(session, job.id, "a", lease_seconds=30) is not None
    with session_scope() as session:
        assert jobs.lease(session, job.id, "b", lease_seconds=30) is None


def test_a_job_whose_worker_died_is_released_and_relayed(worker):
    with session_scope() as session:  # recorded, then "the worker died" holding an expired lease
        job = Job(kind=ScriptedJob.name, subject_id="transient:0", status="running", attempts=1,
                  lease_owner="dead", lease_expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        session.add(job)
    with session_scope() as session:
        assert outbox.release_stale_leases(session) >= 1
    with session_scope() as session:
        assert outbox.relay(session, grace_seconds=0) >= 1
    assert _settled(job.id, "succeeded").attempts == 2
