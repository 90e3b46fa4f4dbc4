"""kombu's Redis channel with one client for its synchronous commands (``infra/broker_transport.py``),
on the test Redis: the broker URL keeps its scheme, messages go through, one client serves every
synchronous command of a channel, and a channel that drops its pool gets a client of the new one."""

from __future__ import annotations

import uuid

import pytest
import redis
from kombu import Exchange, Queue

from config.settings import Settings
from infra import broker_transport
from infra.celery import create_app
from tests.conftest import TEST_BROKER_URL

pytestmark = pytest.mark.skipif(
    not TEST_BROKER_URL.startswith(("redis://", "rediss://")), reason="the run's broker is not a plain Redis"
)


@pytest.fixture
def connection():
    app = create_app(Settings(broker_url=TEST_BROKER_URL, redis_key_prefix=f"test-transport-{uuid.uuid4().hex}:"))
    with app.connection_for_write() as connection:
        yield connection


def _round_trip(connection, channel, name: str, body: dict) -> dict:
    """Publish ``body`` to queue ``name`` on ``channel`` and read it back (acknowledged)."""
    queue = Queue(name, Exchange(name), routing_key=name, auto_delete=True)
    producer = connection.Producer(channel)
    producer.publish(body, exchange=queue.exchange, routing_key=name, declare=[queue], serializer="json")
    message = queue(channel).get(no_ack=False)
    assert message is not None
    message.ack()
    return message.payload


def test_the_broker_url_keeps_its_scheme_and_names_the_channel_keeping_its_client(connection):
    assert connection.as_uri().startswith("redis://")
    channel = connection.default_channel
    assert isinstance(channel, broker_transport.RedisChannel)
    assert connection.transport.driver_type == "redis"


def test_every_synchronous_command_of_a_channel_uses_one_client(connection, monkeypatch):
    channel = connection.channel()
    made: list[redis.Redis] = []
    make = channel.Client

    def counting(**kwargs):
        client = make(**kwargs)
        made.append(client)
        return client

    monkeypatch.setattr(channel, "Client", counting)
    name = f"test-transport-{uuid.uuid4().hex}"
    for number in range(3):
        assert _round_trip(connection, channel, name, {"n": number}) == {"n": number}
    assert len(made) == 1  # kombu's own channel makes one per publish, delivery and acknowledgement
    assert channel._create_client() is made[0]
    channel.close()


def test_a_channel_that_dropped_its_pool_gets_a_client_of_the_new_one(connection):
    channel = connection.channel()
    name = f"test-transport-{uuid.uuid4().hex}"
    assert _round_trip(connection, channel, name, {"n": 1}) == {"n": 1}
    before = channel._create_client()
    channel._disconnect_pools()
    after = channel._create_client()
    assert after is not before
    assert after.connection_pool is channel.pool
    assert _round_trip(connection, channel, name, {"n": 2}) == {"n": 2}
    channel.close()
