"""Agentic payment methods, the verbs of the API: create, read, list, the provider errors, retry a
rail, delete (spec 001 sections 2-4).

The handler side of the spine (``ARCHITECTURE.md``): each function here runs in one transaction of
the API (``fn(session, ...)``), records the jobs the workers run (``domain/agentic/enrollment.py``,
``tasks/agentic.py``) and never calls a provider itself.

A create writes the payment method, one rail per pair and one enrollment job per rail in one
transaction (:mod:`domain.agentic.units`), with an ``enroll`` operation lease that the last of those
jobs releases; the handler then waits for the jobs (``infra/wait.py``) up to
``agentic_wait_seconds`` and answers (:func:`finish_create`): rails whose job is still running are
shown ``pending`` and flagged so that their outcome is delivered as the event
``agentic.payment-method.rail.retried``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Select, Update, bindparam, delete, update
from sqlalchemy import select as select_rows
from sqlmodel import Session, col, func, select

from config.settings import Settings
from domain.agentic import idempotency, leases
from domain.agentic.errors import CATALOGUE, agentic_error, validation_error
from domain.agentic.payment_methods import (
    DELETE_MAX_ATTEMPTS,
    DELETE_TASK,
    ENROLL_MAX_ATTEMPTS,
    ENROLL_TASK,
    ENTITY_TYPE,
    MOST_RAILS,
    RailAnswer,
    card_source,
    checked_card,
    find,
    job_statuses,
    lock_existing,
    mark_deleted,
    new_id,
    open_answer,
    rails_for_brand,
    rails_of,
    record_provider_error,
    settle_rail,
)
from domain.agentic.units import commit_unit
from domain.agentic.views import payment_method_view, provider_error_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tenancy.usage import stage_token_activity
from domain.tokens.cards import card_brand
from domain.tokens.store import live_token_join, open_token_data
from infra import jobs
from infra.errors import Problem
from infra.wait import Outcome
from providers.agentic import DISPLAY_FIELDS, PROVIDERS
from providers.agentic_http import provider_for
from storage.crypto import DecryptionError, KeyNotCached
from storage.db import (
    Rows,
    hold_gates,
    insert_rows,
    insert_rows_last,
    model_row,
    read_all,
    read_first,
    read_one_snapshot,
    read_then_write,
    server_prepared,
    stage_inserts,
    stage_write,
    with_gates,
)
from storage.keyset import keyset_page
from storage.models import Job
from storage.models_agentic import Agent, OperationLease, PaymentMethod, PaymentMethodRail, ProviderError
from storage.models_allowances import Allowance
from storage.states import ALLOWANCE_LIVE, JOB_FAILED, JOB_UNSUCCESSFUL, JobStatus, PaymentMethodStatus, RailStatus
from storage.types import random_uuid, table_of, utcnow

log = logging.getLogger("tessera.agentic")

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
class Known:
    """What a request knows of its payment method before the rails' outcomes: the payment method's
    row (``pm``: at least the :class:`PaymentMethodRow` fields) and each rail's (``rails``, in their
    order: the :class:`RailRow` fields and ``job_id``, the job this request waits for, if any). The
    rails' outcome messages complete it (:func:`_answered`)."""

    pm: Mapping[str, Any]
    rails: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class Started:
    """What a create, retry or delete recorded: the payment method and the jobs to wait for;
    ``known``, what the request knows of the payment method (None: it reads it at the end)."""

    payment_method_id: str
    job_ids: tuple[uuid.UUID, ...]
    failure: str | None = None
    known: Known | None = None


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
    """``POST /agentic/payment-methods``, the recording part (one transaction). The rails' job ids are
    drawn first, one per rail a card can have (:data:`MOST_RAILS`). When nothing else is read or
    written (no agent, no idempotency key, a provider configured for every rail a card can have),
    the create is two round trips (``storage.db.read_then_write``): the card token's read with
    ``BEGIN`` and the locks of the jobs' gates, then, after the jobs' one message (the worker's lease
    waits at the gate), the one insert of every row with ``COMMIT``. Otherwise the token is read
    outside the transaction (:func:`card_source`) and the rows are one insert
    (``storage.db.insert_rows``; as the whole transaction when it is the only write,
    ``storage.db.insert_rows_last``).

    Raises 400 ``INVALID_TOKEN`` (see :func:`card_source`), 404 ``AGENT_NOT_FOUND``, 400
    ``UNSUPPORTED_PROVIDER`` (no provider takes the card's network). Writes the payment method, its
    rails, one enrollment job per rail (sent after commit) and the ``enroll`` lease owned by
    ``owner``. A provider a production tenant has no live URL for records its rail in error
    ``PROVIDER_NOT_CONFIGURED`` at once (with a provider error), without a job.
    """
    rows = Rows()  # every row in one statement (``storage.db.insert_rows``), no unit-of-work flush
    drawn = [random_uuid() for _ in range(MOST_RAILS)]  # a gate held for a rail the card lacks is harmless
    plain = (
        request.agent_id is None
        and claim is None
        and all(provider_for(name, caller.tenant_type, settings) is not None for name in PROVIDERS)
    )
    with read_then_write(session, drawn) if plain else contextlib.nullcontext() as unit:
        read = unit.read_first if unit is not None else read_first
        data = card_source(session, caller.tenant_id, request.token_id, rows=rows, read=read)
        started, errors = _record_create(
            session, caller, request, data, drawn, rows, settings=settings, owner=owner, claim=claim
        )
        if unit is not None:  # no error rail: every provider is configured
            stage_inserts(session, rows)  # written by the unit, after the jobs' message
    if unit is not None:
        return started
    if errors or claim is not None:  # more writes follow, and a keyed create's commit stands apart
        insert_rows(session, rows)
    else:  # the unit's only write: one durable statement, nothing having been read in the session
        insert_rows_last(session, rows)
    for unconfigured in errors:
        record_provider_error(session, unconfigured, code="PROVIDER_NOT_CONFIGURED")
    if claim is not None:
        idempotency.attach(session, claim, started.payment_method_id)
    return started


