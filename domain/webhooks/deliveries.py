"""Webhook deliveries: signed POSTs with retries, in batches, fair between tenants.

Delivery (``ARCHITECTURE.md`` step 4): :func:`domain.webhooks.events.emit` writes one delivery per subscribed
webhook: a ``webhook_deliveries`` row, the public record (its webhook, event, last status code,
completion), and the job that does its work, with the same id (``infra/jobs.py``: kind
``webhooks.deliver``, its status, attempts, ``due_at``, lease and last error; the public status
``pending``/``succeeded``/``failed`` is derived from the job's, ``storage.models.DELIVERY_STATUS``).
The ``webhooks.deliver`` task leases the jobs, POSTs the envelope
``{event: {id, type, timestamp, tenant_id, trace_id, data}, delivered_at}`` signed with the Standard
Webhooks scheme (``webhook-id`` is the delivery's message id and stays the same across retries), and
records the attempt. A 5xx, 408, 409, 425 or 429 answer, a timeout or a connection error is retried
after the delays of ``TESSERA_WEBHOOK_RETRY_SCHEDULE`` (default 5 s, 30 s, 2 min, 10 min, 30 min, 2 h,
5 h, 10 h, 10 h); delays up to a minute ride on a Celery countdown, longer ones wait as ``due_at`` for
the relay; once the schedule is spent the job is a dead letter (``dead``; ``tessera jobs retry`` replays
it). Any other answer (a 3xx: redirects are not followed; another 4xx) and a refused destination
fail the delivery at once: the receiver would answer the same on every retry (a redeliver tries again).
A message carries about a hundred deliveries: one statement leases them and reads their events,
webhooks and signing secrets, the POSTs go out concurrently on the worker process's keep-alive pool
(``infra.http.deliver_many``) and the outcomes are recorded together.
Fairness (:mod:`infra.fairness`, in place): a tenant holding ``TESSERA_WEBHOOK_TENANT_SLOTS`` worker
slots does not take more while another tenant's deliveries wait: a worker that takes its batch
message leases the waiting tenants' due deliveries in its place and hands its own back, so one
tenant's flood (to any receiver) does not queue everyone else behind it; a newcomer's delivery goes
out with the first batch message any worker takes after its commit (``benchmarks/webhooks.py``: 0.2 s
during another tenant's 3,000-event burst, goal 2 s). Alone, a tenant uses every slot,
in short turns while it is behind (:func:`share_batch`).
A webhook failing without a single success for ``TESSERA_WEBHOOK_DISABLE_AFTER_SECONDS`` (5 days) is
disabled and its ``notify_email`` is told. Redirects are never followed; private, loopback and
link-local destinations are refused at delivery time unless ``TESSERA_ALLOW_PRIVATE_DESTINATIONS``.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import insert, or_, update
from sqlmodel import Session, col, select

from config.settings import Settings
from domain.tenancy.tenants import cached_signing_secret
from domain.webhooks.views import message_id
from infra import fairness, jobs
from infra.celery import DELIVER_TASK
from infra.http import TOTAL_TIMEOUT_FACTOR, DeliveryResult, Request, deliver_many
from infra.signing import headers as signature_headers
from storage import sql
from storage.db import rowcount, session_scope
from storage.models import Event, Job, Tenant, Webhook, WebhookAttempt, WebhookDelivery
from storage.states import JOB_TAKEABLE, JobStatus, WebhookStatus
from storage.types import table_of, utcnow

NOTIFY_TASK = "mail.webhook_disabled"


@dataclass(frozen=True)
class Prepared:
    """What one attempt needs, read with its lease before the HTTP call."""

    delivery_id: uuid.UUID
    webhook_id: uuid.UUID
    url: str
    body: bytes
    headers: dict[str, str]
    #: The job's attempts, this one counted (its lease counts it).
    attempt_number: int
    max_attempts: int


@dataclass
class BatchOutcome:
    """What one batch of deliveries came to: ``counts`` of each outcome (``success``, ``http_error``,
    ``timeout``, ``connection_error``, ``refused``, ``closed``, ``skipped``, ``postponed``: handed back
    by :func:`share_batch`), how many
    were scheduled for a retry and how many failed for good (``dead`` of them: retries spent)."""

    counts: dict[str, int]
    retrying: int = 0
    failed: int = 0
    #: Of ``failed``: those whose retry schedule is spent (their jobs are dead letters).
    dead: int = 0


#: What an attempt reads with its lease: its job, its webhook, its event, its tenant's sealed secret.
_LEASED_COLUMNS = (
    col(Job.id),
    col(Job.attempts),
    col(Job.max_attempts),
    col(Webhook.id),
    col(Webhook.url),
    col(Webhook.status),
    col(Event.id),
    col(Event.type),
    col(Event.created_at),
    col(Event.tenant_id),
    col(Event.trace_id),
    col(Event.data),
    col(Tenant.webhook_secret_ct),
    col(Tenant.deleted_at),
)
#: How a delivery's job relates to its delivery, event, webhook and tenant.
_LEASED_JOINS = (
    col(WebhookDelivery.id) == col(Job.id),
    col(Event.id) == col(WebhookDelivery.event_id),
    col(Webhook.id) == col(WebhookDelivery.webhook_id),
    col(Tenant.id) == col(WebhookDelivery.tenant_id),
)


def _lease_and_read(session: Session, delivery_ids: list[uuid.UUID], owner: str, lease_seconds: float) -> Sequence:
    """Lease the job of every takeable delivery of ``delivery_ids`` (:func:`infra.jobs.lease` of a list)
    and read each with its webhook, event and tenant (:func:`storage.sql.update_returning`: one
    ``UPDATE jobs ... FROM webhook_deliveries, events, webhooks, tenants ... RETURNING`` on PostgreSQL)."""
    statement = jobs.lease(delivery_ids, owner, lease_seconds=lease_seconds)
    return sql.update_returning(
        session, statement, key=table_of(Job).c.id, joins=_LEASED_JOINS, columns=_LEASED_COLUMNS
    )


def lease_batch(
    session: Session, delivery_ids: list[uuid.UUID], owner: str, *, lease_seconds: float
) -> tuple[list[Prepared], list[uuid.UUID]]:
    """Lease the jobs of the deliveries of ``delivery_ids`` that are due (one statement: a duplicate
    message or a second worker gets none of them; an attempt is counted on each) and build their
    signed requests.

    Returns ``(prepared, closed)``: ``closed`` are leased deliveries that will never be sent (their
    webhook is disabled or their tenant deleted); :func:`record_outcomes` closes them.
    """
    if not delivery_ids:
        return [], []
    rows = _lease_and_read(session, delivery_ids, owner, lease_seconds)
    delivered_at = utcnow().isoformat()
    timestamp = int(time.time())
    prepared, closed = [], []
    for (
        delivery_id,
        attempts,
        max_attempts,
        webhook_id,
        url,
        webhook_status,
        event_id,
        event_type,
        event_created_at,
        tenant_id,
        trace_id,
        data,
        secret_ct,
        tenant_deleted_at,
    ) in rows:
        if webhook_status != WebhookStatus.ENABLED or tenant_deleted_at is not None:
            closed.append(delivery_id)
            continue
        envelope = {
            "event": {
                "id": str(event_id),
                "type": event_type,
                "timestamp": event_created_at.isoformat(),
                "tenant_id": str(tenant_id),
                "trace_id": trace_id,
                "data": data,
            },
            "delivered_at": delivered_at,
        }
        body = json.dumps(envelope, separators=(",", ":")).encode()
        secret = cached_signing_secret(session, tenant_id, secret_ct)
        signed = signature_headers(secret, message_id(delivery_id), timestamp, body)
        prepared.append(Prepared(delivery_id, webhook_id, url, body, signed, attempts, max_attempts))
    return prepared, closed


def lease_delivery(session: Session, delivery_id: uuid.UUID, owner: str, *, lease_seconds: float) -> bool:
    """Take the lease on the job of one due delivery (see :func:`lease_batch`); False when taken."""
    statement = jobs.lease([delivery_id], owner, lease_seconds=lease_seconds)
    return rowcount(session.execute(statement.where(col(Job.kind) == DELIVER_TASK))) == 1


def _retry_delay(result: DeliveryResult, attempt_number: int, settings: Settings) -> float | None:
    """Seconds before the next attempt, or None when there is none: on success, on a refused
    destination or an answer that retrying cannot change (a 3xx, or a 4xx other than 408, 409, 425,
    429: ``DeliveryResult.transient`` is false), or when ``TESSERA_WEBHOOK_RETRY_SCHEDULE`` is spent."""
    delays = settings.webhook_retry_delays
    if result.outcome == "success" or not result.transient or attempt_number > len(delays):
        return None
    return max(delays[attempt_number - 1], result.retry_after_s or 0)


def record_outcomes(
    session: Session,
    prepared: list[Prepared],
    results: list[DeliveryResult],
    closed: list[uuid.UUID],
    settings: Settings,
) -> BatchOutcome:
    """Record a batch of attempts: one multi-row INSERT of the attempt rows, and per distinct outcome
    one UPDATE of the jobs (:func:`infra.jobs.settle`, :func:`infra.jobs.retry` of lists) and one of
    the delivery rows (last status code, completed time); in practice one of each: every delivery
    succeeded. Retries are scheduled by ``due_at`` and sent after the commit (a countdown up to a
    minute, the relay beyond).

    Success closes the delivery (job ``succeeded``) and clears its webhook's failing streak. A
    transient failure schedules the next try from the retry schedule; a permanent one (refused
    destination, a 3xx or a 4xx other than 408/409/425/429) fails the job without further tries, and
    a spent schedule makes it a dead letter (``tessera jobs retry`` replays it). A webhook failing for
    longer than the disable period is disabled and its notify address mailed (a recorded
    ``mail.webhook_disabled`` job).
    """
    now = utcnow()
    outcome = BatchOutcome(counts={})
    if closed:
        jobs.settle(session, closed, JobStatus.FAILED, error="the webhook is disabled", now=now)
        _update_deliveries(session, closed, completed_at=now)
        outcome.counts["closed"] = len(closed)
        outcome.failed += len(closed)
    if not prepared:
        return outcome
    session.execute(
        insert(WebhookAttempt),
        [
            {
                "id": uuid.uuid4(),
                "delivery_id": p.delivery_id,
                "number": p.attempt_number,
                "outcome": r.outcome,
                "status_code": r.status_code,
                "duration_ms": r.duration_ms,
                "error": r.error,
                "attempted_at": now,
            }
            for p, r in zip(prepared, results, strict=True)
        ],
    )
    Group = tuple[JobStatus, int | None, str | None, float | None]  # status, HTTP status, error, retry delay
    groups: dict[Group, list[uuid.UUID]] = {}
    succeeded: set[uuid.UUID] = set()
    failing: set[uuid.UUID] = set()
    for p, r in zip(prepared, results, strict=True):
        outcome.counts[r.outcome] = outcome.counts.get(r.outcome, 0) + 1
        if r.outcome == "success":
            succeeded.add(p.webhook_id)
            key: Group = (JobStatus.SUCCEEDED, r.status_code, None, None)
        else:
            failing.add(p.webhook_id)
            error = (r.error or f"HTTP {r.status_code}")[:500]
            delay = _retry_delay(r, p.attempt_number, settings)
            if delay is not None and p.attempt_number < p.max_attempts:
                outcome.retrying += 1
                key = (JobStatus.QUEUED, r.status_code, error, delay)
            elif r.transient:  # retrying could help, but the schedule is spent: a dead letter
                outcome.failed += 1
                outcome.dead += 1
                key = (JobStatus.DEAD, r.status_code, error, None)
            else:
                outcome.failed += 1
                key = (JobStatus.FAILED, r.status_code, error, None)
        groups.setdefault(key, []).append(p.delivery_id)
    for (status, status_code, reason, wait_seconds), ids in groups.items():
        if status == JobStatus.QUEUED and wait_seconds is not None:
            jobs.retry(session, ids, kind=DELIVER_TASK, delay=wait_seconds, error=reason or "", now=now)
            _update_deliveries(session, ids, last_status_code=status_code)
        else:
            jobs.settle(session, ids, status, error=reason, now=now)
            _update_deliveries(session, ids, last_status_code=status_code, completed_at=now)
    cleared = succeeded - failing
    if cleared:
        session.execute(
            update(Webhook)
            .where(col(Webhook.id).in_(cleared), col(Webhook.failing_since).is_not(None))
            .values(failing_since=None)
            .execution_options(synchronize_session=False)
        )
    for webhook_id in failing:
        webhook = session.get(Webhook, webhook_id)
        if webhook is not None:
            _note_failure(session, webhook, now, settings)
    return outcome


def _update_deliveries(session: Session, ids: list[uuid.UUID], **values) -> None:
    session.execute(
        update(WebhookDelivery)
        .where(col(WebhookDelivery.id).in_(ids))
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def _note_failure(session: Session, webhook: Webhook, now: dt.datetime, settings: Settings) -> None:
    webhook.failing_since = webhook.failing_since or now
    failing_for = (now - webhook.failing_since).total_seconds()
    if webhook.status == WebhookStatus.ENABLED and failing_for >= settings.webhook_disable_after_seconds:
        webhook.status = WebhookStatus.DISABLED
        webhook.disabled_reason = f"deliveries failed for {int(failing_for)} s without a success"
        webhook.modified_at = now
        if webhook.notify_email:
            jobs.record(
                session,
                kind=NOTIFY_TASK,
                tenant_id=webhook.tenant_id,
                subject_type="webhook",
                subject_id=str(webhook.id),
                trace_id=None,
                max_attempts=8,
            )
    session.add(webhook)


@dataclass(frozen=True)
class DisabledNotice:
    """The mail telling a disabled webhook's ``notify_email`` why it was disabled."""

    to: str
    subject: str
    text: str


