"""The job template on a real worker: leases, transient retries, permanent failures, dead letters."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import time
from uuid import uuid4

import pytest

from infra import jobs, outbox
from infra.celery import celery_app
from infra.jobs import PermanentError, TransientError
from infra.task import JobTask
from storage.db import session_scope
from storage.models import Job
from tests.conftest import TEST_BROKER_URL
from tests.helpers import wait_until

pytestmark = pytest.mark.worker


class ScriptedJob(JobTask):
    """Fails as its subject says: ``transient:N`` fails N times then succeeds, ``permanent`` always
    fails for good, ``forever`` is always transient."""

    name = "tests.scripted_job"
    lease_seconds = 5

    def perform(self, job, inputs):
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


class CollectorWatchingJob(JobTask):
    """Reports whether the cyclic garbage collector ran during its perform and apply."""

    name = "tests.collector_watching_job"
    lease_seconds = 5
    pause_gc = True

    def perform(self, job, inputs):
        return {"perform": gc.isenabled()}

    def apply(self, session, job, outcome):
        return {**outcome, "apply": gc.isenabled()}


collector_watching_job = celery_app.register_task(CollectorWatchingJob())


def _record(subject: str, max_attempts: int = 5) -> Job:
    with session_scope() as session:
        return jobs.record(
            session,
            kind=ScriptedJob.name,
            tenant_id=None,
            subject_type="script",
            subject_id=subject,
            trace_id=None,
            max_attempts=max_attempts,
        )


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


def test_a_job_task_that_pauses_the_collector_runs_without_it_and_restores_it(database):
    with session_scope() as session:
        job = Job(kind=CollectorWatchingJob.name, subject_id="gc")
        session.add(job)
    assert gc.isenabled()
    assert collector_watching_job.run(job_id=str(job.id)) == "succeeded"
    assert gc.isenabled()
    assert _job(job.id).result == {"perform": False, "apply": False}


def test_only_one_worker_wins_the_lease(database):
    with session_scope() as session:
        job = Job(kind=ScriptedJob.name, subject_id="transient:0")
        session.add(job)
    assert jobs.lease(job.id, "a", lease_seconds=30) is not None
    assert jobs.lease(job.id, "b", lease_seconds=30) is None


def test_a_job_whose_worker_died_is_released_and_relayed(worker):
    with session_scope() as session:  # recorded, then "the worker died" holding an expired lease
        job = Job(
            kind=ScriptedJob.name,
            subject_id="transient:0",
            status="running",
            attempts=1,
            lease_owner="dead",
            lease_expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1),
        )
        session.add(job)
    with session_scope() as session:
        assert outbox.release_stale_leases(session) >= 1
    with session_scope() as session:
        assert outbox.relay(session, grace_seconds=0) >= 1
    assert _settled(job.id, "succeeded").attempts == 2


class _States:
    """The Celery states the worker reports for one job's runs (what Flower shows), from the worker's
    own signals: one entry per run, in order. Listening starts when it is made, so make it before
    recording the job (a fast worker runs it at once) and name the job afterwards (``job_id``)."""

    def __init__(self, job_id=None):
        from celery import signals

        self.job_id, self._runs = (str(job_id) if job_id is not None else None), []
        self._signals = {
            signals.task_success: self._success,
            signals.task_retry: self._retry,
            signals.task_failure: self._failure,
        }
        for signal, receiver in self._signals.items():
            signal.connect(receiver, weak=False)

    @property
    def states(self) -> list[tuple[str, str]]:
        """``(state, detail)`` of each run of the job, in order."""
        return [state for job_id, state in list(self._runs) if job_id == self.job_id]

    @staticmethod
    def _job_id(request):
        return (getattr(request, "kwargs", None) or {}).get("job_id")

    def _success(self, sender=None, result=None, **_):
        self._runs.append((self._job_id(sender.request), ("SUCCESS", result)))

    def _retry(self, request=None, reason=None, **_):
        self._runs.append((self._job_id(request), ("RETRY", str(reason))))

    def _failure(self, sender=None, exception=None, **_):
        self._runs.append((self._job_id(sender.request), ("FAILURE", str(exception))))

    def close(self):
        for signal, receiver in self._signals.items():
            signal.disconnect(receiver)


def test_attempts_show_as_retry_then_success_each_run_once(worker):
    states = _States()
    job = _record("transient:1")
    states.job_id = str(job.id)
    try:
        _settled(job.id, "succeeded")
        wait_until(lambda: len(states.states) >= 2)
    finally:
        states.close()
    assert [state for state, _ in states.states] == ["RETRY", "SUCCESS"]
    assert "503" in states.states[0][1] and states.states[1][1] == "succeeded"
    assert _job(job.id).attempts == 2


def test_a_permanent_failure_and_a_dead_letter_show_as_failure(worker):
    failed, dead = _States(), _States()
    permanent, forever = _record("permanent"), _record("forever", max_attempts=2)
    failed.job_id, dead.job_id = str(permanent.id), str(forever.id)
    try:
        _settled(permanent.id, "failed")
        _settled(forever.id, "dead")
        wait_until(lambda: failed.states and len(dead.states) >= 2)
    finally:
        failed.close()
        dead.close()
    assert failed.states == [("FAILURE", "DECLINED: the provider declined")]
    assert [state for state, _ in dead.states] == ["RETRY", "FAILURE"]
    assert dead.states[1][1].startswith("dead letter after 2 attempts")


def test_a_retry_past_a_minute_waits_for_the_relay_without_a_message(worker):
    from infra.dispatch import take_pending

    with session_scope() as session:
        job = Job(kind=ScriptedJob.name, subject_id="transient:0", status="running", attempts=1, max_attempts=5)
        session.add(job)
    with session_scope() as session:
        row = session.get(Job, job.id)
        assert jobs.retry(session, row, error="later", delay=120) == 120
        assert take_pending(session) == []  # no countdown message: due_at and the relay carry it
        row = session.get(Job, job.id)
        row_due = row.due_at
    with session_scope() as session:
        assert jobs.retry(session, session.get(Job, job.id), error="soon", delay=2) == 2
        assert take_pending(session) == [(ScriptedJob.name, {"job_id": str(job.id)})]
    assert row_due > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=100)


def test_beat_sends_the_relay_only_when_something_is_due(database):
    from workers.beat import GATES, RELAY_TASK, has_work

    with session_scope() as session:
        job = Job(kind=ScriptedJob.name, subject_id="transient:0")  # recorded; its message "was lost"
        session.add(job)
        due = job.due_at
    with session_scope() as session:
        # nothing recorded in this database was due back then (other tests' rows included)
        assert outbox.relay_due(session, grace_seconds=15, now=dt.datetime(2000, 1, 1, tzinfo=dt.UTC)) is False
        assert outbox.relay_due(session, grace_seconds=15, now=due + dt.timedelta(seconds=16)) is True
    assert RELAY_TASK in GATES and has_work("sweeps.delete_expired_tokens") is True  # ungated
    with session_scope() as session:
        session.get(Job, job.id).status = "cancelled"


def test_replaying_a_dead_mail_job_sends_the_mail(worker, tenant):
    with session_scope() as session:
        job = jobs.record(
            session,
            kind="mail.webhook_disabled",
            tenant_id=tenant.id,
            subject_type="webhook",
            subject_id=str(uuid4()),
            trace_id=None,
            max_attempts=1,
        )
    done = _settled(job.id, "succeeded")  # no such webhook: nothing to tell, succeeded without a mail
    assert done.result == {"sent": False}
    with session_scope() as session:
        row = session.get(Job, job.id)
        row.status = "dead"
        session.add(row)
    with session_scope() as session:
        jobs.requeue(session, session.get(Job, job.id))
    replayed = _settled(job.id, "succeeded")
    assert replayed.attempts == 1 and replayed.result == {"sent": False}


def test_two_workers_racing_for_one_job_one_wins(database):
    """Every kind of job (network tokens, rails, account updater steps, mails) is leased by
    ``jobs.lease``: two workers asking at the same instant, one gets it."""
    import threading

    with session_scope() as session:
        job = Job(kind=ScriptedJob.name, subject_type="script", subject_id="transient:0", status="queued")
        session.add(job)
    won: list[str] = []
    start = threading.Barrier(2)

    def lease(owner: str) -> None:
        start.wait()
        if jobs.lease(job.id, owner, lease_seconds=30) is not None:
            won.append(owner)

    threads = [threading.Thread(target=lease, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 1
    assert _job(job.id).lease_owner == won[0] and _job(job.id).attempts == 1
    with session_scope() as session:
        session.get(Job, job.id).status = "cancelled"


def test_a_retrying_task_names_its_reason_and_attempt_in_the_retry_event(worker):
    """Flower's "Exception" of a retried task is the ``exc`` of its Retry: the error, the attempt and
    when it runs again (not ``None``)."""
    from celery import signals

    seen = []

    def retried(request=None, reason=None, **_):
        if (getattr(request, "kwargs", None) or {}).get("job_id") == str(job.id):
            seen.append(reason)

    signals.task_retry.connect(retried, weak=False)
    try:
        job = _record("transient:1")
        _settled(job.id, "succeeded")
        wait_until(lambda: seen)
    finally:
        signals.task_retry.disconnect(retried)
    [reason] = seen
    assert repr(reason.exc) == repr(reason.exc.__class__(str(reason)))  # the event's text is the reason
    assert str(reason.exc).startswith("attempt 1 of 5 failed: provider answered 503; again in ")


def test_beat_sweeps_send_no_task_events_and_other_tasks_do():
    import workers.celery_app  # noqa: F401  (the worker side fills the quiet set from beat's schedule)
    from beat_schedule import beat_schedule
    from config.settings import get_settings

    periodic = {entry["task"] for entry in beat_schedule(get_settings()).values()}
    assert periodic and all(celery_app.tasks[name].send_events is False for name in periodic)
    assert celery_app.tasks["network_tokens.provision"].send_events is True
    assert celery_app.tasks[ScriptedJob.name].send_events is True


@pytest.mark.skipif(
    TEST_BROKER_URL.startswith("amqp"), reason="task events are batched on Redis only (RabbitMQ: Celery's consumer)"
)
def test_a_job_s_task_events_reach_a_monitor_batched_by_the_flush_interval(worker):
    """Flower's view of a task: received, started and succeeded, each naming the task's id, read here
    with Celery's own event receiver as Flower reads them. The worker's consumer publishes what it
    buffered once per :data:`EVENT_FLUSH_SECONDS` (one ``task.multi`` message), not after each event:
    the event that arms the flush waits that long, and the started one (sent about a millisecond after
    the received one) travels in the same message."""
    import threading

    from celery.events.receiver import EventReceiver

    from infra.celery import EVENT_FLUSH_SECONDS, EventBatchingConsumer

    assert isinstance(worker.consumer, EventBatchingConsumer)
    seen: list[tuple[str, str | None, int, float, str]] = []  # (type, task id, message number, seconds late, kwargs)
    ready, stop = threading.Event(), threading.Event()

    class Receiver(EventReceiver):
        messages = 0

        def _receive(self, body, message, *args, **kwargs):
            self.messages += 1
            return super()._receive(body, message, *args, **kwargs)

    def monitor() -> None:
        with celery_app.connection_for_read() as connection:
            receiver = Receiver(connection, app=celery_app)
            receiver.handlers = {
                "*": lambda event: seen.append(
                    (
                        event["type"],
                        event.get("uuid"),
                        receiver.messages,
                        time.time() - event["timestamp"],
                        str(event.get("kwargs", "")),  # the received event's: the job's id
                    )
                )
            }
            ready.set()
            with contextlib.suppress(TimeoutError):  # no event for 0.5 s once the test has seen its own
                for _ in receiver.itercapture(limit=None, timeout=0.5, wakeup=False):
                    if stop.is_set():
                        return

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        time.sleep(0.3)  # the receiver's queue bound to the events exchange
        job = _settled(_record("ok").id, "succeeded")
        task_id = wait_until(lambda: next((uuid for kind, uuid, *_, kwargs in seen if str(job.id) in kwargs), None))
        wait_until(lambda: any(kind == "task-succeeded" and uuid == task_id for kind, uuid, *_ in seen))
    finally:
        stop.set()
        thread.join(5)
    mine = {kind: (message, late) for kind, uuid, message, late, _ in seen if uuid == task_id}
    assert {"task-received", "task-started", "task-succeeded"} <= set(mine), (job.id, seen)
    assert mine["task-received"][0] == mine["task-started"][0], seen
    # The message's oldest event armed the flush and waited its full interval; the received event
    # itself waits less when an earlier job's event (a moment before) had already armed it.
    carrier = mine["task-received"][0]
    oldest = max(late for _, _, message, late, _ in seen if message == carrier)
    assert oldest >= EVENT_FLUSH_SECONDS * 0.9, seen  # held for the flush, not sent at once


def test_a_flush_timer_lost_with_its_connection_is_armed_again_by_a_later_event():
    """The event loop cancels the timers of a broken connection: a flush armed then never fires,
    and the next event a second after it was due arms another (events then still reach Flower)."""
    from infra.celery import EVENT_FLUSH_SECONDS, EventBatchingConsumer

    class Hub:
        def __init__(self):
            self.soon, self.later = [], []

        def call_soon(self, callback):
            self.soon.append(callback)

        def call_later(self, delay, callback):
            self.later.append((delay, callback))

    # A stand-in hub records what the consumer asks of the event loop: the flush logic alone, without
    # breaking a real broker connection at the right instant.
    consumer = EventBatchingConsumer.__new__(EventBatchingConsumer)
    consumer.hub, flushed = Hub(), []
    consumer._flush_events = lambda: flushed.append(True)
    consumer.on_send_event_buffered()
    consumer.hub.soon.pop()()
    assert [delay for delay, _ in consumer.hub.later] == [EVENT_FLUSH_SECONDS]
    consumer.on_send_event_buffered()  # armed: nothing more to do
    assert consumer.hub.soon == []
    consumer.hub.later.clear()  # the timer is cancelled with the connection: it never fires
    consumer._flush_due = time.monotonic() - 1.5  # ... and was due a second and a half ago
    consumer.on_send_event_buffered()
    consumer.hub.soon.pop()()
    [(_, flush)] = consumer.hub.later
    flush()
    assert flushed == [True] and consumer._flush_due is None
