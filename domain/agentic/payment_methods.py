"""Agentic payment methods: create, read, list, retry a rail, errors history, delete (spec 001 sections 2-4).

The handler side of the spine (``ARCHITECTURE.md``): each function here runs in one transaction of
the API (``fn(session, ...)``), records the jobs the workers run (``domain/agentic/enrollment.py``,
``tasks/agentic.py``) and never calls a provider itself.

Rails follow from the card: visa -> ``agentic-token``/``vic``, mastercard ->
``agentic-token``/``agentpay``, and any network the processor supports (visa, mastercard, amex) ->
``spt``/``psp``. A create writes the payment method, one rail per pair and one enrollment job per
rail in one transaction, with an ``enroll`` operation lease that the last of those jobs releases;
the handler then waits for the jobs (``infra/wait.py``) up to ``agentic_wait_seconds`` and answers
(:func:`finish_create`): rails whose job is still running are shown ``pending`` and flagged so that their outcome is
delivered as the event ``agentic.payment-method.rail.retried``.

Payment method updated_at moves only with what a client can see: a rail's status, error code or
provider ids, the card's data, the status (deleted). Leases, jobs and idempotency records do not.
"""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete
from sqlmodel import Session, col, func, select

from config.settings import Settings
from domain.agentic import idempotency, leases
from domain.agentic.errors import CATALOGUE, agentic_error, validation_error
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tokens.cards import card_brand
from domain.tokens.service import load_token_data
from domain.webhooks import events
from infra import jobs
from infra.errors import Problem
from providers.agentic import DISPLAY_FIELDS, provider_for
from storage.db import Rows, get_engine, insert_rows, row_of
from storage.keyset import keyset_page
from storage.models import Job
from storage.models_agentic import Agent, OperationLease, PaymentMethod, PaymentMethodRail, ProviderError
from storage.models_allowances import Allowance
from storage.states import ALLOWANCE_LIVE, JOB_FAILED, JOB_UNSUCCESSFUL, PaymentMethodStatus, RailStatus
from storage.types import table_of, utcnow

SOURCE_TYPE = "svc_card_token"
RAIL_EVENT = "agentic.payment-method.rail.retried"
ENTITY_TYPE = "payment_method"

ENROLL_TASK = "agentic.enroll_rail"
POLL_TASK = "agentic.poll_rail"
DELETE_TASK = "agentic.delete_payment_method"
ENROLL_MAX_ATTEMPTS = 4
DELETE_MAX_ATTEMPTS = 4
#: A provider-pending enrollment is polled this many times (backing off to 30 s): about 20 minutes.
POLL_MAX_ATTEMPTS = 45

#: The only valid (rail, provider) pairs (spec 001 section 4, Rails and providers).
VALID_PAIRS: tuple[tuple[str, str], ...] = (("agentic-token", "vic"), ("agentic-token", "agentpay"), ("spt", "psp"))
RAILS = ("agentic-token", "spt")
#: card brand -> the agentic-token provider of its network
TOKEN_PROVIDER_OF_BRAND = {"visa": "vic", "mastercard": "agentpay"}
#: the networks the processor behind psp supports
PSP_BRANDS = frozenset({"visa", "mastercard", "amex"})


# ---- ids, views ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """A new resource id: ``prefix`` + 32 hex characters (``pm_``, ``prv_``, ``agt_``)."""
    return f"{prefix}{secrets.token_hex(16)}"


def rails_for_brand(brand: str | None) -> list[tuple[str, str]]:
    """The (rail, provider) pairs a card of ``brand`` provisions, agentic-token first."""
    pairs = []
    if brand in TOKEN_PROVIDER_OF_BRAND:
        pairs.append(("agentic-token", TOKEN_PROVIDER_OF_BRAND[brand]))
    if brand in PSP_BRANDS:
        pairs.append(("spt", "psp"))
    return pairs


