"""A webhook delivery's work is a job of the one protocol, on real PostgreSQL: written with its event,
leased in batches (one worker wins each row), settled failed, dead or succeeded, replayed by the
operator and re-sent by the relay in batch messages. Messages are taken before they are sent
(``take_pending``) so no worker interferes: each test drives the deliveries itself."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import update
from sqlmodel import select

from config.settings import get_settings
from domain.tenancy.tenants import create_tenant
from domain.webhooks import deliveries as webhooks
from domain.webhooks import events, service, views
from infra import job_admin, jobs, outbox
from infra.celery import DELIVER_TASK
from infra.dispatch import BATCH_SIZE, take_pending
from infra.http import DeliveryResult
from storage.db import session_scope
from storage.models import Job, Webhook, WebhookAttempt, WebhookDelivery
from tests.helpers import race

pytestmark = pytest.mark.worker


def _tenant_with_webhooks(*urls: str) -> tuple[uuid.UUID, list[uuid.UUID]]:
    with session_scope() as session:
        tenant_id = create_tenant(
            session, name="deliveries", owner_email=f"o-{uuid.uuid4().hex[:8]}@example.com"
        ).tenant_id
    with session_scope() as session:
        hooks = [
            Webhook(tenant_id=tenant_id, name=f"h{i}", url=url, events=["token.created"]) for i, url in enumerate(urls)
        ]
        session.add_all(hooks)
    return tenant_id, [h.id for h in hooks]


def _emit(tenant_id: uuid.UUID, count: int = 1) -> tuple[list[uuid.UUID], list[tuple[str, dict]]]:
    """``count`` events; returns their delivery ids and the messages the commit would have sent."""
    with session_scope() as session:
        emitted = [
            events.emit(session, tenant_id=tenant_id, type="token.created", data={"n": n}, trace_id="t-1")
            for n in range(count)
        ]
        ids = list(session.exec(select(WebhookDelivery.id).where(WebhookDelivery.event_id.in_(emitted))).all())
        sent = take_pending(session)
    return ids, sent


def _job(job_id: uuid.UUID) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _delivery(delivery_id: uuid.UUID) -> WebhookDelivery:
    with session_scope() as session:
        return session.get(WebhookDelivery, delivery_id)


def test_each_delivery_job_is_written_with_its_event_and_sent_in_one_batch_message(database):
    tenant_id, hooks = _tenant_with_webhooks("https://example.com/a", "https://example.com/b")
    ids, sent = _emit(tenant_id, count=3)
    assert len(ids) == 6
    with session_scope() as session:
        rows = session.exec(
            select(WebhookDelivery, Job).join(Job, Job.id == WebhookDelivery.id).where(WebhookDelivery.id.in_(ids))
        ).all()
    assert len(rows) == 6
    for delivery, job in rows:
        assert (job.kind, job.status, job.attempts, job.tenant_id, job.subject_type, job.trace_id) == (
            DELIVER_TASK,
            "queued",
            0,
            tenant_id,
            "webhook",
            "t-1",
        )
        assert job.subject_id == str(delivery.webhook_id) and delivery.webhook_id in hooks
        assert job.max_attempts == len(get_settings().webhook_retry_delays) + 1
        assert delivery.status == "pending" and delivery.completed_at is None
    assert [task for task, _ in sent] == [DELIVER_TASK]  # one message for the transaction's deliveries
    assert sorted(sent[0][1]["delivery_ids"]) == sorted(map(str, ids))


def test_events_queued_in_the_callers_rows_are_jobs_and_deliveries_too(database):
    from storage.db import Rows, insert_rows

    tenant_id, hooks = _tenant_with_webhooks("https://example.com/staged")
    events.subscriptions.clear()
    with session_scope() as session:
        rows = Rows()
        event_ids = events.emit(
            session, tenant_id=tenant_id, type="token.created", data=[{}, {}], trace_id=None, rows=rows
        )
        assert len(event_ids) == 2
        insert_rows(session, rows)
        sent = take_pending(session)
    ids = sent[0][1]["delivery_ids"]
    assert [task for task, _ in sent] == [DELIVER_TASK] and len(ids) == 2
    for delivery_id in ids:
        job = _job(uuid.UUID(delivery_id))
        assert (job.kind, job.status, job.subject_id) == (DELIVER_TASK, "queued", str(hooks[0]))
        assert _delivery(uuid.UUID(delivery_id)).status == "pending"


def test_two_workers_leasing_one_batch_each_win_different_rows_and_count_one_attempt(database):
    tenant_id, _ = _tenant_with_webhooks("https://example.com/race")
    ids, _ = _emit(tenant_id, count=80)

    def lease(owner: str) -> list[uuid.UUID]:
        with session_scope() as session:
            statement = jobs.lease(ids, owner, lease_seconds=60).returning(Job.id)
            return list(session.execute(statement).scalars())

    got = race(lease)
    assert not set(got["a"]) & set(got["b"])
    assert sorted(got["a"] + got["b"]) == sorted(ids)
    with session_scope() as session:
        leased = session.exec(select(Job.status, Job.attempts, Job.lease_owner).where(Job.id.in_(ids))).all()
    assert {(status, attempts) for status, attempts, _ in leased} == {("running", 1)}
    assert {owner for _, _, owner in leased} <= {"a", "b"}
    with session_scope() as session:  # a third worker (or a duplicate message) gets none of them
        assert session.execute(jobs.lease(ids, "c", lease_seconds=60)).rowcount == 0


def test_a_4xx_answer_fails_the_delivery_after_one_attempt(database, receiver):
    tenant_id, _ = _tenant_with_webhooks(receiver.url)
    [delivery_id], _ = _emit(tenant_id)
    receiver.status = 404
    assert webhooks.attempt(delivery_id, "w", get_settings()) == "http_error"
    job, delivery = _job(delivery_id), _delivery(delivery_id)
    assert (job.status, job.attempts, job.last_error, job.lease_owner) == ("failed", 1, "HTTP 404", None)
    assert (delivery.status, delivery.last_status_code) == ("failed", 404) and delivery.completed_at is not None
    with session_scope() as session:
        numbers = session.exec(select(WebhookAttempt.number).where(WebhookAttempt.delivery_id == delivery_id)).all()
    assert numbers == [1]
    assert webhooks.attempt(delivery_id, "w", get_settings()) == "skipped"  # not retried
    assert len(receiver.received) == 1


def test_a_retry_is_the_job_queued_again_with_its_delay(database, receiver):
    tenant_id, _ = _tenant_with_webhooks(receiver.url)
    [delivery_id], _ = _emit(tenant_id)
    receiver.status = 503
    settings = get_settings().model_copy(update={"webhook_retry_schedule": "30,30"})
    with session_scope() as session:
        prepared, closed = webhooks.lease_batch(session, [delivery_id], "w", lease_seconds=60)
    assert [p.attempt_number for p in prepared] == [1] and not closed
    results = [DeliveryResult(outcome="http_error", status_code=503, duration_ms=1, error="HTTP 503", transient=True)]
    with session_scope() as session:
        outcome = webhooks.record_outcomes(session, prepared, results, closed, settings)
        sent = take_pending(session)
    assert (outcome.retrying, outcome.failed, outcome.dead) == (1, 0, 0)
    assert sent == [(DELIVER_TASK, {"delivery_ids": [str(delivery_id)]})]  # a 30 s countdown
    job, delivery = _job(delivery_id), _delivery(delivery_id)
    assert (job.status, job.attempts, job.last_error, job.lease_owner, job.enqueued_at) == (
        "queued",
        1,
        "HTTP 503",
        None,
        None,
    )
    assert 25 < (job.due_at - dt.datetime.now(dt.UTC)).total_seconds() <= 30
    assert (delivery.status, delivery.last_status_code, delivery.completed_at) == ("pending", 503, None)


def test_a_spent_schedule_is_a_dead_letter_that_the_operator_replays(database, receiver):
    tenant_id, _ = _tenant_with_webhooks(receiver.url)
    [delivery_id], _ = _emit(tenant_id)
    with session_scope() as session:  # every attempt but the last one made
        session.execute(update(Job).where(Job.id == delivery_id).values(attempts=Job.max_attempts - 1))
    receiver.status = 503
    settings = get_settings()
    outcome = webhooks.deliver_batch([delivery_id], "w", settings)
    assert (outcome.counts, outcome.failed, outcome.dead, outcome.retrying) == ({"http_error": 1}, 1, 1, 0)
    job = _job(delivery_id)
    assert (job.status, job.attempts, job.last_error) == ("dead", job.max_attempts, "HTTP 503")
    assert _delivery(delivery_id).status == "failed"
    with session_scope() as session:
        dead = job_admin.list_jobs(session, settings, states=["dead"], kind=DELIVER_TASK, tenant_id=tenant_id)
    assert [(row["id"], row["state"]) for row in dead] == [(str(delivery_id), "failed")]

    with session_scope() as session:
        replayed = job_admin.retry(session, settings, views.message_id(delivery_id))
        sent = take_pending(session)
    assert (replayed["state"], replayed["attempts"]) == ("pending", 0)
    assert sent == [(DELIVER_TASK, {"delivery_ids": [str(delivery_id)]})]
    receiver.status = 200
    assert webhooks.attempt(delivery_id, "w", settings) == "success"
    job, delivery = _job(delivery_id), _delivery(delivery_id)
    assert (job.status, job.attempts, delivery.status, delivery.last_status_code) == ("succeeded", 1, "succeeded", 200)
    assert {r.headers["webhook-id"] for r in receiver.received} == {views.message_id(delivery_id)}
    with session_scope() as session:
        refused = None
        try:
            job_admin.retry(session, settings, str(delivery_id))
        except job_admin.Refused as exc:
            refused = str(exc)
    assert refused and "succeeded" in refused


def test_the_relay_sends_stranded_deliveries_in_batch_messages(database):
    tenant_id, _ = _tenant_with_webhooks("https://example.com/stranded")
    ids, _ = _emit(tenant_id, count=BATCH_SIZE + 5)  # the messages were lost with the process
    earlier = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    with session_scope() as session:
        session.execute(update(Job).where(Job.id.in_(ids)).values(due_at=earlier))
    with session_scope() as session:
        assert outbox.relay(session, grace_seconds=0, batch=100_000) >= len(ids)
        sent = take_pending(session)
    relayed = [kwargs for task, kwargs in sent if task == DELIVER_TASK]
    assert all(set(kwargs) == {"delivery_ids"} and len(kwargs["delivery_ids"]) <= BATCH_SIZE for kwargs in relayed)
    mine = [i for kwargs in relayed for i in kwargs["delivery_ids"] if uuid.UUID(i) in set(ids)]
    assert sorted(mine) == sorted(map(str, ids))
    assert len([kwargs for kwargs in relayed if set(kwargs["delivery_ids"]) & set(map(str, ids))]) <= 3
    with session_scope() as session:  # marked: the next pass does not send them again
        assert session.exec(select(Job.enqueued_at).where(Job.id.in_(ids))).all().count(None) == 0


def test_deleting_a_webhook_deletes_its_deliveries_with_their_jobs(database):
    from domain.tenancy.caller import Caller

    tenant_id, [hook, kept] = _tenant_with_webhooks("https://example.com/gone", "https://example.com/kept")
    ids, _ = _emit(tenant_id, count=2)
    caller = Caller(
        tenant_id=tenant_id, tenant_type="test", application_id=None, application_type=None, permissions=frozenset()
    )
    with session_scope() as session:
        service.delete_webhook(session, caller, hook)
    with session_scope() as session:
        left = session.exec(
            select(WebhookDelivery.webhook_id, Job.subject_id)
            .join(Job, Job.id == WebhookDelivery.id)
            .where(Job.id.in_(ids))
        ).all()
        jobs_left = session.exec(select(Job.id).where(Job.id.in_(ids))).all()
    assert left == [(kept, str(kept))] * 2 and len(jobs_left) == 2  # no job is left without its delivery


def test_a_lone_tenant_behind_on_its_deliveries_keeps_every_slot_until_another_tenant_waits(database):
    """Fairness takes capacity from a tenant only to give it to another one: a tenant at its slots
    gives way only while another tenant has a delivery due, and then that tenant's deliveries are taken
    in place of its own (handed back). The clock of the check is set back to 2000 (its jobs due in
    1999) so that the deliveries other tests left waiting are not due then."""
    settings = get_settings().model_copy(update={"webhook_tenant_slots": 1, "webhook_backlog_seconds": 2.0})
    then = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    flooder, _ = _tenant_with_webhooks("https://example.com/flood")
    flood, _ = _emit(flooder, count=4)
    with session_scope() as session:  # behind since 1999, and one worker slot held by a live lease
        session.execute(update(Job).where(Job.id.in_(flood)).values(due_at=then - dt.timedelta(days=1)))
        session.execute(
            update(Job)
            .where(Job.id == flood[0])
            .values(status="running", lease_owner="worker-1", lease_expires_at=then + dt.timedelta(minutes=5))
        )
    waiting = flood[1:]
    with session_scope() as session:
        assert webhooks.share_batch(session, waiting, settings, now=then) == (set(), [])
    assert all(_job(job_id).due_at == then - dt.timedelta(days=1) for job_id in waiting)

    # alone, in short turns: a run keeps one round of concurrent POSTs and sends the rest again at once
    one_round = settings.model_copy(update={"webhook_host_concurrency": 1})
    with session_scope() as session:
        assert webhooks.share_batch(session, waiting, one_round, now=then) == (set(waiting[1:]), [])
        sent = take_pending(session)
    assert sent == [(DELIVER_TASK, {"delivery_ids": [str(job_id) for job_id in waiting[1:]]})]
    assert _job(waiting[0]).due_at == then - dt.timedelta(days=1)
    assert all((_job(job_id).status, _job(job_id).due_at) == ("queued", then) for job_id in waiting[1:])

    patient, _ = _tenant_with_webhooks("https://example.com/patient")
    [other], _ = _emit(patient)
    with session_scope() as session:
        session.execute(update(Job).where(Job.id == other).values(due_at=then - dt.timedelta(seconds=1)))
    with session_scope() as session:  # the waiting tenant's delivery is taken in place of the flooder's
        assert webhooks.share_batch(session, waiting, settings, now=then) == (set(waiting), [other])
        sent = take_pending(session)
    assert sent == [(DELIVER_TASK, {"delivery_ids": [str(job_id) for job_id in waiting]})]
    assert all(_job(job_id).status == "queued" for job_id in waiting)
    assert _job(other).due_at == then - dt.timedelta(seconds=1)


def test_a_tenant_behind_fills_a_round_with_its_waiting_deliveries(database):
    """Deliveries sent one a message (as requests emit them) to a slow receiver: a run of a tenant
    behind takes its oldest waiting deliveries up to one round of concurrent POSTs, so the flood goes
    out a round at a time. The clock of the check is set back to 1980."""
    settings = get_settings().model_copy(
        update={"webhook_tenant_slots": 1, "webhook_backlog_seconds": 2.0, "webhook_host_concurrency": 3}
    )
    then = dt.datetime(1980, 1, 1, tzinfo=dt.UTC)
    flooder, _ = _tenant_with_webhooks("https://example.com/one-a-message")
    flood, _ = _emit(flooder, count=5)
    with session_scope() as session:
        for n, job_id in enumerate(flood):  # flood[0] the oldest, flood[-1] the newest
            session.execute(update(Job).where(Job.id == job_id).values(due_at=then - dt.timedelta(minutes=10 - n)))
    with session_scope() as session:  # the message of the newest one: the round takes the two oldest
        aside, in_place = webhooks.share_batch(session, flood[-1:], settings, now=then)
    assert aside == set() and in_place == [flood[0], flood[1]]


def test_a_hand_back_never_queues_again_a_delivery_another_worker_finished(database):
    """A lone tenant's run hands back what it does not deliver itself; a message sent twice (the relay
    re-sends a batch still queued) may name deliveries another worker finished meanwhile: those stay
    succeeded and are not sent again. The clock of the check is set back to 1990."""
    settings = get_settings().model_copy(
        update={"webhook_tenant_slots": 1, "webhook_backlog_seconds": 2.0, "webhook_host_concurrency": 1}
    )
    then = dt.datetime(1990, 1, 1, tzinfo=dt.UTC)  # before anything other tests left waiting is due
    flooder, _ = _tenant_with_webhooks("https://example.com/handed-back")
    flood, _ = _emit(flooder, count=4)
    with session_scope() as session:  # behind since 1999, one slot held; the last one already delivered
        session.execute(update(Job).where(Job.id.in_(flood)).values(due_at=then - dt.timedelta(days=1)))
        session.execute(
            update(Job)
            .where(Job.id == flood[0])
            .values(status="running", lease_owner="worker-1", lease_expires_at=then + dt.timedelta(minutes=5))
        )
        session.execute(update(Job).where(Job.id == flood[3]).values(status="succeeded", attempts=1))
    with session_scope() as session:
        webhooks.share_batch(session, flood[1:], settings, now=then)
    assert (_job(flood[2]).status, _job(flood[2]).due_at) == ("queued", then)  # handed back
    finished = _job(flood[3])
    assert (finished.status, finished.attempts, finished.due_at) == ("succeeded", 1, then - dt.timedelta(days=1))
