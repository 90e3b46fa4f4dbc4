"""A task message as ``infra.dispatch.send_task`` publishes it: its arguments' text for Flower made
without Celery's ``saferepr`` but equal to it, and, on Redis, delivered to its queue without a
declaration of the queue (``infra.celery.publish_options``)."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from celery.utils.saferepr import saferepr

from config.settings import Settings
from infra import dispatch
from infra.celery import create_app, publish_options
from tests.conftest import TEST_BROKER_URL

#: Keyword arguments as the platform's tasks take them: one job, jobs recorded together, a batch.
_ARGUMENTS = [
    {"job_id": str(uuid.uuid4())},
    {"job_id": str(uuid.uuid4()), "sibling_ids": [str(uuid.uuid4())]},
    {"delivery_ids": [str(uuid.uuid4()) for _ in range(dispatch.BATCH_SIZE)]},
]


@pytest.mark.parametrize("kwargs", _ARGUMENTS, ids=["one job", "jobs together", "a batch"])
def test_the_arguments_text_is_what_celery_would_write(kwargs):
    app = dispatch.celery_app
    expected = saferepr(kwargs, app.amqp.kwargsrepr_maxsize, maxlevels=app.conf.task_repr_maxlevels)
    assert dispatch.arguments_repr(kwargs) == expected
    if len(repr(kwargs)) > app.amqp.kwargsrepr_maxsize:  # the batch: cut as Celery cuts it
        assert len(expected) < len(repr(kwargs))


def test_messages_on_rabbitmq_declare_their_queue_and_elsewhere_none():
    assert publish_options(create_app(Settings(broker_url="amqp://guest:guest@127.0.0.1:5672//"))) == {}
    assert publish_options(create_app(Settings(broker_url="redis://127.0.0.1:6379/0"))) == {"declare": []}
    assert publish_options(
        create_app(Settings(broker_url="sentinel://127.0.0.1:26379/0", redis_sentinel_master="primary"))
    ) == {"declare": []}


@pytest.mark.skipif(
    not TEST_BROKER_URL.startswith(("redis://", "rediss://")), reason="the run's broker is not a plain Redis"
)
def test_a_task_message_reaches_its_queue_on_redis_with_nothing_declared(monkeypatch):
    prefix = f"test-publish-{uuid.uuid4().hex}:"
    app = create_app(Settings(broker_url=TEST_BROKER_URL, redis_key_prefix=prefix, task_sent_events=False))
    monkeypatch.setattr(dispatch, "celery_app", app)  # the platform's send, on an app of this test's keys
    client = redis.Redis.from_url(TEST_BROKER_URL)
    kwargs = _ARGUMENTS[1]
    try:
        assert dispatch.send_task("network_tokens.provision", **kwargs)
        queued = client.lrange(f"{prefix}providers", 0, -1)
        written = sorted(key.decode() for key in client.scan_iter(f"{prefix}*"))
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
    assert len(queued) == 1
    message = json.loads(queued[0])
    assert message["headers"]["task"] == "network_tokens.provision"
    assert message["headers"]["argsrepr"] == "()"
    assert message["headers"]["kwargsrepr"] == repr(kwargs)
    assert written == [f"{prefix}providers"]  # no binding of the queue to its exchange was written
