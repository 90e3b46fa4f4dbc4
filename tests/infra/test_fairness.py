"""Fairness between tenants at lease time (``infra/fairness.py``, :class:`infra.task.JobTask`): a job
task's run gives way to a waiting tenant only when its own tenant holds at least two more runs of
the group; a tenant alone keeps every slot. Real PostgreSQL; the runs are called in this process,
the runs held by other worker processes are live leases written into the rows."""

from __future__ import annotations

import datetime as dt
import os
import threading
import uuid

import pytest
from sqlalchemy import update

import tasks.agentic
import tasks.reactors  # noqa: F401  (registers the reactor tasks)
from domain.tenancy.tenants import create_tenant
from infra import jobs
from infra.celery import celery_app
from infra.dispatch import take_pending
from infra.task import JobTask
from storage.db import session_scope
from storage.models import Job
from storage.states import JOB_TAKEABLE, JobStatus
from storage.types import utcnow
from tasks.account_updater import ProcessChunk
from tasks.mail import InvitationMail, WebhookDisabledMail
from tasks.network_tokens import Provision

#: ``(job id, thread)`` of each run of :class:`_Noted`. The run under test is called in the test's
#: thread; a job it hands back is sent again and may be run meanwhile by the run's Celery worker, a
#: thread of this process: :func:`_ran_here` keeps the test's own runs.
RAN: list[tuple[uuid.UUID, int]] = []
#: The tenants the running test made (:func:`_tenant`), whose unfinished jobs it cancels at the end.
TENANTS: list[uuid.UUID] = []


class _Noted(JobTask):
    """A job task of a queue of its own (``default``) that notes which job it ran."""

    name = "fairness_tests.noted"
    lease_seconds = 30.0

    def perform(self, job, inputs):
        RAN.append((job.id, threading.get_ident()))

    def apply(self, session, job, outcome):
        return {"ran": True}


noted = celery_app.register_task(_Noted())


def _ran_here() -> list[uuid.UUID]:
    """The jobs :class:`_Noted` ran in this thread since ``RAN`` was cleared, in order."""
    return [job_id for job_id, thread in RAN if thread == threading.get_ident()]


def _tenant() -> uuid.UUID:
    with session_scope() as session:
        tenant_id = create_tenant(session, name="fair", owner_email=f"fair-{os.urandom(4).hex()}@example.com").tenant_id
    TENANTS.append(tenant_id)
    return tenant_id


def _cancel(*where) -> None:
    """Cancel the jobs still queued or running that match ``where``."""
    with session_scope() as session:
        session.execute(
            update(Job)
            .where(*where, Job.status.in_(JOB_TAKEABLE))
            .values(status=JobStatus.CANCELLED, lease_owner=None, lease_expires_at=None)
        )


@pytest.fixture(autouse=True)
def _cancel_leftovers(database):
    """The database is shared by the whole run. Before each test, the tenants' jobs other tests left
    queued or running in the groups used here (the ``default`` queue's and ``mail``'s) are cancelled:
    a waiting tenant of another test would be served first when its id sorts first. After each test,
    its own tenants' unfinished jobs (the flood left waiting, the runs "held by other workers", a job
    handed back) are cancelled: later tests expect no due work they did not make (the outbox relay
    would send it)."""
    groups = {*noted.fair_group, *WebhookDisabledMail().fair_group}
    _cancel(Job.kind.in_(groups), Job.tenant_id.is_not(None))
    TENANTS.clear()
    yield
    if TENANTS:
        _cancel(Job.tenant_id.in_(TENANTS))


def _jobs(tenant_id: uuid.UUID, count: int, *, held_by: str | None = None) -> list[uuid.UUID]:
    """``count`` queued jobs of ``tenant_id``, due a minute ago; ``held_by``: running under that
    owner's live lease instead (runs held by another worker process)."""
    with session_scope() as session:
        ids = [
            jobs.record(
                session, kind=noted.name, tenant_id=tenant_id, subject_type="test", subject_id="x", trace_id=None
            ).id
            for _ in range(count)
        ]
        take_pending(session)  # no message: a worker of another test must not take them
    values: dict = {"due_at": utcnow() - dt.timedelta(minutes=1)}
    if held_by is not None:
        values |= {"status": "running", "lease_owner": held_by, "lease_expires_at": utcnow() + dt.timedelta(minutes=5)}
    with session_scope() as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(**values))
    return ids


def _job(job_id: uuid.UUID) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        session.expunge(job)
        return job


