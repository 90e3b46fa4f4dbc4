"""Operations: what the queues hold, heartbeats and readiness checks (jobs as data and dead letters:
:mod:`infra.job_admin`).

Used by ``tessera queues`` / ``tessera alive`` (``tessera/cli/operations.py``), ``GET /metrics``
(``infra/metrics.py``) and ``GET /readyz`` (``app/routes/ops.py``).

* Queue depth is read from the broker: Redis ``LLEN`` of each queue's keys (one per priority step,
  under ``TESSERA_REDIS_KEY_PREFIX``), or a passive declare on other transports.
* The age of the oldest waiting work is read from the database: jobs ``queued`` whose ``due_at`` has
  come and that no worker holds a lease on (a webhook delivery's work is a ``webhooks.deliver`` job).
  They are the outbox backlog the beat relay watches.
* Heartbeats: each worker and beat write one every :data:`HEARTBEAT_SECONDS` from a thread, the
  outbox relay one after each run; in Redis (``TESSERA_REDIS_URL``, else a Redis
  broker) or, on the embedded defaults, as files in ``heartbeats/`` of the data dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from config.settings import Settings
from infra.celery import DELIVER_TASK, QUEUES, celery_app, queue_of
from infra.redis_clients import is_redis_url, redis_client
from storage import key_check
from storage.db import session_scope
from storage.models import Job
from storage.states import JobStatus
from storage.types import utcnow

#: Seconds between two heartbeats of a worker; one older than three of them means the worker is gone.
HEARTBEAT_SECONDS = 10.0
#: kombu's Redis transport keeps a queue's messages in one list per priority step.
_PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEP = "\x06\x16"
#: Job states counted by ``tessera_jobs`` (finished ones pile up; dead letters need someone).
LIVE_JOB_STATES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.DEAD)


# ---- queues --------------------------------------------------------------------------------------


def queue_names() -> tuple[str, ...]:
    """The platform's queues."""
    return tuple(QUEUES)


@functools.lru_cache(maxsize=4)
def _redis(settings: Settings, url: str):
    """The operations' client of ``url`` under ``settings`` (a Sentinel URL: its master), kept."""
    return redis_client(settings, url, socket_timeout=3, socket_connect_timeout=3)


def redis_queue_keys(queue: str, prefix: str) -> list[str]:
    """The Redis lists holding ``queue``'s messages, one per priority step."""
    return [prefix + (queue if step == 0 else f"{queue}{_PRIORITY_SEP}{step}") for step in _PRIORITY_STEPS]


def queue_depths(settings: Settings) -> dict[str, int | None]:
    """Messages waiting in the broker per queue (None where the transport cannot tell). Raises when
    the broker does not answer."""
    url = settings.effective_broker_url
    queues = queue_names()
    if is_redis_url(url):
        client = _redis(settings, url)
        with client.pipeline(transaction=False) as pipe:
            for queue in queues:
                for key in redis_queue_keys(queue, settings.redis_key_prefix):
                    pipe.llen(key)
            sizes = pipe.execute()
        steps = len(_PRIORITY_STEPS)
        return {queue: sum(sizes[i * steps : (i + 1) * steps]) for i, queue in enumerate(queues)}
    return _declared_depths(url, queues)


def _declared_depths(url: str, queues: tuple[str, ...]) -> dict[str, int | None]:
    depths: dict[str, int | None] = {}
    with celery_app.connection_for_read(url) as connection:
        connection.ensure_connection(max_retries=1)
        channel = connection.default_channel
        for queue in queues:
            try:
                depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
            except Exception:  # noqa: BLE001 - a queue never declared holds nothing
                depths[queue] = 0 if connection.transport.driver_type != "amqp" else None
                channel = connection.channel()
    return depths


@dataclasses.dataclass
class Waiting:
    """Due work of one queue: how many rows and the age of the oldest (seconds)."""

    count: int
    oldest_age_seconds: float


@dataclasses.dataclass
class WaitingWork:
    """Due, unleased work per queue, and the totals of the outbox backlog."""

    queues: dict[str, Waiting]
    jobs: int
    deliveries: int


def waiting_work(session: Session | None = None, *, now: dt.datetime | None = None) -> WaitingWork:
    """Jobs ``queued`` that are due and held by no worker, per queue; ``deliveries`` counts the
    webhook deliveries among them, ``jobs`` the others."""
    if session is None:
        with session_scope() as fresh:
            return waiting_work(fresh, now=now)
    now = now or utcnow()
    per_queue: dict[str, Waiting] = {}
    jobs_total = deliveries = 0
    rows = session.exec(
        select(Job.kind, func.count(), func.min(Job.due_at))
        .where(
            Job.status == JobStatus.QUEUED,
            Job.due_at <= now,
            or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
        )
        .group_by(Job.kind)
    ).all()
    for kind, count, oldest in rows:
        if kind == DELIVER_TASK:
            deliveries += count
        else:
            jobs_total += count
        if not count or oldest is None:
            continue
        age = max(0.0, (now - aware(oldest)).total_seconds())
        entry = per_queue.setdefault(queue_of(kind), Waiting(0, 0.0))
        entry.count += count
        entry.oldest_age_seconds = max(entry.oldest_age_seconds, age)
    return WaitingWork(per_queue, jobs_total, deliveries)


