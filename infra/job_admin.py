"""Jobs as data for operators: listing, showing, replaying and cancelling jobs and webhook deliveries
(``tessera jobs list|show|retry|cancel``, ``tessera/cli/operations.py``).

A job that exhausted its retries is a dead letter (``infra/jobs.py``: status ``dead`` with its last
error); :func:`retry` replays it. A webhook delivery is shown as a delivery (its public status
``pending``/``succeeded``/``failed``, its attempt log); replaying one that ended ``failed`` (its job
failed, dead or cancelled) requeues its job.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import ColumnElement, or_, update
from sqlmodel import Session, col, select

from config.settings import Settings
from infra import jobs
from infra.celery import DELIVER_TASK, queue_of
from infra.ops import aware
from storage.db import rowcount
from storage.models import DELIVERY_JOB_STATUSES, DELIVERY_STATUS, Job, Webhook, WebhookAttempt, WebhookDelivery
from storage.states import JOB_UNSUCCESSFUL, JobStatus, WebhookStatus
from storage.types import utcnow


class NotFound(LookupError):
    """No job or webhook delivery has this id."""


class Refused(ValueError):
    """The job or delivery is not in a state that allows the operation."""


def _iso(value: dt.datetime | None) -> str | None:
    return aware(value).isoformat() if value else None


def job_view(job: Job, *, detail: bool = False) -> dict[str, Any]:
    """A job as ``tessera jobs`` shows it."""
    view: dict[str, Any] = {
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


def delivery_state(job_status: str) -> str:
    """A webhook delivery's state as an operator reads it: its public status
    (:data:`~storage.models.DELIVERY_STATUS`), except that one an operator cancelled reads
    ``cancelled`` (the API shows it ``failed``)."""
    return "cancelled" if job_status == "cancelled" else DELIVERY_STATUS[job_status]


def delivery_view(delivery: WebhookDelivery, job: Job, attempts: list[WebhookAttempt] | None = None) -> dict[str, Any]:
    """A webhook delivery as ``tessera jobs`` shows it (kind ``webhooks.deliver``): its job, with the
    delivery's public status as ``state`` (``job_state`` is the job's own)."""
    view: dict[str, Any] = {
        "id": str(delivery.id),
        "kind": DELIVER_TASK,
        "state": delivery_state(job.status),
        "queue": queue_of(DELIVER_TASK),
        "tenant_id": str(delivery.tenant_id),
        "subject_type": "webhook",
        "subject_id": str(delivery.webhook_id),
        "subject_number": None,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "due_at": _iso(job.due_at),
        "last_error": job.last_error,
        "created_at": _iso(delivery.created_at),
        "updated_at": _iso(job.updated_at),
    }
    if attempts is not None:
        view.update(
            job_state=job.status,
            event_id=str(delivery.event_id),
            last_status_code=delivery.last_status_code,
            lease_owner=job.lease_owner,
            lease_expires_at=_iso(job.lease_expires_at),
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
    """Jobs, most recently changed first; for kind ``webhooks.deliver`` shown as webhook deliveries,
    whose ``states`` may also be the public words (``pending``: queued or running; ``failed``: failed,
    dead or cancelled)."""
    where: list[ColumnElement[bool]] = []
    if states:
        wanted = set(states)
        if kind == DELIVER_TASK:
            wanted = {job_state for state in states for job_state in DELIVERY_JOB_STATUSES.get(state, (state,))}
        where.append(col(Job.status).in_(sorted(wanted)))
    if kind:
        where.append(col(Job.kind) == kind)
    if tenant_id:
        where.append(col(Job.tenant_id) == tenant_id)
    order = (col(Job.updated_at).desc(), col(Job.id))
    if kind == DELIVER_TASK:
        pairs = session.exec(
            select(WebhookDelivery, Job)
            .join(Job, col(Job.id) == WebhookDelivery.id)
            .where(*where)
            .order_by(*order)
            .limit(limit)
        ).all()
        return [delivery_view(delivery, job) for delivery, job in pairs]
    rows = session.exec(select(Job).where(*where).order_by(*order).limit(limit)).all()
    return [job_view(row) for row in rows]


def parse_id(ref: str) -> uuid.UUID:
    """A job or delivery id (a uuid, or a delivery's ``msg_...`` message id); NotFound when malformed."""
    try:
        return uuid.UUID(ref.strip().removeprefix("msg_"))
    except ValueError:
        raise NotFound(f"'{ref}' is not a job or delivery id") from None


def _find(session: Session, ref: str) -> tuple[Job, WebhookDelivery | None]:
    """The job of ``ref`` and, for a webhook delivery's job, the delivery; NotFound when none."""
    ident = parse_id(ref)
    job = session.get(Job, ident)
    if job is None:
        raise NotFound(f"no job or webhook delivery has id {ident}")
    return job, session.get(WebhookDelivery, ident) if job.kind == DELIVER_TASK else None


def _attempt_log(session: Session, delivery: WebhookDelivery) -> list[WebhookAttempt]:
    return list(
        session.exec(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id == delivery.id)
            .order_by(col(WebhookAttempt.attempted_at), col(WebhookAttempt.number))
        ).all()
    )


