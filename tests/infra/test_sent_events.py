"""Celery's ``task-sent`` events published after their messages by a thread of their own, a batch at
a time (``infra.celery.SentEvents``), on the test Redis: each sent task's event arrives, in order,
carrying the task's id, name and queue and the time of its send; the events of sends close together
arrive as one ``task.multi`` message."""

from __future__ import annotations

import base64
import json
import time
import uuid

import pytest
import redis

from config.settings import Settings
from infra import celery as celery_module
from infra.celery import SentEvents, create_app
from tests.conftest import TEST_BROKER_URL

pytestmark = pytest.mark.skipif(
    not TEST_BROKER_URL.startswith(("redis://", "rediss://")), reason="the run's broker is not a plain Redis"
)


def _events(data: bytes) -> list[dict]:
    """The events a kombu message published on Redis carries (its body base64-encoded or not): one
    event, or the list of a group's (``task.multi``)."""
    message = json.loads(data)
    body = message["body"]
    if message["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    events = json.loads(body)
    return events if isinstance(events, list) else [events]


def test_each_sent_task_has_its_task_sent_event_published_after_it():
    prefix = f"test-sent-{uuid.uuid4().hex}:"
    app = create_app(Settings(broker_url=TEST_BROKER_URL, redis_key_prefix=prefix, task_sent_events=True))
    assert app.conf.task_send_sent_event
    events = SentEvents(app)
    client = redis.Redis.from_url(TEST_BROKER_URL)
    subscription = client.pubsub(ignore_subscribe_messages=True)
    subscription.psubscribe(f"{prefix}*celeryev*")  # the events exchange (fan-out), this app's prefix only
    try:
        assert subscription.get_message(timeout=1) is None  # subscribed before anything is sent
        sent, before = [], time.time()
        for n in range(3):
            sent.append(
                app.send_task("tests.sent_events", kwargs={"n": n}, queue=f"sent-{n}", event_dispatcher=events).id
            )
        after = time.time()
        received, messages = [], 0
        deadline = time.monotonic() + 10
        while len(received) < 3 and time.monotonic() < deadline:
            message = subscription.get_message(timeout=1)
            if message is not None:
                received += _events(message["data"])
                messages += 1
    finally:
        subscription.close()
        for n in range(3):
            client.delete(f"{prefix}sent-{n}")
        client.close()
    assert messages == 1  # sent within the batch's 0.1 s: one publish for the three
    assert [event["type"] for event in received] == ["task-sent"] * 3
    assert [event["uuid"] for event in received] == sent  # in the order sent
    assert [event["queue"] for event in received] == ["sent-0", "sent-1", "sent-2"]
    assert all(event["name"] == "tests.sent_events" for event in received)
    assert all(before <= event["timestamp"] <= after for event in received)  # the time of the send


def test_a_flush_publishes_the_event_the_thread_holds_once(monkeypatch):
    """What ``atexit`` runs: the event the thread took and holds for its batch goes out now, and the
    thread does not publish it again (its batch made to last 2 s here, longer than the first wait)."""
    monkeypatch.setattr(celery_module, "EVENT_FLUSH_SECONDS", 2.0)
    prefix = f"test-sent-{uuid.uuid4().hex}:"
    app = create_app(Settings(broker_url=TEST_BROKER_URL, redis_key_prefix=prefix, task_sent_events=True))
    events = SentEvents(app)
    client = redis.Redis.from_url(TEST_BROKER_URL)
    subscription = client.pubsub(ignore_subscribe_messages=True)
    subscription.psubscribe(f"{prefix}*celeryev*")
    try:
        assert subscription.get_message(timeout=1) is None
        sent = app.send_task("tests.sent_events", kwargs={}, queue="sent-flush", event_dispatcher=events).id
        deadline = time.monotonic() + 5
        while not events._held and time.monotonic() < deadline:  # the thread took it and waits
            time.sleep(0.001)
        assert events._held
        events.flush()
        first = subscription.get_message(timeout=1)  # before the thread's batch is due: the flush's
        later = subscription.get_message(timeout=2.5)  # past the thread's batch
    finally:
        subscription.close()
        client.delete(f"{prefix}sent-flush")
        client.close()
    assert first is not None and [event["uuid"] for event in _events(first["data"])] == [sent]
    assert later is None
