"""Network tokens: provisioning through jobs, reads, card art, cryptograms, suspend, resume, delete
(spec, core document: sections 2 "Network token", "Network token details", "Network token account",
"Cryptogram"; 3 states; 4 "Network tokens"; proxy rule 7).

Every call to the card network runs in a worker (``spec/README.md`` decision 5): the API records a job
(:func:`infra.jobs.record`) in the transaction of its change, waits for the outcome without blocking the
event loop (woken by the job's outcome message, ``infra/wait.py``; up to
``TESSERA_NETWORK_TOKEN_WAIT_SECONDS``) and answers with what is known. The tasks in
``tasks/network_tokens.py`` are thin shells around the ``*_input`` / ``apply_*`` /
``*_failed`` functions here and in :mod:`~domain.network_tokens.provisioning` (create) and
:mod:`~domain.network_tokens.cryptograms`; the object shown is built by :mod:`~domain.network_tokens.views`,
the problems by :mod:`~domain.network_tokens.errors`. The job id is the network's idempotency key,
so a job run twice (a worker killed after the network answered and before its commit) gets the same
network token, not a second one.

States (the spec's table; ``inactive`` is ours to design):

* ``POST /network-tokens`` records the network token ``inactive`` with a ``network_tokens.provision``
  job. Success makes it ``active`` (event ``network-token.created``). A permanent failure (declined,
  unsupported network) or a dead letter **removes** the row, so nothing unusable stays behind: the
  waiting create answers 422, or, when it had already answered 202, the event ``network-token.failed``
  tells it, and ``GET /network-tokens/{id}`` answers 404 saying the provisioning failed.
* ``PUT .../suspend``: ``active`` -> ``suspended`` once the network confirms (event
  ``network-token.suspended``); ``PUT .../resume``: ``suspended`` -> ``active`` (``network-token.resumed``).
  Any other starting state is a 409, as is a second change while one is under way.
* ``DELETE``: any state -> removed at once (204, event ``network-token.deleted``); the network is told by
  a ``network_tokens.delete`` job, retried until it confirms. A network token removed while its
  provisioning ran is deleted at the network as soon as the network answers.

At rest: the network token's data (the DPAN and its expiration) and the provisioning input (card
number, cvc, cardholder) are sealed with the tenant's key (purposes ``network-token`` and
``network-token-source``); the provisioning input is dropped when the job ends. Cryptograms are never
stored: the worker seals each one to a one-time X25519 public key of the waiting request, whose
private key never leaves that request's memory, and the sealed value is wiped when read.
Events carry ids and status only; log rows use the entity type ``network-token``.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import update
from sqlmodel import Session, col, select

from domain.network_tokens.errors import change_problem, not_usable, removed_problem, timed_out
from domain.network_tokens.records import (
    CALL_MAX_ATTEMPTS,
    CARD_ART_TASK,
    CARD_ART_TTL,
    CHANGE_MAX_ATTEMPTS,
    ENTITY_TYPE,
    PROVISION_TASK,
    RESUME_TASK,
    SUSPEND_TASK,
    Started,
    current_job,
    emit,
    get_token,
    locked_job,
    network_for_job,
    record_job,
    record_network_delete,
)
from domain.network_tokens.views import caller_view, network_token_view, open_data
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra import jobs
from infra.errors import Problem, not_found
from infra.lookup import parse_uuid
from providers.card_network import CardNetwork
from storage.models import Job
from storage.models_network_tokens import NetworkToken
from storage.states import JOB_FAILED, JobStatus, NetworkTokenStatus
from storage.types import utcnow

# ---- lookups -------------------------------------------------------------------------------------


def _removed_by_failure(session: Session, tenant_id: uuid.UUID, token_id: object) -> Problem:
    """The 404 of a network token that is not there: it names the provisioning failure when the
    tenant's network token was removed because its provisioning failed."""
    parsed = parse_uuid(token_id)
    job = None
    if parsed is not None:
        job = session.exec(
            select(Job).where(
                Job.kind == PROVISION_TASK,
                Job.subject_id == str(parsed),
                Job.tenant_id == tenant_id,
                col(Job.status).in_(JOB_FAILED),
            )
        ).first()
    if job is None:
        return not_found("network token")
    return removed_problem((job.result or {}).get("code"))