def show_job(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """One job with its attempts, last error and lease (a delivery with its attempt log)."""
    job, delivery = _find(session, ref)
    if delivery is None:
        return job_view(job, detail=True)
    return delivery_view(delivery, job, _attempt_log(session, delivery))


def retry(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """Replay a dead, failed or cancelled job (fresh attempt budget), a webhook delivery's too (once its
    webhook is enabled: same message id); its task is sent when ``session`` commits."""
    job, delivery = _find(session, ref)
    if job.status not in JOB_UNSUCCESSFUL:
        if delivery is not None:
            raise Refused(
                f"webhook delivery {job.id} is {delivery_state(job.status)}; only failed deliveries are retried"
            )
        raise Refused(f"job {job.id} is {job.status}; only dead, failed or cancelled jobs are retried")
    if delivery is None:
        jobs.requeue(session, job)
        return job_view(job, detail=True)
    webhook = session.get(Webhook, delivery.webhook_id)
    if webhook is None or webhook.status != WebhookStatus.ENABLED:
        raise Refused(f"the webhook of delivery {job.id} is disabled; enable it first (PUT /webhooks/{{id}})")
    jobs.requeue(session, job)
    delivery.completed_at = None
    session.add(delivery)
    session.flush()
    session.refresh(job)
    return delivery_view(delivery, job, [])


def cancel(session: Session, settings: Settings, ref: str) -> dict[str, Any]:
    """Cancel a queued job no worker holds (status ``cancelled``; a webhook delivery's job too: the
    delivery is closed, ``failed`` to the API and ``cancelled`` here, "cancelled by an operator"); a
    running one is refused."""
    job, delivery = _find(session, ref)
    now = utcnow()
    values: dict[str, Any] = {"status": JobStatus.CANCELLED, "updated_at": now}
    if delivery is not None:
        values["last_error"] = "cancelled by an operator"
    result = session.execute(
        update(Job)
        .where(
            col(Job.id) == job.id,
            col(Job.status) == JobStatus.QUEUED,
            or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    session.refresh(job)
    if rowcount(result) != 1:
        held = " and a worker holds it" if job.lease_expires_at and aware(job.lease_expires_at) >= now else ""
        if delivery is not None:
            raise Refused(
                f"webhook delivery {job.id} is {delivery_state(job.status)}{held}; "
                "only pending work that no worker holds is cancelled"
            )
        raise Refused(f"job {job.id} is {job.status}{held}; only queued work that no worker holds is cancelled")
    if delivery is None:
        return job_view(job, detail=True)
    delivery.completed_at = now
    session.add(delivery)
    return delivery_view(delivery, job, [])