def _record_create(
    session: Session,
    caller: Caller,
    request: CreateRequest,
    data: dict,
    drawn: list[uuid.UUID],
    rows: Rows,
    *,
    settings: Settings,
    owner: str,
    claim: idempotency.Claim | None = None,
) -> tuple[Started, list[PaymentMethodRail]]:
    """:func:`create_payment_method` once the card is read (``data``): the checks, then every row
    queued in ``rows``, each rail with a job taking its id from ``drawn``, their message queued
    (behind the jobs' gates). Returns what was recorded and the rails in error (no provider
    configured: their provider errors are still to be written)."""
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
    # rows, not ORM objects: the one recording statement takes rows (``model_row``)
    pm_id = new_id("pm_")
    pm = model_row(
        PaymentMethod,
        id=pm_id,
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
    rows.add(table_of(PaymentMethod), pm)
    job_ids: list[uuid.UUID] = []
    errors: list[PaymentMethodRail] = []
    rail_rows: list[dict[str, Any]] = []
    subjects: list[tuple[uuid.UUID, str]] = []
    for position, (rail_name, provider) in enumerate(pairs):
        rail = model_row(
            PaymentMethodRail,
            tenant_id=caller.tenant_id,
            payment_method_id=pm_id,
            position=position,
            rail=rail_name,
            provider=provider,
            created_at=now,
            updated_at=now,
        )
        if provider_for(provider, caller.tenant_type, settings) is None:
            rail.update(status=RailStatus.ERROR, error_code="PROVIDER_NOT_CONFIGURED")
            errors.append(PaymentMethodRail(**rail))
        else:
            job_id = drawn[len(subjects)]
            subjects.append((job_id, str(rail["id"])))
            rail.update(job_id=job_id, operation_id=owner, attempt="create")
        rail_rows.append(rail)
    if subjects:
        job_ids = jobs.record(
            session,
            rows=rows,
            kind=ENROLL_TASK,
            tenant_id=caller.tenant_id,
            subject_type="rail",
            subjects=subjects,
            trace_id=caller.trace_id,
            max_attempts=ENROLL_MAX_ATTEMPTS,
            now=now,
            together=True,  # the rails' jobs in one message, run side by side by one task run
            gated=True,  # the message goes before the commit: the request waits for the outcome
        )
    for rail in rail_rows:  # after their jobs' rows, which they name
        rows.add(table_of(PaymentMethodRail), rail)
    if job_ids:  # a new payment method: nobody else can hold its lease yet
        rows.add(
            table_of(OperationLease),
            model_row(
                OperationLease,
                resource_id=pm_id,
                tenant_id=caller.tenant_id,
                operation=leases.ENROLL,
                owner=owner,
                acquired_at=now,
                expires_at=now + dt.timedelta(seconds=settings.operation_lease_seconds),
            ),
        )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=pm_id, operation="create")
    return Started(pm_id, tuple(job_ids), known=Known(pm, tuple(rail_rows))), errors


