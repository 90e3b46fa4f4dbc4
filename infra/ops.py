"""Operations: what the queues hold, jobs as data, dead letters, heartbeats and readiness checks.

Used by ``tessera jobs`` / ``tessera queues`` (``tessera/cli.py``), ``GET /metrics``
(``infra/metrics.py``) and ``GET /readyz`` (``app/routes/ops.py``).

* Queue depth is read from the broker: Redis ``LLEN`` of each queue's keys (one per priority step,
  under ``TESSERA_REDIS_KEY_PREFIX``), or a passive declare on other transports.
* The age of the oldest waiting work is read from the database: jobs ``queued`` and webhook
  deliveries ``pending`` whose ``due_at`` has come and that no worker holds a lease on. Together they
  are the outbox backlog the beat relay watches.
* A job that exhausted its retries is a dead letter (``infra/jobs.py``: status ``dead`` with its last
  error); :func:`retry` replays it, and replays a webhook delivery that ended ``failed``.
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
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, update
from sqlmodel import Session, select

from config.settings import Settings
from infra import jobs
from infra.celery import DELIVER_TASK, QUEUES, celery_app, queue_of
from infra.dispatch import enqueue_after_commit
from storage.db import session_scope
from storage.models import Job, Webhook, WebhookAttempt, WebhookDelivery
from storage.types import utcnow

#: Seconds between two heartbeats of a worker; one older than three of them means the worker is gone.
HEARTBEAT_SECONDS = 10.0
#: kombu's Redis transport keeps a queue's messages in one list per priority step.
_PRIORITY_STEPS = (0, 3, 6, 9)
_PRIORITY_SEP = "\x06\x16"
#: Job states counted by ``tessera_jobs`` (finished ones pile up; dead letters need someone).
LIVE_JOB_STATES = ("queued", "running", "dead")
JOB_STATES = ("queued", "running", "succeeded", "failed", "dead", "cancelled")
DELIVERY_STATES = ("pending", "succeeded", "failed")


class NotFound(LookupError):
    """No job or webhook delivery has this id."""


class Refused(ValueError):
    """The job or delivery is not in a state that allows the operation."""


# ---- queues --------------------------------------------------------------------------------------


def queue_names() -> tuple[str, ...]:
    """The platform's queues."""
    return tuple(QUEUES)


def _is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


@functools.lru_cache(maxsize=4)
def _redis(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)


def redis_queue_keys(queue: str, prefix: str) -> list[str]:
    """The Redis lists holding ``queue``'s messages, one per priority step."""
    return [prefix + (queue if step == 0 else f"{queue}{_PRIORITY_SEP}{step}") for step in _PRIORITY_STEPS]


def queue_depths(settings: Settings) -> dict[str, int | None]:
    """Messages waiting in the broker per queue (None where the transport cannot tell). Raises when
    the broker does not answer."""
    url = settings.effective_broker_url
    queues = queue_names()
    if _is_redis(url):
        client = _redis(url)
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


def _due_unleased(model, status: str, now: dt.datetime):
    return (
        model.status == status,
        model.due_at <= now,
        or_(model.lease_expires_at.is_(None), model.lease_expires_at < now),
    )


def waiting_work(session: Session | None = None, *, now: dt.datetime | None = None) -> WaitingWork:
    """Jobs ``queued`` and deliveries ``pending`` that are due and held by no worker, per queue."""
    if session is None:
        with session_scope() as fresh:
            return waiting_work(fresh, now=now)
    now = now or utcnow()
    per_queue: dict[str, Waiting] = {}

    def add(queue: str, count: int, oldest: dt.datetime | None) -> None:
        if not count or oldest is None:
            return
        age = max(0.0, (now - _aware(oldest)).total_seconds())
        entry = per_queue.setdefault(queue, Waiting(0, 0.0))
        entry.count += count
        entry.oldest_age_seconds = max(entry.oldest_age_seconds, age)

    jobs_total = 0
    rows = session.exec(
        select(Job.kind, func.count(), func.min(Job.due_at))
        .where(*_due_unleased(Job, "queued", now))
        .group_by(Job.kind)
    ).all()
    for kind, count, oldest in rows:
        jobs_total += count
        add(queue_of(kind), count, oldest)
    count, oldest = session.exec(
        select(func.count(), func.min(WebhookDelivery.due_at)).where(*_due_unleased(WebhookDelivery, "pending", now))
    ).one()
    add(queue_of(DELIVER_TASK), count, oldest)
    return WaitingWork(per_queue, jobs_total, count)