def rail_view(rail: PaymentMethodRail) -> dict:
    """``{rail, provider, status, provider_ids, error?: {code}}``; error only when status is error."""
    view: dict[str, Any] = {
        "rail": rail.rail,
        "provider": rail.provider,
        "status": rail.status,
        "provider_ids": dict(rail.provider_ids or {}),
    }
    if rail.status == RailStatus.ERROR:
        view["error"] = {"code": rail.error_code or "PROVIDER_ENROLLMENT_FAILED"}
    return view


def payment_method_view(pm: PaymentMethod, rails: list[PaymentMethodRail]) -> dict:
    """The payment method object (spec 001 section 2); ``agent_id`` only when supplied."""
    view: dict[str, Any] = {
        "id": pm.id,
        "source": dict(pm.source),
        "status": pm.status,
        "consumer": dict(pm.consumer),
        "card": pm.card,
        "rails": [rail_view(r) for r in sorted(rails, key=lambda r: r.position)],
    }
    if pm.agent_id is not None:
        view["agent_id"] = pm.agent_id
    view["created_at"] = pm.created_at
    view["updated_at"] = pm.updated_at
    return view


def provider_error_view(error: ProviderError) -> dict:
    """The provider error object (spec 001 section 2)."""
    return {
        "id": error.id,
        "code": error.code,
        "title": error.title,
        "detail": error.detail,
        "provider": error.provider,
        "operation": error.operation,
        "rail": error.rail,
        "provider_code": error.provider_code,
        "provider_correlation_id": error.provider_correlation_id,
        "payment_method_id": error.payment_method_id,
        "allowance_id": error.allowance_id,
        "payment_credential_id": error.payment_credential_id,
        "occurred_at": error.occurred_at,
    }


def rails_of(session: Session, pm_id: str) -> list[PaymentMethodRail]:
    """The rails of a payment method, in their order."""
    return list(
        session.exec(
            select(PaymentMethodRail)
            .where(PaymentMethodRail.payment_method_id == pm_id)
            .order_by(col(PaymentMethodRail.position))
            .execution_options(populate_existing=True)
        ).all()
    )


def view_of(session: Session, pm: PaymentMethod) -> dict:
    """The payment method object of a loaded row."""
    return payment_method_view(pm, rails_of(session, pm.id))


# ---- shared pieces (api and workers) -------------------------------------------------------------


def find(session: Session, tenant_id: uuid.UUID, pm_id: str, *, lock: bool = False) -> PaymentMethod:
    """The tenant's payment method (locked for update when ``lock``), else 404
    ``PAYMENT_METHOD_NOT_FOUND`` (another tenant's answers the same)."""
    query = select(PaymentMethod).where(PaymentMethod.id == pm_id, PaymentMethod.tenant_id == tenant_id)
    if lock:
        query = query.with_for_update()
    pm = session.exec(query.execution_options(populate_existing=True)).first()
    if pm is None:
        raise agentic_error("PAYMENT_METHOD_NOT_FOUND")
    return pm