def test_a_lone_tenant_keeps_every_slot(database):
    flooder = _tenant()
    _jobs(flooder, 2, held_by="host:1:other-worker")
    mine, *_rest = _jobs(flooder, 3)
    RAN.clear()
    assert noted.run(str(mine)) == "succeeded"
    assert _ran_here() == [mine] and _job(mine).status == "succeeded"


def test_a_tenant_holding_two_more_runs_gives_way_to_a_waiting_tenant(database):
    flooder, newcomer = _tenant(), _tenant()
    _jobs(flooder, 1, held_by="host:1:other-worker")
    mine, *_rest = _jobs(flooder, 3)
    [waiting] = _jobs(newcomer, 1)
    RAN.clear()
    assert noted.run(str(mine)) == "succeeded"
    assert _ran_here() == [waiting] and _job(waiting).status == "succeeded"
    # queued again, its attempt undone, its message sent again (a worker of another test may run it then)
    handed_back = _job(mine)
    assert handed_back.attempts == (0 if handed_back.status == "queued" else 1)
    # the newcomer's own message, taken later, finds its job done: nothing runs twice
    RAN.clear()
    assert noted.run(str(waiting)) == "skipped" and waiting not in _ran_here()


def test_a_tenant_holding_one_run_more_keeps_its_job(database):
    """Two tenants each holding a run, one of them about to take a second: one more than the other is
    its share of three slots; it gives way only at two more."""
    flooder, other = _tenant(), _tenant()
    _jobs(flooder, 1, held_by="host:1:a")
    _jobs(other, 1, held_by="host:1:b")
    mine = _jobs(flooder, 1)[0]
    [waiting] = _jobs(other, 1)
    RAN.clear()
    assert noted.run(str(mine)) == "succeeded"
    assert _ran_here() == [mine] and _job(waiting).status == "queued"


def test_a_tenant_that_holds_nothing_goes_first(database):
    """Among waiting tenants, one holding no run is served before one holding some."""
    flooder, busy, newcomer = _tenant(), _tenant(), _tenant()
    _jobs(flooder, 3, held_by="host:1:a")
    _jobs(busy, 1, held_by="host:1:b")
    _jobs(busy, 2)
    mine = _jobs(flooder, 1)[0]
    [waiting] = _jobs(newcomer, 1)
    RAN.clear()
    assert noted.run(str(mine)) == "succeeded"
    assert _ran_here() == [waiting]


def test_the_groups_are_the_fair_job_kinds_of_each_queue():
    provider = Provision().fair_group
    assert {"network_tokens.provision", "network_tokens.cryptogram", "agentic.enroll_rail"} <= set(provider)
    assert all(kind.split(".")[0] in ("network_tokens", "agentic", "wallets", "enrichments") for kind in provider)
    assert {InvitationMail.name, WebhookDisabledMail.name} <= set(WebhookDisabledMail().fair_group)
    assert "account_updater.process_chunk" in ProcessChunk().fair_group
    assert "reactors.run" not in celery_app.tasks["reactors.build"].fair_group


def test_a_waiting_tenants_mail_goes_out_in_place_of_a_flooders(database):
    """The same rule on a real queue's kinds: tenant A holds two ``mail`` runs and floods, tenant B's
    mail is sent by the run that took A's next message (a notice of a webhook since deleted: nothing
    to send, the job succeeds ``{"sent": false}``)."""
    task = celery_app.tasks[WebhookDisabledMail.name]

    def mails(tenant_id: uuid.UUID, count: int, *, held_by: str | None = None) -> list[uuid.UUID]:
        with session_scope() as session:
            ids = [
                jobs.record(
                    session,
                    kind=WebhookDisabledMail.name,
                    tenant_id=tenant_id,
                    subject_type="webhook",
                    subject_id=str(uuid.uuid4()),
                    trace_id=None,
                ).id
                for _ in range(count)
            ]
            take_pending(session)  # no message: a worker of another test must not take them
            if held_by is not None:
                session.flush()
                session.execute(
                    update(Job)
                    .where(Job.id.in_(ids))
                    .values(status="running", lease_owner=held_by, lease_expires_at=utcnow() + dt.timedelta(minutes=5))
                )
        return ids

    flooder, newcomer = _tenant(), _tenant()
    mails(flooder, 1, held_by="host:1:mail-a")
    mails(flooder, 1, held_by="host:1:mail-b")
    mine, *_rest = mails(flooder, 3)
    [waiting] = mails(newcomer, 1)
    assert task.run(str(mine)) == "succeeded"
    sent = _job(waiting)
    assert (sent.status, sent.result) == ("succeeded", {"sent": False})
    handed_back = _job(mine)  # its attempt undone (a worker of another test may run it afterwards)
    assert handed_back.attempts == (0 if handed_back.status == "queued" else 1)
