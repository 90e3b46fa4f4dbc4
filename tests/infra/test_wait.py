"""Waits woken by the job's outcome message (``infra/wait.py``), on a real worker and real Redis.

Each test runs its own :class:`infra.wait.JobWaits` (what an api process starts in its cleanup_ctx)
against the run's Redis and key prefix. The database poll behind the subscription is set to a
minute where a test proves the notification woke the wait: a wait bounded by 30 s cannot have been
ended by that poll.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from sqlalchemy import update

from infra import jobs
from infra.celery import celery_app
from infra.jobs import PermanentError
from infra.task import JobTask
from infra.wait import JobWaits, outcome_message, read_outcomes
from storage.db import session_scope
from storage.models import Job
from tests.conftest import REDIS_PREFIX, TEST_REDIS_URL, run_redis

pytestmark = pytest.mark.worker

LONG_POLL = 60.0


class WaitedJob(JobTask):
    """``ok`` succeeds, ``sleep:S`` succeeds after S seconds, ``declined`` fails for good."""

    name = "tests.waited_job"
    lease_seconds = 10

    def perform(self, job, inputs):
        mode, _, seconds = (job.subject_id or "").partition(":")
        if mode == "declined":
            raise PermanentError("DECLINED", "the provider declined")
        if mode == "sleep":
            time.sleep(float(seconds))
        return {"attempt": job.attempts, "secret": "never published"}

    def apply(self, session, job, outcome):
        return outcome


celery_app.register_task(WaitedJob())


def _record(subject: str) -> Job:
    with session_scope() as session:
        return jobs.record(
            session, kind=WaitedJob.name, tenant_id=None, subject_type="test", subject_id=subject, trace_id=None
        )


async def _read(ids):
    def unit():
        with session_scope() as session:
            return read_outcomes(session, ids)

    return await asyncio.to_thread(unit)


async def _started(redis_url: str | None, poll_seconds: float) -> JobWaits:
    waits = JobWaits(redis_url, prefix=REDIS_PREFIX, poll_seconds=poll_seconds)
    await waits.start()
    return waits


def _wait_for(
    subject: str,
    *,
    redis_url: str | None = TEST_REDIS_URL,
    poll_seconds: float = LONG_POLL,
    settled_before_subscribing: bool = False,
):
    """Record a job of ``subject`` and wait for it (at most 30 s) with a :class:`JobWaits` of its own,
    started before the job is recorded, or once it has settled; ``(its outcome, the JobWaits)``."""

    async def scenario():
        waits = None if settled_before_subscribing else await _started(redis_url, poll_seconds)
        since = time.monotonic()
        job = await asyncio.to_thread(_record, subject)
        if waits is None:
            while (await _read([job.id]))[job.id].status not in ("succeeded", "failed"):  # its message went out
                await asyncio.sleep(0.05)
            waits = await _started(redis_url, poll_seconds)
        try:
            return (await waits.wait([job.id], _read, timeout=30, since=since))[job.id], waits
        finally:
            await waits.close()

    return asyncio.run(scenario())


def test_a_wait_is_woken_by_the_outcome_message(worker):
    outcome, waits = _wait_for("ok")
    assert outcome.status == "succeeded"
    assert outcome.result == {}  # the job result's other keys never ride on the message
    assert waits.notified == 1 and waits.polls == 0  # woken by the message: the database was not read at all


def test_a_wait_for_several_jobs_is_woken_once_when_the_last_settles(worker):
    """Two jobs recorded together (a payment method's rails), one slower: their two messages reach
    the process, and the waiting request resumes once, with both outcomes, without a database read."""

    async def scenario():
        waits = await _started(TEST_REDIS_URL, LONG_POLL)
        since = time.monotonic()
        try:
            slow, fast = await asyncio.gather(asyncio.to_thread(_record, "sleep:0.5"), asyncio.to_thread(_record, "ok"))
            outcomes = await waits.wait([slow.id, fast.id], _read, timeout=30, since=since)
            return {job_id: outcome.status for job_id, outcome in outcomes.items()}, slow, fast, waits
        finally:
            await waits.close()

    statuses, slow, fast, waits = asyncio.run(scenario())
    assert statuses == {slow.id: "succeeded", fast.id: "succeeded"}
    assert waits.notified == 2 and waits.polls == 0
    assert waits.wakes == 1


def test_a_failure_outcome_carries_its_code_only(worker):
    outcome, waits = _wait_for("declined")
    assert waits.notified == 1
    assert outcome.status == "failed"
    assert outcome.result == {"code": "DECLINED", "status": 422}


def test_without_redis_the_wait_polls_the_database(worker):
    outcome, waits = _wait_for("ok", redis_url=None, poll_seconds=0.2)
    assert not waits.subscribed
    assert outcome.status == "succeeded"
    assert waits.notified == 0 and waits.polls >= 1


def test_an_outcome_published_before_the_subscription_is_found_by_the_recheck(worker):
    outcome, waits = _wait_for("ok", settled_before_subscribing=True)
    assert outcome.status == "succeeded"
    assert waits.notified == 0 and waits.polls == 1  # the one database read after subscribing found it


def test_a_lost_message_is_made_up_for_by_the_safety_net_poll(worker):
    """A job settled without its message (as if Redis dropped it) still ends the wait."""

    async def scenario():
        waits = await _started(TEST_REDIS_URL, 0.3)
        try:
            since = time.monotonic()
            with session_scope() as session:  # recorded and settled in SQL: nothing is published
                job = Job(kind="tests.unsent", status="running", tenant_id=None, subject_id=None, trace_id=None)
                session.add(job)
            waiting = asyncio.create_task(waits.wait([job.id], _read, timeout=30, since=since))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            with session_scope() as session:
                session.execute(update(Job).where(Job.id == job.id).values(status="succeeded"))
            return job, await waiting, waits.notified, waits.polls
        finally:
            await waits.close()

    job, outcomes, notified, polls = asyncio.run(scenario())
    assert outcomes[job.id].status == "succeeded"
    assert notified == 0 and polls >= 1


def test_concurrent_waits_in_one_process_share_one_subscription(worker):
    count = 20
    client = run_redis()

    def subscribers(name: str) -> list[dict]:
        return [c for c in client.client_list() if c.get("name") == name and c.get("psub") == "1"]

    async def scenario():
        waits = await _started(TEST_REDIS_URL, LONG_POLL)
        try:
            since = time.monotonic()
            recorded = await asyncio.gather(*(asyncio.to_thread(_record, "sleep:0.2") for _ in range(count)))
            tasks = [asyncio.create_task(waits.wait([job.id], _read, timeout=60, since=since)) for job in recorded]
            while waits.waiting < count and not all(task.done() for task in tasks):
                await asyncio.sleep(0.01)
            during = subscribers(waits.client_name)
            outcomes = await asyncio.gather(*tasks)
            return recorded, outcomes, during, waits.notified, waits.polls
        finally:
            await waits.close()

    try:
        recorded, outcomes, during, notified, polls = asyncio.run(scenario())
    finally:
        client.close()
    assert len(during) == 1  # one connection, one pattern, however many requests wait
    assert all(result[job.id].status == "succeeded" for job, result in zip(recorded, outcomes, strict=True))
    assert notified == count and polls == 0


@pytest.mark.parametrize("result", [{"code": "X", "sealed": "abc", "number": "4242424242424242"}, None])
def test_the_message_carries_no_secret(result):
    job_id = uuid.UUID(int=1)  # a fixed id: a random one's hex may hold "abc" by chance
    body = json.loads(outcome_message(job_id, "succeeded", result))
    assert body["job_id"] == str(job_id)
    assert set(body["result"]) <= {"code"}
    assert "4242" not in json.dumps(body) and "abc" not in json.dumps(body)


def test_one_message_for_jobs_settled_together_wakes_their_wait_once(worker):
    """Jobs settled by one commit (a payment method's rails) publish one message holding both
    outcomes (``publish_outcomes``): the wait for both resumes once, with both, from that message;
    the message keeps only the safe part of each result. A malformed message is ignored."""
    from infra.wait import outcomes_message, publish_outcomes

    first, second = uuid.UUID(int=2), uuid.UUID(int=3)
    body = json.loads(outcomes_message([(first, "succeeded", {"rail_status": "enabled", "number": "4242"}, None)] * 2))
    assert [one["result"] for one in body["outcomes"]] == [{"rail_status": "enabled"}] * 2

    async def scenario():
        waits = await _started(TEST_REDIS_URL, LONG_POLL)
        try:
            waiting = asyncio.create_task(waits.wait([first, second], _read, timeout=30, since=time.monotonic()))
            while waits.waiting < 2:
                await asyncio.sleep(0.01)
            waits._deliver(b'{"outcomes": [{"job_id": "not an id"}]}')
            waits._deliver(b'{"outcomes": 3}')
            await asyncio.to_thread(
                publish_outcomes,
                [(first, "succeeded", {"rail_status": "enabled"}, {"a": 1}), (second, "succeeded", {}, None)],
            )
            outcomes = await waiting
            return outcomes, waits.wakes, waits.polls, waits.notified
        finally:
            await waits.close()

    outcomes, wakes, polls, notified = asyncio.run(scenario())
    assert (outcomes[first].status, outcomes[first].result, outcomes[first].answer) == (
        "succeeded",
        {"rail_status": "enabled"},
        {"a": 1},
    )
    assert (outcomes[second].status, outcomes[second].answer) == ("succeeded", None)
    assert wakes == 1 and polls == 0 and notified == 2


def test_a_requests_job_answers_only_to_the_process_that_recorded_it(worker):
    """Two api processes' subscriptions: a job recorded while the context answers to the first
    (``reply_to_waits``, as an api request does) carries its address in the task message's
    ``reply_to``; the worker publishes its outcome on that process's channel only, so the first is
    woken by it and the second never sees it. A job recorded answering to nobody (the outbox relay's
    re-send) is published on its own channel, which both read."""
    from infra.wait import message_reply_to, reply_to_waits

    async def scenario():
        first, second = await _started(TEST_REDIS_URL, LONG_POLL), await _started(TEST_REDIS_URL, LONG_POLL)
        try:
            assert first.reply_address == first.address and first.address != second.address
            reply_to_waits(first.reply_address)
            assert message_reply_to() == f"tessera-job-waits:{first.address}"
            since = time.monotonic()
            addressed = await asyncio.to_thread(_record, "ok")
            outcome = (await first.wait([addressed.id], _read, timeout=30, since=since))[addressed.id]
            reply_to_waits(None)
            assert message_reply_to() is None
            broadcast = await asyncio.to_thread(_record, "ok")
            both = await asyncio.gather(
                first.wait([broadcast.id], _read, timeout=30, since=since),
                second.wait([broadcast.id], _read, timeout=30, since=since),
            )
            await asyncio.sleep(0.2)  # a stray message for the addressed job would have come by now
            return addressed, outcome, broadcast, both, first, second
        finally:
            await first.close()
            await second.close()

    addressed, outcome, broadcast, both, first, second = asyncio.run(scenario())
    assert outcome.status == "succeeded"
    assert [result[broadcast.id].status for result in both] == ["succeeded", "succeeded"]
    assert first.notified == 2 and first.polls == 0
    assert second.notified == 1 and second.polls == 0
    assert addressed.id not in second._recent  # the second process never read the addressed outcome