def create_unit(
    caller: Caller, request: CreateRequest, *, settings: Settings, owner: str, claim: idempotency.Claim | None
) -> Started:
    """Run :func:`create_payment_method` in its own transaction (:func:`commit_unit`)."""
    return commit_unit(create_payment_method, caller, request, settings=settings, owner=owner, claim=claim)


def finish_create(
    session: Session,
    caller: Caller,
    pm_id: str,
    *,
    claim: idempotency.Claim | None,
    outcomes: Mapping[uuid.UUID, Outcome] | None = None,
    known: Known | None = None,
) -> dict:
    """After the bounded wait: flag rails still pending for their event, settle the idempotency
    record, answer the payment method.

    ``outcomes``: the outcome of each rail's job as the wait ended (``infra.wait``). When every one
    settled its rail for good (enabled, or in error: no rail left pending or overtaken) and no
    idempotency record waits, nothing is left to flag or settle: the payment method is answered from
    what the create recorded (``known``) and what the rails' outcome messages carried, when every
    rail was enabled by its one outcome statement (:func:`_answered`: no statement runs), else read
    in one round trip outside any transaction (:func:`settled_view`), no lock, no commit.
    """
    if claim is None and outcomes and all(_final(outcome) for outcome in outcomes.values()):
        view = _settled_answer(session, caller.tenant_id, pm_id, known, outcomes)
        if view is not None:
            return view
    pm = lock_existing(session, pm_id)
    rails = rails_of(session, pm_id)
    for rail in rails:
        if rail.status == RailStatus.PENDING and not rail.notify:
            rail.notify = True
            session.add(rail)
    if claim is not None:
        idempotency.succeed(session, claim)
    return payment_method_view(pm, rails)


def _final(outcome: Outcome) -> bool:
    """True when an enrollment job's outcome left its rail for good: succeeded with the rail enabled,
    or failed (the rail in error); not a rail pending at its provider nor a job whose rail moved on."""
    if outcome.status in JOB_FAILED:
        return True
    return (
        outcome.status == JobStatus.SUCCEEDED
        and outcome.result.get("rail_status") is not None
        and outcome.result.get("rail_status") != "pending"
        and "stale" not in outcome.result
    )


def answered(
    caller: Caller,
    known: Known | None,
    outcomes: Mapping[uuid.UUID, Outcome] | None,
    *,
    claim: idempotency.Claim | None = None,
) -> dict | None:
    """The answer of a create (:func:`finish_create`) or a retry (:func:`finish_retry`, its one
    outcome) that needs no statement at all, or None: the payment method from ``known`` and the
    outcome messages alone (:func:`_answered`) when no idempotency record waits (``claim`` None)
    and every rail the request waited for was enabled by its outcome statement, the tenant's key
    being in the keyring's cache. The event loop calls it before the finish (saving the database
    pool's thread hop); None sends the request there."""
    if claim is not None or known is None or not outcomes or not all(_final(o) for o in outcomes.values()):
        return None
    return _answered(None, caller.tenant_id, known, outcomes)