def disabled_notice(session: Session, webhook_id: uuid.UUID) -> DisabledNotice | None:
    """The ``mail.webhook_disabled`` job's mail, or None when there is nothing to tell any more
    (the webhook is gone, enabled again, or has no ``notify_email``)."""
    webhook = session.get(Webhook, webhook_id)
    if webhook is None or not webhook.notify_email or webhook.status != WebhookStatus.DISABLED:
        return None
    text = (
        f"Your Tessera webhook '{webhook.name}' ({webhook.id}) delivering to {webhook.url} was disabled: "
        f"{webhook.disabled_reason}.\n\n"
        "Fix the receiver, then enable the webhook again with PUT /webhooks/{id} and status 'enabled'.\n"
    )
    return DisabledNotice(to=webhook.notify_email, subject=f"Webhook '{webhook.name}' disabled", text=text)


def share_batch(
    session: Session, delivery_ids: list[uuid.UUID], settings: Settings, *, now: dt.datetime | None = None
) -> tuple[set[uuid.UUID], list[uuid.UUID]]:
    """Share a batch about to be leased between tenants (:mod:`infra.fairness`, in place). Returns
    ``(aside, in_place)``: the ids of the batch set aside (handed back: queued again, due now, sent
    again as a new batch message behind those queued; no attempt counted) and the ids of other
    tenants' deliveries to lease in their place. A tenant holding fewer than
    ``settings.webhook_tenant_slots`` worker slots (distinct task runs with deliveries in flight) is
    never touched; one holding them:

    * while another tenant that holds no slot has deliveries due and not taken: its deliveries of the
      batch are set aside and as many of the waiting tenants' are taken in their place, so a newcomer's
      delivery goes out with the first batch message any worker takes, not behind the flood queued
      ahead of its own message (which later finds it taken and skips it);
    * alone, when it is behind (a delivery due more than ``settings.webhook_backlog_seconds`` ago still
      pending: a flood, a slow receiver), in short turns: this run keeps ``webhook_host_concurrency``
      of its deliveries (one round of concurrent POSTs) and hands the rest back at once; so a process
      it holds comes free after one round, and another tenant's delivery that arrives meanwhile waits
      one round at most, not a whole batch.

    A tenant behind whose batch is smaller than a round (deliveries sent one a message, as requests
    emit them) has the round filled with its oldest deliveries waiting (their own messages later skip
    them), so a flood to a slow receiver goes out a full round at a time.

    Fairness takes capacity from a tenant only to give it to another one. On PostgreSQL the check and
    the lease that follows it in the same transaction are serialised per tenant (a transaction-level
    advisory lock), so two workers cannot both take the last slot. Statements: one query of the
    batch's tenants and one grouped count of the running deliveries; for a tenant at its slots, index
    range probes for waiting tenants (two when it is alone); for one at its slots or with a batch
    smaller than a round, a probe of its backlog (and, behind, one range scan to fill the round)."""
    slots = settings.webhook_tenant_slots
    if slots <= 0 or not delivery_ids:
        return set(), []
    now = now or utcnow()
    owners = dict(session.execute(select(col(Job.id), col(Job.tenant_id)).where(col(Job.id).in_(delivery_ids))).all())
    tenants = sorted({tenant for tenant in owners.values() if tenant is not None}, key=str)
    for tenant_id in tenants:
        sql.lock_key(session, str(tenant_id))
    held = fairness.held_by_tenant(session, [DELIVER_TASK], now=now, runs=True)
    batch = set(delivery_ids)
    handed_back: list[uuid.UUID] = []
    in_place: list[uuid.UUID] = []
    round_size = settings.webhook_host_concurrency
    for tenant_id in tenants:
        own = [delivery_id for delivery_id in delivery_ids if owners.get(delivery_id) == tenant_id]
        at_slots = held.get(tenant_id, 0) >= slots
        if at_slots:
            others = fairness.pick_for_others(
                session, [DELIVER_TASK], tenant=tenant_id, held=held, below=slots, limit=len(own), now=now
            )
            fresh = [job_id for job_id, _kind in others if job_id not in batch]
            if fresh:
                handed_back += own
                in_place += fresh
                batch.update(fresh)
                continue
        if not (at_slots or len(own) < round_size) or not _behind(session, tenant_id, settings, now):
            continue
        if at_slots:
            handed_back += own[round_size:]
        room = round_size - len(own)
        if room > 0:  # a full round: the tenant's oldest deliveries waiting, their messages later skip them
            more = _waiting_of(session, tenant_id, now, limit=room, besides=batch)
            in_place += more
            batch.update(more)
    if handed_back:
        jobs.requeue(session, handed_back, kind=DELIVER_TASK, fresh_budget=False, waiting_only=True, now=now)
    return set(handed_back), in_place


