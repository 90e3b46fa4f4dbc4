"""What every network token operation shares: the job kinds and their limits, the row lookups and
locks, the events, and the card network adapter of a job's tenant.

Lock order everywhere: the job row first, then the network token row (no deadlocks). Events carry ids
and status only; log rows use the entity type :data:`ENTITY_TYPE`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from sqlmodel import Session, select

from domain.network_tokens.errors import BrokenJob
from domain.network_tokens.views import TokenRow
from domain.webhooks import events
from infra import jobs
from infra.errors import not_found
from infra.jobs import PermanentError
from infra.lookup import parse_uuid
from providers import ProviderNotConfigured
from providers.card_network import CardNetwork, card_network_for
from storage.models import Job, Tenant
from storage.models_network_tokens import NetworkToken

PROVISION_TASK = "network_tokens.provision"
CARD_ART_TASK = "network_tokens.card_art"
CRYPTOGRAM_TASK = "network_tokens.cryptogram"
SUSPEND_TASK = "network_tokens.suspend"
RESUME_TASK = "network_tokens.resume"
DELETE_TASK = "network_tokens.delete"
EXPIRE_INTENTS_TASK = "network_tokens.expire_token_intents"
#: The subject type of the jobs on one network token (``Job.subject_type``).
SUBJECT = "network_token"
ENTITY_TYPE = "network-token"

PROVISION_MAX_ATTEMPTS = 6
"""Provisioning attempts before a dead letter; transient failures wait 1, 2, 4, 8, 16 s (±20 %)."""
PROVISION_BACKOFF_BASE = 1.0
CHANGE_MAX_ATTEMPTS = 5
"""Attempts of a suspend or resume before it is given up (the token keeps its state)."""
CALL_MAX_ATTEMPTS = 3
"""Attempts of a card art or cryptogram call (its caller waits for it)."""
DELETE_MAX_ATTEMPTS = 10
"""Attempts to tell the network about a deletion before a dead letter (replayable with requeue)."""
CARD_ART_TTL = dt.timedelta(hours=24)
"""How long fetched card art is answered from the database before the network is asked again."""


@dataclass(frozen=True)
class Started:
    """A network token operation recorded as a job: the network token and the job to wait for;
    ``created``, for a create, the network token's row as recorded (``views.TokenRow``)."""

    network_token_id: uuid.UUID
    job_id: uuid.UUID
    created: TokenRow | None = None


def get_token(session: Session, tenant_id: uuid.UUID, token_id: object, *, lock: bool = False) -> NetworkToken:
    """The tenant's network token (locked ``FOR UPDATE`` when ``lock``), else a 404 problem (another
    tenant's answers the same)."""
    parsed = parse_uuid(token_id)
    token = None
    if parsed is not None:
        query = select(NetworkToken).where(NetworkToken.id == parsed, NetworkToken.tenant_id == tenant_id)
        if lock:
            query = query.with_for_update().execution_options(populate_existing=True)
        token = session.exec(query).first()
    if token is None:
        raise not_found("network token")
    return token


def job_subject(job: Job) -> tuple[uuid.UUID, uuid.UUID]:
    """``(tenant id, network token id)`` of a job on one network token; :class:`BrokenJob` when the row
    lacks either."""
    token_id = parse_uuid(job.subject_id)
    if job.tenant_id is None or token_id is None:
        raise BrokenJob(f"job {job.id} ({job.kind}) names no tenant or network token")
    return job.tenant_id, token_id


def current_job(session: Session, job_id: uuid.UUID) -> Job:
    """The job row as committed now (re-read, no lock); :class:`BrokenJob` when it vanished."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise BrokenJob(f"job {job_id} vanished")
    return job


def locked_job(session: Session, job_id: uuid.UUID) -> Job:
    """The job row, locked until the end of the transaction (serialises with the worker's outcome)."""
    return session.exec(
        select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).one()


def emit(
    session: Session, token_id: uuid.UUID, tenant_id: uuid.UUID, kind: str, status: str, trace_id: str | None
) -> None:
    """Emit ``network-token.<kind>`` with ids and status only."""
    events.emit(
        session,
        tenant_id=tenant_id,
        type=f"network-token.{kind}",
        data={"network_token": {"id": str(token_id), "status": status}},
        trace_id=trace_id,
    )


def record_job(session: Session, kind: str, token: NetworkToken, trace_id: str | None, *, max_attempts: int) -> Job:
    """Record the job ``kind`` on ``token`` (its subject), sent when the transaction commits."""
    return jobs.record(
        session,
        kind=kind,
        tenant_id=token.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(token.id),
        trace_id=trace_id,
        max_attempts=max_attempts,
    )


def record_network_delete(session: Session, tenant_id: uuid.UUID, reference: str, trace_id: str | None) -> Job:
    """Record the job deleting the network's token ``reference`` at the network (retried until it confirms)."""
    return jobs.record(
        session,
        kind=DELETE_TASK,
        tenant_id=tenant_id,
        subject_type="network_reference",
        subject_id=reference,
        trace_id=trace_id,
        max_attempts=DELETE_MAX_ATTEMPTS,
    )


def network_for(tenant_type: str | None) -> CardNetwork:
    """The adapter for a job's tenant of ``tenant_type``, worker side: PermanentError ``tenant_removed``
    (no tenant) or ``provider_not_configured`` (the job result code the waiting request answers 422 for)."""
    if tenant_type is None:
        raise PermanentError("tenant_removed", "the tenant no longer exists")
    try:
        return card_network_for(tenant_type)
    except ProviderNotConfigured as exc:
        raise PermanentError("provider_not_configured", str(exc)) from None


def network_for_job(session: Session, job: Job) -> CardNetwork:
    """The adapter for the job's tenant (see :func:`network_for`)."""
    tenant = session.get(Tenant, job.tenant_id)
    return network_for(tenant.type if tenant is not None else None)