def _settled_answer(
    session: Session,
    tenant_id: uuid.UUID,
    pm_id: str,
    known: Known | None,
    outcomes: Mapping[uuid.UUID, Outcome],
) -> dict | None:
    """The payment method object once every outcome settled its rail for good: from ``known`` and the
    outcome messages (:func:`_answered`), else read outside any transaction (:func:`settled_view`);
    None when the payment method is not there."""
    view = _answered(session, tenant_id, known, outcomes) if known is not None else None
    return view if view is not None else settled_view(tenant_id, pm_id)


def _answered(
    session: Session | None, tenant_id: uuid.UUID, known: Known, outcomes: Mapping[uuid.UUID, Outcome]
) -> dict | None:
    """The payment method object from what the request knew (``known``) and the enabled rails'
    outcome messages (``domain.agentic.enrollment.enrolled_answer``): each rail the request waited
    for is enabled with the provider ids its own statement wrote; the card and ``updated_at`` are
    those the operation's last statement wrote (the one that released its lease: it merged its card
    over the others'). The other rails are as ``known`` shows them: only an operation holding the
    lease changes a rail in error or enabled. None, and the caller reads the payment method, when an
    outcome carried no answer (it was written in a transaction), when no single one released the
    lease, when an answer does not open (malformed, or not this payment method's), or when another
    rail is ``pending`` (its provider's poll moves it without the lease). ``session`` None: the
    tenant's key from the keyring's cache only (None when it is not there)."""
    answers: dict[uuid.UUID, RailAnswer] = {}
    for job_id, outcome in outcomes.items():
        if outcome.answer is None or outcome.result.get("rail_status") != RailStatus.ENABLED:
            return None
        try:
            answers[job_id] = open_answer(session, tenant_id, outcome.answer)
        except KeyNotCached:  # asked on the loop: the finish reads the key
            return None
        except (LookupError, ValueError, TypeError, DecryptionError):
            if session is not None:  # on the loop, the finish that follows says it
                log.warning("the outcome of job %s carried an answer that does not open; reading the row", job_id)
            return None
    last = [answer for answer in answers.values() if answer.released]
    if len(last) != 1 or any(answer.payment_method_id != known.pm["id"] for answer in answers.values()):
        return None
    rails = []
    for rail in known.rails:
        waited = rail["job_id"]
        answer = answers.get(waited) if waited is not None else None
        if answer is None and (waited is not None or rail["status"] == RailStatus.PENDING):
            return None  # a rail whose job this request did not wait for, or one a poll may have moved since
        rails.append(
            RailRow(
                position=rail["position"],
                rail=rail["rail"],
                provider=rail["provider"],
                status=RailStatus.ENABLED if answer else rail["status"],
                error_code=None if answer else rail["error_code"],
                provider_ids=answer.provider_ids if answer else rail["provider_ids"],
            )
        )
    pm = PaymentMethodRow(
        **{name: known.pm[name] for name in _PM_FIELDS if name not in ("card", "updated_at")},
        card=last[0].card,
        updated_at=last[0].updated_at,
    )
    return payment_method_view(pm, rails)


_PM = table_of(PaymentMethod)
_RAILS = table_of(PaymentMethodRail)
#: A tenant's payment method with its rails in their order (built once, planned once per connection).
_SETTLED_VIEW = server_prepared(
    select_rows(
        *(column.label(f"pm_{column.name}") for column in _PM.columns),
        *(column.label(f"rail_{column.name}") for column in _RAILS.columns),
    )
    .select_from(_PM.outerjoin(_RAILS, _RAILS.c.payment_method_id == _PM.c.id))
    .where(
        _PM.c.id == bindparam("pm_id", type_=_PM.c.id.type),
        _PM.c.tenant_id == bindparam("tenant_id", type_=_PM.c.tenant_id.type),
    )
    .order_by(_RAILS.c.position)
)


def settled_view(tenant_id: uuid.UUID, pm_id: str) -> dict | None:
    """The tenant's payment method object (rails in their order) read in one statement outside any
    transaction (``storage.db.read_all``: no lock, nothing written), or None when it is not there."""
    rows = read_all(_SETTLED_VIEW, {"pm_id": pm_id, "tenant_id": tenant_id})
    if not rows:
        return None
    first = rows[0]._mapping
    pm = PaymentMethodRow(**{name: first[f"pm_{name}"] for name in _PM_FIELDS})
    rails = [
        RailRow(**{name: row._mapping[f"rail_{name}"] for name in _RAIL_FIELDS})
        for row in rows
        if row._mapping["rail_id"] is not None
    ]
    return payment_method_view(pm, rails)