def jobs_by_state(session: Session | None = None) -> dict[tuple[str, str], int]:
    """Count of jobs per ``(kind, state)`` for the states that need watching (:data:`LIVE_JOB_STATES`)."""
    if session is None:
        with session_scope() as fresh:
            return jobs_by_state(fresh)
    rows = session.exec(
        select(Job.kind, Job.status, func.count()).where(Job.status.in_(LIVE_JOB_STATES)).group_by(Job.kind, Job.status)
    ).all()
    return {(kind, status): count for kind, status, count in rows}


def _aware(value: dt.datetime) -> dt.datetime:
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
    url = settings.redis_url or (settings.effective_broker_url if _is_redis(settings.effective_broker_url) else None)
    return _redis(url) if url else None


def _heartbeat_key(settings: Settings, name: str) -> str:
    return f"{settings.redis_key_prefix}tessera:heartbeat:{name}"


def _heartbeat_file(settings: Settings, name: str) -> Path:
    return settings.data_dir / "heartbeats" / (name.replace("/", "_") + ".json")


def record_heartbeat(settings: Settings, name: str, *, every: float = HEARTBEAT_SECONDS) -> None:
    """Write the heartbeat ``name`` (``worker:<hostname>``, ``beat``, ``relay``) now."""
    payload = json.dumps({"at": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "every": every})
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
    return Heartbeat(name, float(data["at"]), data.get("host"), data.get("pid"), every)


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
    return {
        "queues": queues,
        "outbox_backlog": {"job": waiting.jobs, "webhook_delivery": waiting.deliveries},
        "workers": workers,
        "beat": component("beat", 3 * HEARTBEAT_SECONDS),
        "relay": component("relay", relay_every * 3 + HEARTBEAT_SECONDS),
        "errors": errors,
    }


# ---- jobs as data --------------------------------------------------------------------------------


def _iso(value: dt.datetime | None) -> str | None:
    return _aware(value).isoformat() if value else None


def job_view(job: Job, *, detail: bool = False) -> dict[str, Any]:
    """A job as ``tessera jobs`` shows it."""
    view = {
        "id": str(job.id),
        "kind": job.kind,
        "state": job.status,
        "queue": queue_of(job.kind),
        "tenant_id": str(job.tenant_id) if job.tenant_id else None,
        "subject_type": job.subject_type,
        "subject_id": job.subject_id,
        "subject_number": job.subject_number,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "due_at": _iso(job.due_at),
        "last_error": job.last_error,
        "created_at": _iso(job.created_at),
        "updated_at": _iso(job.updated_at),
    }
    if detail:
        view.update(
            trace_id=job.trace_id,
            lease_owner=job.lease_owner,
            lease_expires_at=_iso(job.lease_expires_at),
            enqueued_at=_iso(job.enqueued_at),
            result=job.result,
        )
    return view


def delivery_view(
    delivery: WebhookDelivery, settings: Settings, attempts: list[WebhookAttempt] | None = None
) -> dict[str, Any]:
    """A webhook delivery as ``tessera jobs`` shows it (kind ``webhooks.deliver``)."""
    view = {
        "id": str(delivery.id),
        "kind": DELIVER_TASK,
        "state": delivery.status,
        "queue": queue_of(DELIVER_TASK),
        "tenant_id": str(delivery.tenant_id),
        "subject_type": "webhook",
        "subject_id": str(delivery.webhook_id),
        "subject_number": None,
        "attempts": delivery.attempts,
        "max_attempts": len(settings.webhook_retry_delays) + 1,
        "due_at": _iso(delivery.due_at),
        "last_error": delivery.last_error,
        "created_at": _iso(delivery.created_at),
        "updated_at": _iso(delivery.completed_at or delivery.created_at),
    }
    if attempts is not None:
        view.update(
            event_id=str(delivery.event_id),
            last_status_code=delivery.last_status_code,
            lease_owner=delivery.lease_owner,
            lease_expires_at=_iso(delivery.lease_expires_at),
            attempt_log=[
                {
                    "number": a.number,
                    "attempted_at": _iso(a.attempted_at),
                    "outcome": a.outcome,
                    "status_code": a.status_code,
                    "duration_ms": a.duration_ms,
                    "error": a.error,
                }
                for a in attempts
            ],
        )
    return view


