"""CPU per broker message published on Redis: the platform's transport beside kombu's own, in one process.

Platform: :class:`infra.broker_transport.RedisTransport`, the transport the platform's ``redis://``
broker URLs name (its channel keeps one redis-py client for its synchronous commands). Reference:
kombu's ``kombu.transport.redis:Transport``, which builds a new client for each command. Both with
the platform's broker settings (key prefix, visibility timeout), on the same Redis, publishing the
same JSON message to a queue of their own with a :class:`kombu.Producer`; ``--messages`` publishes a
round (3,000), ``--rounds`` rounds (3) alternating the two. Printed and published: the process CPU
time per publish (``time.process_time``) and the wall time, medians of the rounds, and the ratio.
The queue is counted and emptied at the end of each round; a count short of the messages
published fails the run.

Each task message a request sends, each task event (``task-sent`` in the api, ``task-received``,
``task-started``, ``task-succeeded`` in the worker) and each delivery's bookkeeping and
acknowledgement is one such command.

Run from the repository root::

    .venv/bin/python benchmarks/broker_publish.py [--messages 3000] [--rounds 3] [--redis-url redis://127.0.0.1:6379/13]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import time
import uuid

import redis
from kombu import Connection, Exchange, Queue
from kombu.transport import redis as kombu_redis

from benchmarks import common
from config.settings import Settings
from infra import broker_transport
from infra.celery import create_app

PREFIX = "bench-publish:"
PLATFORM, KOMBU = "platform's Redis transport", "kombu's Redis transport"
TRANSPORTS = {PLATFORM: broker_transport.RedisTransport, KOMBU: kombu_redis.Transport}


def one_round(url: str, transport: type, options: dict, messages: int) -> tuple[float, float]:
    """Publish ``messages`` messages through ``transport``; returns (CPU, wall) microseconds per publish."""
    name = f"bench-publish-{uuid.uuid4().hex}"
    queue = Queue(name, Exchange(name), routing_key=name)
    with Connection(url, transport=transport, transport_options=options) as connection:
        channel = connection.channel()
        producer = connection.Producer(channel)
        producer.publish({"warm": True}, exchange=queue.exchange, routing_key=name, declare=[queue])
        body = {"id": str(uuid.uuid4()), "args": [str(uuid.uuid4())], "kwargs": {}}
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(messages):
            producer.publish(body, exchange=queue.exchange, routing_key=name, serializer="json")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        count = channel.queue_purge(name)  # the messages in the queue, removed
        channel.queue_delete(name)
        channel.close()
    if count != messages + 1:
        raise SystemExit(f"{transport.__name__}: {count} messages in the queue, {messages + 1} published")
    return cpu / messages * 1e6, wall / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))
    args = parser.parse_args()
    settings = Settings(broker_url=args.redis_url, redis_key_prefix=PREFIX)
    options = dict(create_app(settings).conf.broker_transport_options)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in TRANSPORTS}
    for number in range(1, args.rounds + 1):
        for name, transport in TRANSPORTS.items():
            figures[name].append(one_round(args.redis_url, transport, options, args.messages))
            print(f"round {number}, {name}: {figures[name][-1][0]:.0f} us CPU per publish", flush=True)
    leftovers = redis.Redis.from_url(args.redis_url)
    for key in leftovers.scan_iter(f"{PREFIX}*"):  # the exchanges' bindings
        leftovers.delete(key)
    common.publish_cpu_and_wall(
        "broker_publish",
        figures,
        platform=PLATFORM,
        reference=KOMBU,
        per="message published",
        title=f"Per publish, medians of {args.rounds} rounds of {args.messages:,} messages",
    )


if __name__ == "__main__":
    main()
