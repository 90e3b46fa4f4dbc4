"""The reference of ``benchmarks/webhooks.py``: a tiny Celery app whose task does nothing but count.

Same broker and the same reliability settings as the platform's app (``workers/celery_app.py``):
late acknowledgement, reject on worker loss, prefetch of one, JSON, no result backend. It uses its own
queue (``bench-noop``) so the platform's worker never takes its tasks. The broker is
``BENCH_NOOP_BROKER_URL`` (default ``redis://127.0.0.1:6379/13``); each finished task adds one to the
Redis counter :data:`DONE_KEY` on that same Redis. Worker (from the repository root)::

    BENCH_NOOP_BROKER_URL=redis://127.0.0.1:6379/13 .venv/bin/celery -A benchmarks.noop_app worker \\
        --concurrency 2 -Q bench-noop
"""

from __future__ import annotations

import functools
import os

import redis
from celery import Celery

BROKER_URL = os.environ.get("BENCH_NOOP_BROKER_URL", "redis://127.0.0.1:6379/13")
QUEUE = "bench-noop"
DONE_KEY = "bench:noop:done"

app = Celery("bench_noop")
app.conf.update(
    broker_url=BROKER_URL,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
    result_backend=None,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    worker_hijack_root_logger=False,
)


@functools.cache
def _counter() -> redis.Redis:
    """This process's Redis client (made after the worker forks its pool)."""
    return redis.Redis.from_url(BROKER_URL)


@app.task(name="bench.noop")
def noop() -> None:
    """Do nothing, then count one done."""
    _counter().incr(DONE_KEY)