def _behind(session: Session, tenant_id: uuid.UUID, settings: Settings, now: dt.datetime) -> bool:
    """Whether the tenant has a delivery due more than ``webhook_backlog_seconds`` ago still pending
    (one probe of ``ix_jobs_deliveries_waiting``)."""
    return (
        session.execute(
            select(col(Job.id))
            .where(
                col(Job.kind) == DELIVER_TASK,
                col(Job.status).in_(JOB_TAKEABLE),
                col(Job.tenant_id) == tenant_id,
                col(Job.due_at) < now - dt.timedelta(seconds=settings.webhook_backlog_seconds),
            )
            .limit(1)
        ).first()
        is not None
    )


def _waiting_of(
    session: Session, tenant_id: uuid.UUID, now: dt.datetime, *, limit: int, besides: set[uuid.UUID]
) -> list[uuid.UUID]:
    """Up to ``limit`` of the tenant's deliveries due and not taken, oldest first, other than ``besides``
    (an index range scan of ``ix_jobs_deliveries_waiting``)."""
    rows = session.execute(
        select(col(Job.id))
        .where(
            col(Job.kind) == DELIVER_TASK,
            col(Job.status).in_(JOB_TAKEABLE),
            col(Job.tenant_id) == tenant_id,
            col(Job.due_at) <= now,
            or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
        )
        .order_by(col(Job.due_at))
        .limit(limit + len(besides))
    ).scalars()
    return [job_id for job_id in rows if job_id not in besides][:limit]