def lock(session: Session, pm_id: str) -> PaymentMethod | None:
    """The payment method locked for update (every writer takes this lock first), or None."""
    return session.exec(
        select(PaymentMethod)
        .where(PaymentMethod.id == pm_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).first()


def merge_card(current: dict | None, provider_card: dict | None) -> tuple[dict | None, bool]:
    """``current`` completed with a provider's card data: fields still missing are filled and null
    display values backfilled; known values are kept. Returns ``(card, changed)``."""
    if not provider_card:
        return current, False
    merged = dict(current or {"type": "card"})
    for name, value in provider_card.items():
        if name == "display" or value is None:
            continue
        if merged.get(name) is None:
            merged[name] = value
    display = dict(merged.get("display") or dict.fromkeys(DISPLAY_FIELDS))
    for name, value in (provider_card.get("display") or {}).items():
        if value is not None and display.get(name) is None:
            display[name] = value
    merged["display"] = display
    return merged, merged != (current or {})


def record_provider_error(
    session: Session,
    rail: Any,
    *,
    code: str,
    provider_code: str | None = None,
    correlation_id: str | None = None,
    operation: str = "enrollment",
    detail: str | None = None,
    allowance_id: str | None = None,
    payment_credential_id: str | None = None,
) -> ProviderError:
    """Add a provider error object for ``rail`` (a payment method's or an allowance's: it has
    ``tenant_id``, ``rail``, ``provider`` and ``payment_method_id`` or ``allowance_id``), with
    catalogue title and remediation; never the provider's message or body."""
    _status, title, remediation = CATALOGUE.get(code, CATALOGUE["PROVIDER_ENROLLMENT_FAILED"])
    error = ProviderError(
        id=new_id("prv_"),
        tenant_id=rail.tenant_id,
        code=code,
        title=title,
        detail=(detail or remediation)[:500],
        provider=rail.provider,
        operation=operation,
        rail=rail.rail,
        provider_code=provider_code,
        provider_correlation_id=correlation_id,
        payment_method_id=getattr(rail, "payment_method_id", None),
        allowance_id=allowance_id or getattr(rail, "allowance_id", None),
        payment_credential_id=payment_credential_id,
        occurred_at=utcnow(),
    )
    session.add(error)
    return error


def rail_event_data(pm: PaymentMethod, rail: PaymentMethodRail) -> dict:
    """The data of ``agentic.payment-method.rail.retried``: ``{payment_method: {id, status},
    rail: {rail, provider, status, provider_ids, error?}}`` (ids and states only)."""
    return {"payment_method": {"id": pm.id, "status": pm.status}, "rail": rail_view(rail)}


def settle_rail(
    session: Session,
    pm: PaymentMethod,
    rail: PaymentMethodRail,
    *,
    status: RailStatus,
    error_code: str | None = None,
    provider_ids: dict | None = None,
    trace_id: str | None = None,
) -> bool:
    """Set a rail's visible state; True when it changed (then the payment method's updated_at
    moves). A rail that was shown ``pending`` emits its event when it leaves pending."""
    before = rail_view(rail)
    rail.status = status
    rail.error_code = error_code if status == RailStatus.ERROR else None
    if provider_ids is not None:
        rail.provider_ids = dict(provider_ids)
    changed = rail_view(rail) != before
    now = utcnow()
    if changed:
        rail.updated_at = now
        pm.updated_at = now
    if status != RailStatus.PENDING and rail.notify:
        rail.notify = False
        events.emit(session, tenant_id=pm.tenant_id, type=RAIL_EVENT, data=rail_event_data(pm, rail), trace_id=trace_id)
    session.add(rail)
    session.add(pm)
    return changed


def release_if_done(session: Session, pm_id: str, operation_id: str | None, *, finished_job: uuid.UUID) -> None:
    """Release operation ``operation_id``'s lease when none of its enrollment jobs but
    ``finished_job`` is still running (called with the payment method locked): one ``DELETE ...
    WHERE NOT EXISTS`` of such a job."""
    if operation_id is None:
        return
    busy = (
        select(PaymentMethodRail.id)
        .join(Job, col(Job.id) == PaymentMethodRail.job_id)
        .where(
            PaymentMethodRail.payment_method_id == pm_id,
            PaymentMethodRail.operation_id == operation_id,
            Job.kind == ENROLL_TASK,
            Job.id != finished_job,
            col(Job.status).not_in(jobs.TERMINAL),
        )
        .exists()
    )
    leases.release(session, pm_id, operation_id, unless=busy)


def job_statuses(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    """The status of each job."""
    if not job_ids:
        return {}
    rows = session.exec(select(Job.id, Job.status).where(col(Job.id).in_(job_ids))).all()
    return dict(rows)


# ---- create --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateRequest:
    """A validated create body: the source's token id, the normalised consumer (``id`` may be None:
    generated), the source as supplied and the optional agent id."""

    token_id: str
    consumer: dict
    source: dict
    agent_id: str | None = None


@dataclass(frozen=True)
class Started:
    """What a create, retry or delete recorded: the payment method and the jobs to wait for."""

    payment_method_id: str
    job_ids: tuple[uuid.UUID, ...]
    failure: str | None = None


class OutcomeUnknown(Exception):
    """The commit of a create raised: it may or may not have been applied."""


def card_source(session: Session, tenant_id: uuid.UUID, token_id: str, *, today: dt.date | None = None) -> dict:
    """The data of the card token ``token_id`` of the tenant, else 400 ``INVALID_TOKEN``.

    "A card token readable in the tenant": a live (unexpired) token of the tenant whose type is
    ``card`` and whose data holds a number and an expiration not in the past. The caller needs no
    token read permission: the create permission lets the platform read the card internally, for
    the providers only (public applications, which hold create permissions alone, may create).
    """
    try:
        token, data = load_token_data(session, tenant_id, token_id)
    except Problem:
        token, data = None, None
    return checked_card(token.type if token is not None else None, data, today=today)


def checked_card(kind: str | None, data: Any, *, today: dt.date | None = None) -> dict:
    """``data`` when it is a card token's readable card data (the rules of :func:`card_source`;
    ``kind`` is the token's type, None when no live token of the tenant has the id), else 400
    ``INVALID_TOKEN``."""
    if kind is None:
        raise agentic_error("INVALID_TOKEN", "No card token with this id exists in the tenant.")
    if kind != "card" or not isinstance(data, dict) or not isinstance(data.get("number"), str):
        raise agentic_error("INVALID_TOKEN", "The token is not a card token.")
    month, year = data.get("expiration_month"), data.get("expiration_year")
    if not isinstance(month, int) or not isinstance(year, int):
        raise agentic_error("INVALID_TOKEN", "The card token has no expiration date; providers need one.")
    today = today or utcnow().date()
    if (year, month) < (today.year, today.month):
        raise agentic_error("INVALID_TOKEN", "The card has expired.")
    return data


def _initial_card(number: str, brand: str | None, data: dict) -> dict:
    """What the platform knows of the card before any provider answers (never the number)."""
    return {
        "type": "card",
        "brand": brand,
        "last4": number[-4:],
        "expiration_month": data.get("expiration_month"),
        "expiration_year": data.get("expiration_year"),
        "display": dict.fromkeys(DISPLAY_FIELDS),
    }


def create_payment_method(
    session: Session,
    caller: Caller,
    request: CreateRequest,
    *,
    settings: Settings,
    owner: str,
    claim: idempotency.Claim | None = None,
) -> Started:
    """``POST /agentic/payment-methods``, the recording part (one transaction).

    Raises 400 ``INVALID_TOKEN`` (see :func:`card_source`), 404 ``AGENT_NOT_FOUND``, 400
    ``UNSUPPORTED_PROVIDER`` (no provider takes the card's network). Writes the payment method, its
    rails, one enrollment job per rail (sent after commit) and the ``enroll`` lease owned by
    ``owner``. A provider a production tenant has no live URL for records its rail in error
    ``PROVIDER_NOT_CONFIGURED`` at once (with a provider error), without a job.
    """
    data = card_source(session, caller.tenant_id, request.token_id)
    if request.agent_id is not None:
        agent = session.get(Agent, request.agent_id)
        if agent is None or agent.tenant_id != caller.tenant_id:
            raise agentic_error("AGENT_NOT_FOUND")
    brand = card_brand(data["number"])
    pairs = rails_for_brand(brand)
    if not pairs:
        raise agentic_error("UNSUPPORTED_PROVIDER", f"No supported provider takes {brand or 'this'} cards.")
    now = utcnow()
    consumer = {**request.consumer, "id": request.consumer.get("id") or str(uuid.uuid4())}
    pm = PaymentMethod(
        id=new_id("pm_"),
        tenant_id=caller.tenant_id,
        source=dict(request.source),
        token_id=request.token_id,
        consumer=consumer,
        consumer_id=consumer["id"],
        card=_initial_card(data["number"], brand, data),
        agent_id=request.agent_id,
        idempotency_key=claim.key if claim else None,
        created_by=caller.application_id,
        created_at=now,
        updated_at=now,
    )
    rows = Rows()  # every row in one statement (``storage.db.insert_rows``), no unit-of-work flush
    rows.add(table_of(PaymentMethod), row_of(pm))
    job_ids, errors = [], []
    for position, (rail_name, provider) in enumerate(pairs):
        rail = PaymentMethodRail(
            tenant_id=caller.tenant_id,
            payment_method_id=pm.id,
            position=position,
            rail=rail_name,
            provider=provider,
            created_at=now,
            updated_at=now,
        )
        if provider_for(provider, caller.tenant_type, settings) is None:
            rail.status, rail.error_code = RailStatus.ERROR, "PROVIDER_NOT_CONFIGURED"
            errors.append(rail)
        else:
            rail.job_id = jobs.record(
                session,
                rows=rows,
                kind=ENROLL_TASK,
                tenant_id=caller.tenant_id,
                subject_type="rail",
                subject_id=str(rail.id),
                trace_id=caller.trace_id,
                max_attempts=ENROLL_MAX_ATTEMPTS,
            ).id
            rail.operation_id, rail.attempt = owner, "create"
            job_ids.append(rail.job_id)
        rows.add(table_of(PaymentMethodRail), row_of(rail))
    if job_ids:  # a new payment method: nobody else can hold its lease yet
        rows.add(
            table_of(OperationLease),
            row_of(
                OperationLease(
                    resource_id=pm.id,
                    tenant_id=caller.tenant_id,
                    operation=leases.ENROLL,
                    owner=owner,
                    acquired_at=now,
                    expires_at=now + dt.timedelta(seconds=settings.operation_lease_seconds),
                )
            ),
        )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=pm.id, operation="create")
    insert_rows(session, rows)
    for rail in errors:
        record_provider_error(session, rail, code="PROVIDER_NOT_CONFIGURED")
    if claim is not None:
        idempotency.attach(session, claim, pm.id)
    return Started(pm.id, tuple(job_ids))


def commit(session: Session) -> None:
    """Commit a create's transaction (a seam: the tests make it lose its answer)."""
    session.commit()


def commit_unit(fn, /, *args, **kwargs):
    """Run ``fn(session, *args, **kwargs)`` in its own transaction, telling apart a failure before
    the commit (re-raised: nothing was written) from a failing commit (:class:`OutcomeUnknown`)."""
    session = Session(get_engine(), expire_on_commit=False)
    try:
        try:
            result = fn(session, *args, **kwargs)
            session.flush()
        except BaseException:
            session.rollback()
            raise
        try:
            commit(session)
        except Exception as exc:
            raise OutcomeUnknown(str(exc)) from exc
        return result
    finally:
        session.close()


def create_unit(
    caller: Caller, request: CreateRequest, *, settings: Settings, owner: str, claim: idempotency.Claim | None
) -> Started:
    """Run :func:`create_payment_method` in its own transaction (:func:`commit_unit`)."""
    return commit_unit(create_payment_method, caller, request, settings=settings, owner=owner, claim=claim)


def finish_create(session: Session, caller: Caller, pm_id: str, *, claim: idempotency.Claim | None) -> dict:
    """After the bounded wait: flag rails still pending for their event, settle the idempotency
    record, answer the payment method."""
    pm = lock(session, pm_id)
    if pm is None:  # cannot happen short of a manual delete
        raise agentic_error("INTERNAL_ERROR")
    rails = rails_of(session, pm_id)
    for rail in rails:
        if rail.status == RailStatus.PENDING and not rail.notify:
            rail.notify = True
            session.add(rail)
    if claim is not None:
        idempotency.succeed(session, claim)
    return payment_method_view(pm, rails)


def replay(session: Session, caller: Caller, pm_id: str) -> dict:
    """The payment method an earlier request with the same key created (its current state)."""
    return view_of(session, find(session, caller.tenant_id, pm_id))


# ---- read, list, errors --------------------------------------------------------------------------


def read_payment_method(session: Session, caller: Caller, pm_id: str) -> dict:
    """``GET /agentic/payment-methods/{id}``: 404 ``PAYMENT_METHOD_NOT_FOUND`` when absent in the tenant."""
    pm = find(session, caller.tenant_id, pm_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=pm.id, operation="read")
    return view_of(session, pm)


def list_payment_methods(
    session: Session, caller: Caller, *, size: int, after: dict | None, consumer_id: str | None, status: str
) -> tuple[list[dict], dict | None]:
    """``GET /agentic/payment-methods``: newest first (created_at, id), filtered by ``consumer_id``
    and ``status`` (active, deleted, all); one page and the next keyset position (or None)."""
    query = select(PaymentMethod).where(PaymentMethod.tenant_id == caller.tenant_id)
    if status != "all":
        query = query.where(PaymentMethod.status == status)
    if consumer_id is not None:
        query = query.where(PaymentMethod.consumer_id == consumer_id)
    rows, next_position = keyset_page(
        session, query, order=(PaymentMethod.created_at, PaymentMethod.id), size=size, after=after
    )
    rails: dict[str, list[PaymentMethodRail]] = {}
    if rows:
        for rail in session.exec(
            select(PaymentMethodRail).where(col(PaymentMethodRail.payment_method_id).in_([pm.id for pm in rows]))
        ):
            rails.setdefault(rail.payment_method_id, []).append(rail)
    return [payment_method_view(pm, rails.get(pm.id, [])) for pm in rows], next_position


def list_provider_errors(
    session: Session, caller: Caller, pm_id: str, *, size: int, after: dict | None
) -> tuple[list[dict], dict | None]:
    """``GET /agentic/payment-methods/{id}/errors``: the payment method's provider errors, newest
    first (occurred_at, id); 404 ``PAYMENT_METHOD_NOT_FOUND`` when absent."""
    pm = find(session, caller.tenant_id, pm_id)
    return provider_error_page(
        session, caller.tenant_id, ProviderError.payment_method_id == pm.id, size=size, after=after
    )


def provider_error_page(
    session: Session, tenant_id: uuid.UUID, where: Any, *, size: int, after: dict | None
) -> tuple[list[dict], dict | None]:
    """One page of the tenant's provider errors matching ``where`` (a column condition: a payment
    method's, an allowance's), newest first (occurred_at, id), and the next keyset position."""
    query = select(ProviderError).where(ProviderError.tenant_id == tenant_id, where)
    rows, next_position = keyset_page(
        session, query, order=(ProviderError.occurred_at, ProviderError.id), size=size, after=after
    )
    return [provider_error_view(e) for e in rows], next_position


def purge_provider_errors(
    session: Session, *, retention_days: int, now: dt.datetime | None = None, batch: int = 1000
) -> int:
    """Delete up to ``batch`` provider errors older than ``retention_days``; returns how many."""
    cutoff = (now or utcnow()) - dt.timedelta(days=retention_days)
    ids = session.exec(
        select(ProviderError.id)
        .where(ProviderError.occurred_at < cutoff)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    if ids:
        session.execute(
            delete(ProviderError).where(col(ProviderError.id).in_(ids)).execution_options(synchronize_session=False)
        )
    return len(ids)


# ---- retry ---------------------------------------------------------------------------------------


def _blocked(session: Session, pm: PaymentMethod) -> Problem | None:
    """The 409 an in-flight or stopped operation on ``pm`` answers, or None."""
    lease = leases.held(session, pm.id)
    if lease is not None:
        return leases.in_progress(lease)
    if pm.delete_requested_at is not None:
        return agentic_error("PAYMENT_METHOD_DELETE_INCOMPLETE")
    return None


def start_retry(
    session: Session, caller: Caller, pm_id: str, *, rail: str, provider: str, settings: Settings, owner: str
) -> Started:
    """``POST .../rails/retry``, the recording part: checks, then one enrollment job (``retry``).

    The pair is already known valid. Raises, in this order, 404 ``PAYMENT_METHOD_NOT_FOUND``, 400
    ``PAYMENT_METHOD_DELETED``, 400 ``RAIL_NOT_FOUND``, 409 ``PAYMENT_METHOD_OPERATION_IN_PROGRESS``
    / ``..._DELETE_IN_PROGRESS`` / ``..._DELETE_INCOMPLETE``, 400 ``VALIDATION_ERROR`` (the rail is
    enabled), 400 ``INVALID_TOKEN`` (the card token is gone). A provider without
    configuration returns ``Started(failure="PROVIDER_NOT_CONFIGURED")`` after recording its error.
    """
    pm = find(session, caller.tenant_id, pm_id, lock=True)
    if pm.status == PaymentMethodStatus.DELETED:
        raise agentic_error("PAYMENT_METHOD_DELETED")
    target = next((r for r in rails_of(session, pm.id) if r.rail == rail and r.provider == provider), None)
    if target is None:
        raise agentic_error("RAIL_NOT_FOUND", f"The payment method has no {rail} rail with {provider}.")
    blocked = _blocked(session, pm)
    if blocked is not None:
        raise blocked
    if target.status == RailStatus.ENABLED:
        raise validation_error({"rail": ["The rail is enabled; only a rail in error or pending can be retried."]})
    if provider_for(provider, caller.tenant_type, settings) is None:
        record_provider_error(session, target, code="PROVIDER_NOT_CONFIGURED")
        settle_rail(
            session, pm, target, status=RailStatus.ERROR, error_code="PROVIDER_NOT_CONFIGURED", trace_id=caller.trace_id
        )
        return Started(pm.id, (), failure="PROVIDER_NOT_CONFIGURED")
    card_source(session, caller.tenant_id, pm.token_id)
    job = jobs.record(
        session,
        kind=ENROLL_TASK,
        tenant_id=caller.tenant_id,
        subject_type="rail",
        subject_id=str(target.id),
        trace_id=caller.trace_id,
        max_attempts=ENROLL_MAX_ATTEMPTS,
    )
    target.job_id, target.operation_id, target.attempt = job.id, owner, "retry"
    session.add(target)
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=pm.id,
        operation=leases.ENROLL,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=pm.id, operation="update")
    return Started(pm.id, (job.id,))


def retry_failure(session: Session, pm_id: str, rail: str, provider: str, code: str) -> Problem:
    """The problem a rejected retry answers: the rail's catalogue code (422, or 409 for
    RAIL_ALREADY_ENROLLED), with ``debug.provider_correlation`` when the provider sent one."""
    latest = session.exec(
        select(ProviderError)
        .where(ProviderError.payment_method_id == pm_id, ProviderError.rail == rail, ProviderError.provider == provider)
        .order_by(col(ProviderError.occurred_at).desc())
        .limit(1)
    ).first()
    extra = None
    if latest is not None and latest.code == code and latest.provider_correlation_id:
        extra = {"debug": {"provider_correlation": latest.provider_correlation_id}}
    return agentic_error(code if code in CATALOGUE else "PROVIDER_ENROLLMENT_FAILED", extra=extra)


def finish_retry(
    session: Session, caller: Caller, pm_id: str, *, rail: str, provider: str, job_id: uuid.UUID
) -> dict | Problem:
    """After the bounded wait: the payment method (200), or the problem of a rejected retry.

    A retry still running is shown ``pending`` (and flagged: its outcome is delivered as the
    event); an overtaken job shows the rail as it is.
    """
    pm = lock(session, pm_id)
    rails = rails_of(session, pm_id)
    target = next(r for r in rails if r.rail == rail and r.provider == provider)
    job = session.get(Job, job_id, populate_existing=True)
    if target.job_id == job_id and job is not None and job.status not in jobs.TERMINAL:
        settle_rail(session, pm, target, status=RailStatus.PENDING, provider_ids=target.provider_ids)
        target.notify = True
        session.add(target)
    elif job is not None and job.status in JOB_FAILED and target.status == RailStatus.ERROR:
        return retry_failure(session, pm_id, rail, provider, target.error_code or "PROVIDER_ENROLLMENT_FAILED")
    return payment_method_view(pm, rails)


# ---- delete --------------------------------------------------------------------------------------


def start_delete(session: Session, caller: Caller, pm_id: str, *, settings: Settings, owner: str) -> Started:
    """``DELETE /agentic/payment-methods/{id}``, the recording part.

    Already deleted: nothing to do (no provider call, updated_at unchanged). An operation in
    flight: 409 ``PAYMENT_METHOD_OPERATION_IN_PROGRESS`` (or ``..._DELETE_IN_PROGRESS``). Otherwise
    the cascade starts (or resumes, after one stopped half-way): with provider enrollments to
    remove, a delete job under a ``delete`` lease; without, the payment method is deleted at once.
    """
    pm = find(session, caller.tenant_id, pm_id, lock=True)
    if pm.status == PaymentMethodStatus.DELETED:
        return Started(pm.id, ())
    lease = leases.held(session, pm.id)
    if lease is not None:
        raise leases.in_progress(lease)
    if _allowance_busy(session, pm.id):
        raise agentic_error(
            "PAYMENT_METHOD_OPERATION_IN_PROGRESS", "An operation on an allowance of this payment method is in flight."
        )
    now = utcnow()
    pm.delete_requested_at = pm.delete_requested_at or now
    session.add(pm)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=pm.id, operation="delete")
    if not any(
        r.enrollment_id and r.enrollment_removed_at is None for r in rails_of(session, pm.id)
    ) and not _allowances_to_cancel(session, pm.id):
        mark_deleted(session, pm)
        return Started(pm.id, ())
    leases.acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=pm.id,
        operation=leases.DELETE,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    job = jobs.record(
        session,
        kind=DELETE_TASK,
        tenant_id=caller.tenant_id,
        subject_type="payment_method",
        subject_id=pm.id,
        operation_id=owner,
        trace_id=caller.trace_id,
        max_attempts=DELETE_MAX_ATTEMPTS,
    )
    return Started(pm.id, (job.id,))