@dataclass(frozen=True, slots=True)
class PaymentMethodRow:
    """The columns of a payment method its view shows, as :data:`_SETTLED_VIEW` read them (no ORM
    object: validating one per answer cost more than the read)."""

    id: str
    source: dict
    status: str
    consumer: dict
    card: dict | None
    agent_id: str | None
    created_at: dt.datetime
    updated_at: dt.datetime


@dataclass(frozen=True, slots=True)
class RailRow:
    """The columns of a rail its view shows, as :data:`_SETTLED_VIEW` read them."""

    position: int
    rail: str
    provider: str
    status: str
    error_code: str | None
    provider_ids: dict | None


_PM_FIELDS = tuple(field.name for field in fields(PaymentMethodRow))
_RAIL_FIELDS = tuple(field.name for field in fields(RailRow))


def view_of(session: Session, pm: PaymentMethod) -> dict:
    """The payment method object of a loaded row."""
    return payment_method_view(pm, rails_of(session, pm.id))


def replay(session: Session, caller: Caller, pm_id: str) -> dict:
    """The payment method an earlier request with the same key created (its current state)."""
    return view_of(session, find(session, caller.tenant_id, pm_id))


# ---- read, list, errors --------------------------------------------------------------------------


def read_payment_method(session: Session, caller: Caller, pm_id: str) -> dict:
    """``GET /agentic/payment-methods/{id}``: 404 ``PAYMENT_METHOD_NOT_FOUND`` when absent in the tenant.
    The payment method and its rails are read from one snapshot (:func:`storage.db.read_one_snapshot`)."""
    read_one_snapshot(session)
    pm = find(session, caller.tenant_id, pm_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=pm.id, operation="read")
    return view_of(session, pm)


def list_payment_methods(
    session: Session, caller: Caller, *, size: int, after: dict | None, consumer_id: str | None, status: str
) -> tuple[list[dict], dict | None]:
    """``GET /agentic/payment-methods``: newest first (created_at, id), filtered by ``consumer_id``
    and ``status`` (active, deleted, all); one page and the next keyset position (or None), the
    payment methods and their rails read from one snapshot (:func:`storage.db.read_one_snapshot`)."""
    read_one_snapshot(session)
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


@functools.cache
def _retry_read() -> Select:
    """The one read of a retry (:func:`start_retry`), built once, planned once per connection: one
    row per rail of the tenant's payment method ``pm_id`` (in their order), the payment method locked
    ``FOR UPDATE``: its columns as :data:`_SETTLED_VIEW` names them (``pm_...``), its delete request
    and card token's id, each rail's (``rail_...``, with its id and job), the operation of its live
    lease (expiring after ``now``), the card token's stored values when it is live at ``now``
    (:func:`domain.tokens.store.live_token_join`). No row when the tenant has no such payment method."""
    pm, rails, held = _PM.c, _RAILS.c, table_of(OperationLease).c
    now = bindparam("now", type_=held.expires_at.type)
    lease = select_rows(held.operation).where(held.resource_id == pm.id, held.expires_at > now).scalar_subquery()
    token = live_token_join(pm.tenant_id, pm.token_id, now)
    return server_prepared(
        select_rows(
            *(getattr(pm, name).label(f"pm_{name}") for name in _PM_FIELDS),
            pm.delete_requested_at,
            pm.token_id,
            rails.id.label("rail_id"),
            *(getattr(rails, name).label(f"rail_{name}") for name in _RAIL_FIELDS),
            lease.label("lease_operation"),
            *(column.label(name) for name, column in token.columns.items()),
        )
        .select_from(_PM.outerjoin(_RAILS, rails.payment_method_id == pm.id).outerjoin(token.table, token.on))
        .where(
            pm.id == bindparam("pm_id", type_=pm.id.type),
            pm.tenant_id == bindparam("tenant_id", type_=pm.tenant_id.type),
        )
        .order_by(rails.position)
        .with_for_update(of=_PM)
    )