def jobs_by_state(session: Session | None = None) -> dict[tuple[str, str], int]:
    """Count of jobs per ``(kind, state)`` for the states that need watching (:data:`LIVE_JOB_STATES`)."""
    if session is None:
        with session_scope() as fresh:
            return jobs_by_state(fresh)
    rows = session.exec(
        select(Job.kind, Job.status, func.count())
        .where(col(Job.status).in_(LIVE_JOB_STATES))
        .group_by(Job.kind, Job.status)
    ).all()
    return {(kind, status): count for kind, status, count in rows}


def aware(value: dt.datetime) -> dt.datetime:
    """``value`` with a time zone: a naive one (SQLite's) is taken as UTC."""
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


# ---- workers and beat ----------------------------------------------------------------------------


def consumers(*, timeout: float = 1.0) -> dict[str, list[str]] | None:
    """The workers consuming each queue (Celery ``inspect active_queues``); None when the broker
    cannot broadcast (the embedded SQLite transport)."""
    if celery_app.conf.broker_url.startswith("sqla+"):
        return None
    replies = celery_app.control.inspect(timeout=timeout).active_queues() or {}
    found: dict[str, list[str]] = {queue: [] for queue in queue_names()}
    for worker, queues in replies.items():
        for queue in queues or ():
            found.setdefault(queue.get("name", "?"), []).append(worker)
    return found


def ping_workers(*, timeout: float = 1.0) -> list[str] | None:
    """The workers that answered a Celery ``ping``; None when the broker cannot broadcast."""
    if celery_app.conf.broker_url.startswith("sqla+"):
        return None
    replies = celery_app.control.ping(timeout=timeout) or []
    return sorted(name for reply in replies for name in reply)


@dataclasses.dataclass
class Heartbeat:
    """The last sign of life of a worker, beat or the relay."""

    name: str
    at: float
    host: str | None = None
    pid: int | None = None
    every: float = HEARTBEAT_SECONDS
    #: A beat process's: ``active`` (it schedules) or ``standby``.
    state: str | None = None

    @property
    def kind(self) -> str:
        """``worker``, ``beat`` or ``relay``."""
        return self.name.split(":", 1)[0]

    def age(self, now: float | None = None) -> float:
        """Seconds since the heartbeat."""
        return max(0.0, (now or time.time()) - self.at)

    def alive(self, now: float | None = None) -> bool:
        """True when the heartbeat is less than three periods old."""
        return self.age(now) < 3 * self.every


def _heartbeat_redis(settings: Settings):
    url = settings.redis_url or (settings.effective_broker_url if is_redis_url(settings.effective_broker_url) else None)
    return _redis(settings, url) if url else None


def _heartbeat_key(settings: Settings, name: str) -> str:
    return f"{settings.redis_key_prefix}tessera:heartbeat:{name}"


def _heartbeat_file(settings: Settings, name: str) -> Path:
    return settings.data_dir / "heartbeats" / (name.replace("/", "_") + ".json")