def _allowance_busy(session: Session, pm_id: str) -> bool:
    """True when a live operation lease holds one of the payment method's allowances."""
    return (
        session.exec(
            select(func.count())
            .select_from(OperationLease)
            .join(Allowance, col(Allowance.id) == OperationLease.resource_id)
            .where(Allowance.payment_method_id == pm_id, OperationLease.expires_at > utcnow())
        ).one()
        > 0
    )


def _allowances_to_cancel(session: Session, pm_id: str) -> bool:
    """True when the payment method backs a live allowance (the cascade cancels it)."""
    return (
        session.exec(
            select(func.count())
            .select_from(Allowance)
            .where(col(Allowance.payment_method_id) == pm_id, col(Allowance.status).in_(ALLOWANCE_LIVE))
        ).one()
        > 0
    )


def mark_deleted(session: Session, pm: PaymentMethod) -> None:
    """The cascade is complete: the payment method is deleted (updated_at moves once, now)."""
    now = utcnow()
    pm.status = PaymentMethodStatus.DELETED
    pm.deleted_at = now
    pm.updated_at = now
    session.add(pm)


def finish_delete(session: Session, caller: Caller, pm_id: str, job_ids: tuple[uuid.UUID, ...]) -> None:
    """After the bounded wait: None (204) when deleted; else 500 ``PROVIDER_ALLOWANCE_CANCEL_FAILED``
    when the cascade stopped, or 409 ``PAYMENT_METHOD_DELETE_IN_PROGRESS`` while it runs."""
    pm = find(session, caller.tenant_id, pm_id)
    if pm.status == PaymentMethodStatus.DELETED:
        return None
    statuses = job_statuses(session, list(job_ids))
    if any(status in JOB_UNSUCCESSFUL for status in statuses.values()):
        raise agentic_error(
            "PROVIDER_ALLOWANCE_CANCEL_FAILED",
            "The delete stopped during its cascade; repeat the same DELETE to resume it.",
        )
    raise agentic_error("PAYMENT_METHOD_DELETE_IN_PROGRESS")
