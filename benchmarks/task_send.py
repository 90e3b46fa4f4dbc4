"""CPU per task message sent on Redis: the platform's send beside Celery's own, in one process.

Platform: :func:`infra.dispatch.send_task`, the one way the platform sends a task: its arguments' text
for Flower made by :func:`infra.dispatch.arguments_repr`, and no declaration of the queue on each
publish (:func:`infra.celery.publish_options`). Reference: the same app's ``send_task`` with Celery's
defaults for those two (``saferepr`` of the arguments; kombu's cached declaration of the queue),
everything else as the platform sends it (retry policy, ``reply_to``, producer from the app's pool).
Both on an app of the platform's configuration with ``task-sent`` events off (their publish is
``broker_publish.py``'s figure and runs off the sender's thread), sending a rail job's message
(``job_id`` and one of ``sibling_ids``) to the queue it routes to, under a key prefix of their own;
``--messages`` a round (3,000), ``--rounds`` rounds (3) alternating the two. Printed and published:
the process CPU time per message (``time.process_time``) and the wall time, medians of the rounds,
and the ratio. The queue is counted and emptied after each round; a count short of the messages sent
fails the run.

Run from the repository root::

    .venv/bin/python benchmarks/task_send.py [--messages 3000] [--rounds 3] [--redis-url redis://127.0.0.1:6379/13]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from benchmarks import common
from config.settings import Settings
from infra import dispatch, wait
from infra.celery import PUBLISH_RETRY_POLICY, create_app, queue_of

PREFIX = "bench-task-send:"
TASK = "bench.task_send"
PLATFORM, CELERY = "infra.dispatch.send_task", "Celery's send_task"


def one_round(
    send: Callable[[Any, dict], None], app: Celery, client: redis.Redis, messages: int
) -> tuple[float, float]:
    """Send ``messages`` messages with ``send(producer, kwargs)``, each on a producer taken from
    ``app``'s pool as the platform's sends take it; returns (CPU, wall) microseconds per message."""
    kwargs = {"job_id": str(uuid.uuid4()), dispatch.SIBLINGS_ARGUMENT: [str(uuid.uuid4())]}
    key = f"{PREFIX}{queue_of(TASK)}"
    client.delete(key)
    with app.producer_or_acquire() as producer:  # the pool's connection made before the clock starts
        send(producer, kwargs)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(messages):
        with app.producer_or_acquire() as producer:
            send(producer, kwargs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    count = client.llen(key)
    client.delete(key)
    if count != messages + 1:
        raise SystemExit(f"{count} messages in the queue, {messages + 1} sent")
    return cpu / messages * 1e6, wall / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"))
    args = parser.parse_args()
    app = create_app(Settings(broker_url=args.redis_url, redis_key_prefix=PREFIX, task_sent_events=False))
    dispatch.celery_app = app  # the platform's send on this benchmark's app and keys

    def platform(producer: Any, kwargs: dict) -> None:
        if not dispatch.send_task(TASK, producer=producer, **kwargs):
            raise SystemExit("the broker did not take a message")

    def reference(producer: Any, kwargs: dict) -> None:
        app.send_task(
            TASK,
            kwargs=kwargs,
            producer=producer,
            retry=True,
            retry_policy=PUBLISH_RETRY_POLICY,
            reply_to=wait.message_reply_to(),
        )

    client = redis.Redis.from_url(args.redis_url)
    sends = {PLATFORM: platform, CELERY: reference}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in sends}
    try:
        for number in range(1, args.rounds + 1):
            for name, send in sends.items():
                figures[name].append(one_round(send, app, client, args.messages))
                print(f"round {number}, {name}: {figures[name][-1][0]:.0f} us CPU per message", flush=True)
    finally:
        for key in client.scan_iter(f"{PREFIX}*"):  # the queue's bindings, declared by the reference
            client.delete(key)
    common.publish_cpu_and_wall(
        "task_send",
        figures,
        platform=PLATFORM,
        reference=CELERY,
        per="task message sent",
        title=f"Per task message, medians of {args.rounds} rounds of {args.messages:,} messages",
    )


if __name__ == "__main__":
    main()