def deliver_batch(delivery_ids: list[uuid.UUID], owner: str, settings: Settings) -> BatchOutcome:
    """Deliver a batch (about a hundred deliveries, one message): lease them and read what they need
    in one statement, POST them concurrently on the process's connection pool, record the outcomes
    in one transaction. Two short transactions; the HTTP calls run outside any."""
    lease_seconds = settings.webhook_timeout_seconds * TOTAL_TIMEOUT_FACTOR + 30
    with session_scope() as session:
        aside, in_place = share_batch(session, delivery_ids, settings)
        taking = [delivery_id for delivery_id in delivery_ids if delivery_id not in aside] if aside else delivery_ids
        taking = taking + in_place if in_place else taking
        prepared, closed = lease_batch(session, taking, owner, lease_seconds=lease_seconds)
    postponed = len(aside)
    results = deliver_many(
        [Request(p.url, p.body, p.headers) for p in prepared],
        timeout_s=settings.webhook_timeout_seconds,
        allow_private=settings.allow_private_destinations,
        per_host=settings.webhook_host_concurrency,
    )
    if not prepared and not closed:
        counts = {"postponed": postponed} if postponed else {}
        return BatchOutcome(counts=counts | ({"skipped": len(taking)} if taking or not postponed else {}))
    with session_scope() as session:
        outcome = record_outcomes(session, prepared, results, closed, settings)
    skipped = len(taking) - len(prepared) - len(closed)
    if skipped:
        outcome.counts["skipped"] = skipped
    if postponed:
        outcome.counts["postponed"] = postponed
    return outcome


def attempt(delivery_id: uuid.UUID, owner: str, settings: Settings) -> str:
    """Run one attempt of one delivery end to end (:func:`deliver_batch` of one); returns what happened:
    an HTTP outcome, ``closed`` or ``skipped`` (leased by someone else, or not due)."""
    counts = deliver_batch([delivery_id], owner, settings).counts
    return next(iter(counts))