def read_network_token(session: Session, caller: Caller, token_id: object) -> dict:
    """``GET /network-tokens/{id}``: the object by the read rules; a ``read`` log row.

    404 when missing or another tenant's (naming the provisioning failure when that removed it).
    """
    try:
        token = get_token(session, caller.tenant_id, token_id)
    except Problem:
        raise _removed_by_failure(session, caller.tenant_id, token_id) from None
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="read")
    return caller_view(session, caller, token)


def proxy_value(session: Session, tenant_id: uuid.UUID, network_token_id: object) -> dict:
    """The network token object with complete data, for the proxy's
    ``{{ network_token: ID | json: "$.data.number" }}`` expressions (spec, Proxy rule 7).

    No permission check and no log row (the proxy does both). Cryptograms and ECI values are never
    part of it. Raises a 404 problem for a missing or other tenant's network token and a 422 problem
    for one that cannot be used for transactions (``inactive`` or ``suspended``).
    """
    token = get_token(session, tenant_id, network_token_id)
    if token.status != NetworkTokenStatus.ACTIVE:
        raise not_usable(token.id, token.status)
    return network_token_view(token, open_data(session, token), reveal=True)


# ---- suspend, resume -----------------------------------------------------------------------------

_CHANGES = {
    "suspend": (NetworkTokenStatus.ACTIVE, NetworkTokenStatus.SUSPENDED, SUSPEND_TASK),
    "resume": (NetworkTokenStatus.SUSPENDED, NetworkTokenStatus.ACTIVE, RESUME_TASK),
}
_CHANGE_EVENTS = {"suspend": "suspended", "resume": "resumed"}


def request_change(session: Session, caller: Caller, token_id: object, action: str) -> Started:
    """``PUT /network-tokens/{id}/suspend`` or ``/resume``: record the job telling the network.

    ``action``: ``suspend`` (from ``active``) or ``resume`` (from ``suspended``); any other starting
    state, or another change still under way, is a 409 problem. 404 as :func:`read_network_token`.
    Writes an ``update`` log row.
    """
    required, _, task = _CHANGES[action]
    token = get_token(session, caller.tenant_id, token_id, lock=True)
    if token.status != required:
        raise Problem(
            409,
            f"Only a {required} network token can be {_CHANGE_EVENTS[action]}; this one is {token.status}.",
            title="Conflict",
            extra={"status_now": token.status},
        )
    if token.pending_job_id is not None:
        pending = session.get(Job, token.pending_job_id)
        if pending is not None and pending.status not in jobs.TERMINAL:
            raise Problem(
                409, "Another change of this network token is under way; retry when it ends.", title="Conflict"
            )
    job = record_job(session, task, token, caller.trace_id, max_attempts=CHANGE_MAX_ATTEMPTS)
    token.pending_job_id = job.id
    token.modified_by = caller.application_id
    session.add(token)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="update")
    return Started(token.id, job.id)


def change_outcome(session: Session, caller: Caller, started: Started) -> tuple[int, dict]:
    """After the bounded wait: ``(200, changed object)``, ``(202, object as it is)`` while the network
    has not confirmed yet, or a raised problem when the network refused (409 ``token_deleted``, 502)."""
    job = current_job(session, started.job_id)
    if job.status in JOB_FAILED:
        raise change_problem(job.status, job.result)
    token = get_token(session, caller.tenant_id, started.network_token_id)
    return (200 if job.status == JobStatus.SUCCEEDED else 202), caller_view(session, caller, token)


def change_input(session: Session, job: Job) -> tuple[CardNetwork, str] | None:
    """The adapter and the network's id of the token a suspend/resume job changes; None when removed."""
    token = session.get(NetworkToken, parse_uuid(job.subject_id))
    if token is None or token.tenant_id != job.tenant_id or token.network_reference is None:
        return None
    return network_for_job(session, job), token.network_reference


def apply_change(session: Session, job: Job, action: str, network_status: str | None) -> dict:
    """The network confirmed: set the new status, emit ``network-token.suspended`` / ``.resumed``."""
    _, target, _ = _CHANGES[action]
    # the job row is locked already (``JobTask``): the lock order is the job row, then the network token
    token = session.get(NetworkToken, parse_uuid(job.subject_id), with_for_update=True)
    if network_status is None or token is None or token.tenant_id != job.tenant_id:
        return {"network_token_id": job.subject_id, "skipped": True}
    if token.pending_job_id == job.id:
        token.pending_job_id = None
    if token.status != target:
        token.status = target
        token.modified_at = utcnow()
        emit(session, token.id, token.tenant_id, _CHANGE_EVENTS[action], target, job.trace_id)
    session.add(token)
    return {"network_token_id": job.subject_id, "status": token.status}


