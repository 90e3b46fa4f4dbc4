"""The worker side of the Celery application: what only worker and beat processes need.

``celery -A workers.celery_app worker|beat`` (``tessera worker`` / ``tessera beat``) loads this module:
the shared application of :mod:`infra.celery`, plus beat's schedule (``beat_schedule.py``) and scheduler
(:mod:`workers.beat`: sweeps sent only when they have work), a fresh
database engine in every forked pool process, and the worker signals (:mod:`workers.signals`: log
context, task metrics, heartbeats).
"""

from __future__ import annotations

import gc

from celery import signals

from beat_schedule import beat_schedule
from config.settings import get_settings
from infra import logs
from infra.celery import QUEUES, QUIET_TASKS, celery_app
from storage.db import reset_engine
from workers import signals as _signals  # noqa: F401  (connects the worker signals)

__all__ = ["QUEUES", "app", "celery_app"]

celery_app.conf.beat_schedule = beat_schedule(get_settings())
celery_app.conf.beat_scheduler = "workers.beat:Scheduler"  # gated sweeps: the relay idles without backlog
# Scheduled sweeps that found nothing to do write no line (infra/logs.py: one line per unit of work).
logs.quiet_periodic(entry["task"] for entry in celery_app.conf.beat_schedule.values())
# ... and send no task events, so they do not fill Flower's history (infra.celery.QUIET_TASKS); beat,
# which sends nothing but them, sends no task-sent events either (workers/signals.py).
QUIET_TASKS.update(entry["task"] for entry in celery_app.conf.beat_schedule.values())
app = celery_app  # `celery -A workers.celery_app` finds `app`


@signals.worker_process_init.connect
def _reset_after_fork(**_kwargs) -> None:
    """A forked pool process must not share the parent's database connections. Then every object
    inherited from the parent (modules, models, tasks: most of the heap) is moved out of the garbage
    collector's sight, as the api does once started: a collection walks what tasks make, not the whole
    platform, and leaves the pages shared with the parent unwritten."""
    reset_engine()
    gc.freeze()