@functools.cache
def _retried_rail() -> Update:
    """The rail's change of a retry (:func:`start_retry`), built once: its job and operation, its
    attempt ``retry`` (bind parameters ``retried_rail_id``, ``retried_job_id``, ``retried_by``)."""
    return (
        update(_RAILS)
        .where(_RAILS.c.id == bindparam("retried_rail_id", type_=_RAILS.c.id.type))
        .values(
            job_id=bindparam("retried_job_id", type_=_RAILS.c.job_id.type),
            operation_id=bindparam("retried_by", type_=_RAILS.c.operation_id.type),
            attempt="retry",
        )
    )


def start_retry(
    session: Session, caller: Caller, pm_id: str, *, rail: str, provider: str, settings: Settings, owner: str
) -> Started:
    """``POST .../rails/retry``, the recording part: checks, then one enrollment job (``retry``).
    Two statements: one read (:func:`_retry_read`: the payment method locked, its rails, its lease,
    the card token), then, just before the commit, one write of the lease, the job, the token's
    activity, the log row and the rail's change (``storage.db.stage_write``). No ORM object. What it
    read is the ``known`` payment method of the answer (:func:`finish_retry`). The job's id is drawn
    first: the lock of its gate goes with the read, so its message goes out before the write, and
    the worker waits at the gate while the write and the commit run. When the provider is
    configured, two round trips (``storage.db.read_then_write``): the read with ``BEGIN`` and the
    gate's lock, then, after the message, the write with ``COMMIT``; otherwise the read goes through
    the session (``storage.db.with_gates``), as the provider error recorded then does.

    The pair is already known valid. Raises, in this order, 404 ``PAYMENT_METHOD_NOT_FOUND``, 400
    ``PAYMENT_METHOD_DELETED``, 400 ``RAIL_NOT_FOUND``, 409 ``PAYMENT_METHOD_OPERATION_IN_PROGRESS``
    / ``..._DELETE_IN_PROGRESS`` / ``..._DELETE_INCOMPLETE``, 400 ``VALIDATION_ERROR`` (the rail is
    enabled), 400 ``INVALID_TOKEN`` (the card token is gone). A provider without
    configuration returns ``Started(failure="PROVIDER_NOT_CONFIGURED")`` after recording its error.
    """
    now, job_id = utcnow(), random_uuid()
    params = {"pm_id": pm_id, "tenant_id": caller.tenant_id, "now": now}
    configured = provider_for(provider, caller.tenant_type, settings) is not None
    with read_then_write(session, [job_id]) if configured else contextlib.nullcontext() as unit:
        read: Sequence[Any]
        if unit is not None:
            read = unit.read_all(_retry_read(), params)
        else:
            hold_gates(session, [job_id])  # False (nothing held) off PostgreSQL: then sent after the commit
            read = session.execute(with_gates(session, _retry_read()), params).all()
        return _record_retry(
            session,
            caller,
            pm_id,
            read,
            job_id,
            now,
            rail=rail,
            provider=provider,
            configured=configured,
            settings=settings,
            owner=owner,
        )