def change_failed(session: Session, job: Job, error: Exception) -> None:
    """The network refused or could not be reached: the token keeps its status; the change is over."""
    session.flush()  # the job row first (lock order)
    token = session.get(NetworkToken, parse_uuid(job.subject_id), with_for_update=True)
    if token is not None and token.pending_job_id == job.id:
        token.pending_job_id = None
        session.add(token)


# ---- delete --------------------------------------------------------------------------------------


def delete_network_token(session: Session, caller: Caller, token_id: object) -> None:
    """``DELETE /network-tokens/{id}``: remove it now from any state; tell the network by a job.

    A provisioning still queued is cancelled (one already running deletes what the network issues).
    Emits ``network-token.deleted`` and writes a ``delete`` log row. 404 as :func:`read_network_token`.
    """
    token = get_token(session, caller.tenant_id, token_id)
    if token.pending_job_id is not None:
        locked_job(session, token.pending_job_id)  # lock order: the job row, then the network token
    token = get_token(session, caller.tenant_id, token_id, lock=True)
    if token.network_reference:
        record_network_delete(session, caller.tenant_id, token.network_reference, caller.trace_id)
    if token.pending_job_id is not None:
        session.execute(
            update(Job)
            .where(col(Job.id) == token.pending_job_id, col(Job.status) == JobStatus.QUEUED)
            .values(status=JobStatus.CANCELLED, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    session.delete(token)
    emit(session, token.id, token.tenant_id, "deleted", "deleted", caller.trace_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="delete")


def delete_input(session: Session, job: Job) -> tuple[CardNetwork, str]:
    """The adapter and the network's id (the job's subject) of a network-side deletion."""
    return network_for_job(session, job), str(job.subject_id)


# ---- card art ------------------------------------------------------------------------------------


def card_art_start(
    session: Session, caller: Caller, token_id: object, *, now: dt.datetime | None = None
) -> dict | Started:
    """``GET /network-tokens/{id}/account``: the account object when fresh card art is stored (at most
    24 hours old), else the job fetching it. 404 as :func:`read_network_token`; 409 while the network
    token is inactive (no card art exists yet). Writes a ``read`` log row."""
    now = now or utcnow()
    token = get_token(session, caller.tenant_id, token_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=token.id, operation="read")
    if token.status == NetworkTokenStatus.INACTIVE or token.network_reference is None:
        raise Problem(
            409, "The network token is not provisioned yet: its card art cannot be had.", title="Card art unavailable"
        )
    if token.card_art is not None and token.card_art_at is not None and now - token.card_art_at < CARD_ART_TTL:
        return {"card_art": token.card_art}
    job = record_job(session, CARD_ART_TASK, token, caller.trace_id, max_attempts=CALL_MAX_ATTEMPTS)
    return Started(token.id, job.id)


def card_art_outcome(session: Session, caller: Caller, started: Started) -> dict:
    """After the bounded wait: the account object, or a problem (502 the network failed, 504 it did
    not answer in time; the job is then cancelled unless it is running)."""
    job = current_job(session, started.job_id)
    if job.status == JobStatus.SUCCEEDED:
        token = get_token(session, caller.tenant_id, started.network_token_id)
        if token.card_art is not None:
            return {"card_art": token.card_art}
    if job.status in JOB_FAILED or job.status == JobStatus.SUCCEEDED:
        raise Problem(
            502,
            "The card network did not give the card art.",
            title="Card art unavailable",
            extra={"code": (job.result or {}).get("code") or "network_unavailable"},
        )
    jobs.cancel_if_queued(session, job.id)
    raise timed_out("Card art unavailable")


def network_reference_input(session: Session, job: Job) -> tuple[CardNetwork, str] | None:
    """The adapter and the network's id of the job's network token; None when removed or inactive."""
    return change_input(session, job)


def apply_card_art(session: Session, job: Job, art: dict | None) -> dict:
    """Store the card art fetched (``{background_color, logo, card_image}``) with its time."""
    token = session.get(NetworkToken, parse_uuid(job.subject_id))
    if art is not None and token is not None and token.tenant_id == job.tenant_id:
        token.card_art = art
        token.card_art_at = utcnow()
        session.add(token)
    return {"network_token_id": job.subject_id}