def list_jobs(
    session: Session,
    settings: Settings,
    *,
    states: list[str] | None = None,
    kind: str | None = None,
    tenant_id: uuid.UUID | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Jobs (or, for kind ``webhooks.deliver``, webhook deliveries), most recently changed first."""
    if kind == DELIVER_TASK:
        query = select(WebhookDelivery)
        if states:
            query = query.where(WebhookDelivery.status.in_(states))
        if tenant_id:
            query = query.where(WebhookDelivery.tenant_id == tenant_id)
        rows = session.exec(query.order_by(WebhookDelivery.created_at.desc()).limit(limit)).all()
        return [delivery_view(row, settings) for row in rows]
    query = select(Job)
    if states:
        query = query.where(Job.status.in_(states))
    if kind:
        query = query.where(Job.kind == kind)
    if tenant_id:
        query = query.where(Job.tenant_id == tenant_id)
    rows = session.exec(query.order_by(Job.updated_at.desc(), Job.id).limit(limit)).all()
    return [job_view(row) for row in rows]


def parse_id(ref: str) -> uuid.UUID:
    """A job or delivery id (a uuid, or a delivery's ``msg_...`` message id); NotFound when malformed."""
    try:
        return uuid.UUID(ref.strip().removeprefix("msg_"))
    except ValueError:
        raise NotFound(f"'{ref}' is not a job or delivery id") from None


def _find(session: Session, ref: str) -> Job | WebhookDelivery:
    ident = parse_id(ref)
    row = session.get(Job, ident) or session.get(WebhookDelivery, ident)
    if row is None:
        raise NotFound(f"no job or webhook delivery has id {ident}")
    return row


def show_job(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """One job with its attempts, last error and lease (a delivery with its attempt log)."""
    row = _find(session, ref)
    if isinstance(row, Job):
        return job_view(row, detail=True)
    attempts = session.exec(
        select(WebhookAttempt).where(WebhookAttempt.delivery_id == row.id).order_by(WebhookAttempt.number)
    ).all()
    return delivery_view(row, settings, list(attempts))


def retry(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """Replay a dead, failed or cancelled job (fresh attempt budget) or a failed webhook delivery
    (one more attempt, same message id); its task is sent when ``session`` commits."""
    row = _find(session, ref)
    if isinstance(row, Job):
        if row.status not in ("dead", "failed", "cancelled"):
            raise Refused(f"job {row.id} is {row.status}; only dead, failed or cancelled jobs are retried")
        jobs.requeue(session, row)
        return job_view(row, detail=True)
    if row.status != "failed":
        raise Refused(f"webhook delivery {row.id} is {row.status}; only failed deliveries are retried")
    webhook = session.get(Webhook, row.webhook_id)
    if webhook is None or webhook.status != "enabled":
        raise Refused(f"the webhook of delivery {row.id} is disabled; enable it first (PUT /webhooks/{{id}})")
    row.status = "pending"
    row.due_at = utcnow()
    row.completed_at = None
    row.enqueued_at = None
    row.lease_owner = None
    row.lease_expires_at = None
    session.add(row)
    enqueue_after_commit(session, DELIVER_TASK, delivery_ids=[str(row.id)])
    return delivery_view(row, settings, [])


def cancel(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """Cancel a queued job no worker holds (status ``cancelled``) or a pending webhook delivery
    (closed ``failed``, "cancelled by an operator"); a running one is refused."""
    row = _find(session, ref)
    now = utcnow()
    model, waiting = (Job, "queued") if isinstance(row, Job) else (WebhookDelivery, "pending")
    values: dict[str, Any] = {"status": "cancelled", "updated_at": now}
    if model is WebhookDelivery:
        values = {"status": "failed", "completed_at": now, "last_error": "cancelled by an operator"}
    result = session.execute(
        update(model)
        .where(
            model.id == row.id,
            model.status == waiting,
            or_(model.lease_expires_at.is_(None), model.lease_expires_at < now),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    session.refresh(row)
    if result.rowcount != 1:
        held = " and a worker holds it" if row.lease_expires_at and _aware(row.lease_expires_at) >= now else ""
        raise Refused(f"{'job' if model is Job else 'webhook delivery'} {row.id} is {row.status}{held}; "
                      f"only {waiting} work that no worker holds is cancelled")
    return job_view(row, detail=True) if model is Job else delivery_view(row, settings, [])


# ---- readiness -----------------------------------------------------------------------------------


def check_database() -> None:
    """Raise unless the database answers ``SELECT 1``."""
    from sqlalchemy import text

    with session_scope() as session:
        session.exec(text("SELECT 1"))


def check_broker(settings: Settings) -> None:
    """Raise unless the broker accepts a connection (Redis: ``PING``)."""
    url = settings.effective_broker_url
    if _is_redis(url):
        _redis(url).ping()
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
        config=Config(
            s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=2, retries={"max_attempts": 1}
        ),
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