def _record_retry(
    session: Session,
    caller: Caller,
    pm_id: str,
    read: Sequence[Any],
    job_id: uuid.UUID,
    now: dt.datetime,
    *,
    rail: str,
    provider: str,
    configured: bool,
    settings: Settings,
    owner: str,
) -> Started:
    """:func:`start_retry` once its read ran (``read``: its rows): the checks, then the writes,
    staged; ``configured``: whether the rail's provider is configured for the tenant."""
    if not read:
        raise agentic_error("PAYMENT_METHOD_NOT_FOUND")
    found = read[0]
    if found.pm_status == PaymentMethodStatus.DELETED:
        raise agentic_error("PAYMENT_METHOD_DELETED")
    target = next((row for row in read if row.rail_rail == rail and row.rail_provider == provider), None)
    if target is None:
        raise agentic_error("RAIL_NOT_FOUND", f"The payment method has no {rail} rail with {provider}.")
    if found.lease_operation is not None:
        raise leases.in_progress(found.lease_operation)
    if found.delete_requested_at is not None:
        raise agentic_error("PAYMENT_METHOD_DELETE_INCOMPLETE")
    if target.rail_status == RailStatus.ENABLED:
        raise validation_error({"rail": ["The rail is enabled; only a rail in error or pending can be retried."]})
    if not configured:  # read in the session: no unit
        return _not_configured(session, caller, pm_id, target.rail_id)
    rows = Rows()  # the job, the token's activity and the log row
    data = None
    if found.token_type is not None:  # a live token of the tenant: it counts as active this month
        data = open_token_data(
            session,
            caller.tenant_id,
            found.token_id,
            found.token_type,
            found.token_data_ct,
            found.token_cvc_expires_at,
            now=now,
        )
        stage_token_activity(rows, caller.tenant_id, [found.token_id], now=now)
    checked_card(found.token_type, data, today=now.date())
    leases.stage_acquire(
        session,
        tenant_id=caller.tenant_id,
        resource_id=pm_id,
        operation=leases.ENROLL,
        owner=owner,
        seconds=settings.operation_lease_seconds,
    )
    jobs.record(
        session,
        rows=rows,
        kind=ENROLL_TASK,
        tenant_id=caller.tenant_id,
        subject_type="rail",
        subjects=[(job_id, str(target.rail_id))],
        trace_id=caller.trace_id,
        max_attempts=ENROLL_MAX_ATTEMPTS,
        now=now,
        gated=True,  # the message goes before the commit: the request waits for the outcome
    )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=pm_id, operation="update")
    stage_inserts(session, rows)
    stage_write(  # last: its job is written beside it (foreign keys are checked when the statement ends)
        session, _retried_rail(), {"retried_rail_id": target.rail_id, "retried_job_id": job_id, "retried_by": owner}
    )
    known = Known(
        {name: found._mapping[f"pm_{name}"] for name in _PM_FIELDS},
        tuple(
            {
                **{name: row._mapping[f"rail_{name}"] for name in _RAIL_FIELDS},
                "job_id": job_id if row is target else None,
            }
            for row in read
        ),
    )
    return Started(pm_id, (job_id,), known=known)


def _not_configured(session: Session, caller: Caller, pm_id: str, rail_id: uuid.UUID) -> Started:
    """A retry whose provider has no configuration: its provider error recorded, the rail in error
    with ``PROVIDER_NOT_CONFIGURED`` (the payment method is locked already)."""
    pm = lock_existing(session, pm_id)
    target = next(r for r in rails_of(session, pm_id) if r.id == rail_id)
    record_provider_error(session, target, code="PROVIDER_NOT_CONFIGURED")
    settle_rail(
        session, pm, target, status=RailStatus.ERROR, error_code="PROVIDER_NOT_CONFIGURED", trace_id=caller.trace_id
    )
    return Started(pm.id, (), failure="PROVIDER_NOT_CONFIGURED")


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
    session: Session,
    caller: Caller,
    pm_id: str,
    *,
    rail: str,
    provider: str,
    job_id: uuid.UUID,
    outcome: Outcome | None = None,
    known: Known | None = None,
) -> dict | Problem:
    """After the bounded wait: the payment method (200), or the problem of a rejected retry.

    A retry still running is shown ``pending`` (and flagged: its outcome is delivered as the
    event); an overtaken job shows the rail as it is. ``outcome``: the job's outcome as the wait
    ended; a retry that enabled its rail for good is answered, with nothing to flag and no lock,
    from what :func:`start_retry` read (``known``) and what the outcome message carried
    (:func:`_answered`), else from one read outside any transaction (:func:`settled_view`).
    """
    if outcome is not None and outcome.status == JobStatus.SUCCEEDED and _final(outcome):
        view = _settled_answer(session, caller.tenant_id, pm_id, known, {job_id: outcome})
        if view is not None:
            return view
    pm = lock_existing(session, pm_id)
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