def record_heartbeat(
    settings: Settings, name: str, *, every: float = HEARTBEAT_SECONDS, state: str | None = None
) -> None:
    """Write the heartbeat ``name`` (``worker:<hostname>``, ``beat`` (the active beat),
    ``beat:<host>:<pid>`` (each beat process, with its ``state``), ``relay``) now."""
    fields: dict[str, Any] = {"at": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "every": every}
    if state is not None:
        fields["state"] = state
    payload = json.dumps(fields)
    client = _heartbeat_redis(settings)
    if client is not None:
        client.set(_heartbeat_key(settings, name), payload, ex=max(60, int(every * 10)))
        return
    path = _heartbeat_file(settings, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(payload)
    temporary.replace(path)


def forget_heartbeat(settings: Settings, name: str) -> None:
    """Remove the heartbeat ``name`` (a worker stopping cleanly)."""
    client = _heartbeat_redis(settings)
    if client is not None:
        client.delete(_heartbeat_key(settings, name))
    else:
        _heartbeat_file(settings, name).unlink(missing_ok=True)


def heartbeats(settings: Settings) -> dict[str, Heartbeat]:
    """Every heartbeat recorded, by name."""
    found: dict[str, Heartbeat] = {}
    client = _heartbeat_redis(settings)
    if client is not None:
        prefix = _heartbeat_key(settings, "")
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = list(client.scan_iter(match=pattern, count=500))
        for key, raw in zip(keys, client.mget(keys) if keys else [], strict=True):
            if raw:
                name = key.decode()[len(prefix) :]
                found[name] = _heartbeat(name, raw)
        return found
    folder = settings.data_dir / "heartbeats"
    for path in folder.glob("*.json") if folder.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            found[path.stem] = _heartbeat(path.stem, path.read_bytes())
    return found


def _heartbeat(name: str, raw: bytes) -> Heartbeat:
    data = json.loads(raw)
    every = float(data.get("every", HEARTBEAT_SECONDS))
    return Heartbeat(name, float(data["at"]), data.get("host"), data.get("pid"), every, data.get("state"))


def queue_report(settings: Settings, *, timeout: float = 1.0) -> dict[str, Any]:
    """Everything ``tessera queues`` shows: per queue depth, due work, oldest age and consumers;
    workers (ping and heartbeat) and beat. A source that fails is named in ``errors``."""
    errors: dict[str, str] = {}

    def attempt(name: str, fn, default):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - report what could be read
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            return default

    depths = attempt("broker", lambda: queue_depths(settings), {})
    waiting = attempt("database", waiting_work, WaitingWork({}, 0, 0))
    by_queue = attempt("consumers", lambda: consumers(timeout=timeout), None)
    pinged = attempt("ping", lambda: ping_workers(timeout=timeout), None)
    beats = attempt("heartbeats", lambda: heartbeats(settings), {})
    now = time.time()
    queues = []
    for queue in queue_names():
        entry = waiting.queues.get(queue)
        queues.append(
            {
                "queue": queue,
                "depth": depths.get(queue),
                "due": entry.count if entry else 0,
                "oldest_age_seconds": round(entry.oldest_age_seconds, 3) if entry else 0.0,
                "consumers": None if by_queue is None else len(by_queue.get(queue, [])),
            }
        )
    names = set(pinged or ()) | {b.name.split(":", 1)[1] for b in beats.values() if b.kind == "worker"}
    workers = []
    for name in sorted(names):
        beat = beats.get(f"worker:{name}")
        workers.append(
            {
                "name": name,
                "ping": None if pinged is None else name in pinged,
                "heartbeat_age_seconds": round(beat.age(now), 3) if beat else None,
                "alive": (pinged is not None and name in pinged) or bool(beat and beat.alive(now)),
            }
        )

    def component(name: str, every: float) -> dict[str, Any]:
        beat = beats.get(name)
        return {
            "heartbeat_age_seconds": round(beat.age(now), 3) if beat else None,
            "alive": bool(beat and beat.age(now) < every),
        }

    relay_every = max(1.0, settings.outbox_relay_after_seconds / 3)
    processes = [
        {
            "host": beat.host,
            "pid": beat.pid,
            "state": beat.state or "standby",
            "heartbeat_age_seconds": round(beat.age(now), 3),
        }
        for name, beat in sorted(beats.items())
        if beat.kind == "beat" and name != "beat" and beat.alive(now)
    ]
    return {
        "queues": queues,
        "outbox_backlog": {"job": waiting.jobs, "webhook_delivery": waiting.deliveries},
        "workers": workers,
        "beat": component("beat", 3 * HEARTBEAT_SECONDS),
        "beats": processes,
        "relay": component("relay", relay_every * 3 + HEARTBEAT_SECONDS),
        "errors": errors,
    }


# ---- readiness -----------------------------------------------------------------------------------


def check_database() -> None:
    """Raise unless the database answers ``SELECT 1``."""
    from sqlalchemy import text

    with session_scope() as session:
        session.execute(text("SELECT 1"))


def check_keys() -> None:
    """Raise unless this process's keys open the database's key check (``storage.key_check``): a
    process with the wrong master key is not ready, whatever else answers."""
    key_check.require()


def check_broker(settings: Settings) -> None:
    """Raise unless the broker accepts a connection (Redis: ``PING``)."""
    url = settings.effective_broker_url
    if is_redis_url(url):
        _redis(settings, url).ping()
        return
    with celery_app.connection_for_write(url) as connection:
        connection.ensure_connection(max_retries=1)


@functools.lru_cache(maxsize=2)
def _s3_probe(endpoint: str | None, region: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=2, retries={"max_attempts": 1}),
    )


def check_s3(settings: Settings) -> None:
    """Raise unless S3 answers for the bucket (a missing bucket is fine: it is made on first use)."""
    from botocore.exceptions import ClientError

    try:
        _s3_probe(settings.s3_endpoint_url, settings.s3_region).head_bucket(Bucket=settings.s3_bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
