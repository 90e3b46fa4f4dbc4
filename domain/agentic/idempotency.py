"""Idempotency keys of payment method and allowance creates and credential mints (spec 001 section 8).

``<prefix>-IDEMPOTENCY-KEY`` (1 to 255 characters) is optional; without it every request is a new
operation. With it, the key alone defines sameness (per tenant), and its record
(:class:`storage.models_agentic.IdempotencyRecord`) answers every later request:

=====================================  ==============================================================
situation                              answer
=====================================  ==============================================================
same key and body after success        the original payment method (its current state), 201
same key, different body               409 ``IDEMPOTENCY_CONFLICT`` (whatever the record's state)
same key while the first is running    409 ``IDEMPOTENCY_IN_PROGRESS``
conclusive failure                     the same code and status, replayed from the record
unknown outcome                        409 ``CREATE_OUTCOME_UNKNOWN`` on every replay (terminal)
=====================================  ==============================================================

Concurrency: :func:`claim` inserts the record in a transaction of its own; the primary key
``(tenant_id, scope, key)`` lets exactly one of two racing requests in (the other's insert fails,
after waiting for the first to commit on PostgreSQL), so one key never creates two payment methods.
The payment method is written with ``resource_id`` set on the record in one transaction.

A running record carries ``expires_at`` (the bounded wait plus a margin): a holder that died leaves
it running past that; the next request with the key settles it: ``succeeded`` when the payment
method was committed (``resource_id`` is set), else ``unknown``. Body hashes are SHA-256 of the
canonical JSON (keys sorted, no whitespace) of the body as sent. Records never expire.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, update
from sqlmodel import Session, col

from domain.agentic.errors import agentic_error
from infra.errors import Problem
from storage.models_agentic import IdempotencyRecord
from storage.sql import insert_if_absent
from storage.states import IdempotencyState
from storage.types import utcnow

CREATE_PAYMENT_METHOD = "payment-method.create"
CREATE_ALLOWANCE = "allowance.create"
MINT_CREDENTIAL = "credential.mint"
#: scope -> the code every replay of an unknown outcome answers (``CREATE_OUTCOME_UNKNOWN`` otherwise)
UNKNOWN_CODES = {MINT_CREDENTIAL: "CREDENTIAL_OUTCOME_UNKNOWN"}


@dataclass(frozen=True)
class Claim:
    """A key this request holds (its record is ``running`` with ``owner``)."""

    tenant_id: uuid.UUID
    scope: str
    key: str
    owner: str


@dataclass(frozen=True)
class Replay:
    """An earlier success with the key: answer ``resource_id``'s current state."""

    resource_id: str


def request_hash(payload: Any) -> str:
    """SHA-256 (hex) of the canonical JSON of ``payload``."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def claim(
    session: Session, *, tenant_id: uuid.UUID, scope: str, key: str, body_hash: str, owner: str, seconds: float
) -> Claim | Replay:
    """Claim ``key`` for ``owner`` (commit right after), or settle what an earlier request left.

    Returns a :class:`Claim` (go on), or a :class:`Replay` (answer the earlier resource). Raises the
    409 ``IDEMPOTENCY_CONFLICT``, ``IDEMPOTENCY_IN_PROGRESS``, ``CREATE_OUTCOME_UNKNOWN`` (for a mint
    ``CREDENTIAL_OUTCOME_UNKNOWN``, :data:`UNKNOWN_CODES`) problems,
    or the stored problem of a conclusive failure.
    """
    now = utcnow()
    if insert_if_absent(
        session,
        IdempotencyRecord,
        {
            "tenant_id": tenant_id,
            "scope": scope,
            "key": key,
            "request_hash": body_hash,
            "state": IdempotencyState.RUNNING,
            "owner": owner,
            "expires_at": now + dt.timedelta(seconds=seconds),
            "created_at": now,
        },
    ):
        return Claim(tenant_id, scope, key, owner)
    record = session.get(IdempotencyRecord, (tenant_id, scope, key), populate_existing=True)
    if record is None:  # deleted (released after an internal error) in between: ask to repeat
        raise agentic_error("IDEMPOTENCY_IN_PROGRESS")
    if record.request_hash != body_hash:
        raise agentic_error("IDEMPOTENCY_CONFLICT")
    if record.state == IdempotencyState.RUNNING and record.expires_at is not None and record.expires_at <= now:
        _settle_abandoned(session, record, now)
    if record.state == IdempotencyState.RUNNING:
        raise agentic_error("IDEMPOTENCY_IN_PROGRESS")
    if record.state == IdempotencyState.SUCCEEDED and record.resource_id:
        return Replay(record.resource_id)
    if record.state == IdempotencyState.FAILED and record.problem:
        raise stored_problem(record.problem, record.status_code)
    raise agentic_error(UNKNOWN_CODES.get(scope, "CREATE_OUTCOME_UNKNOWN"))


def _settle_abandoned(session: Session, record: IdempotencyRecord, now: dt.datetime) -> None:
    """A running record past its expiry: its holder died. Succeeded if its resource was committed."""
    state = IdempotencyState.SUCCEEDED if record.resource_id else IdempotencyState.UNKNOWN
    session.execute(
        update(IdempotencyRecord)
        .where(
            col(IdempotencyRecord.tenant_id) == record.tenant_id,
            col(IdempotencyRecord.scope) == record.scope,
            col(IdempotencyRecord.key) == record.key,
            col(IdempotencyRecord.state) == IdempotencyState.RUNNING,
        )
        .values(state=state, completed_at=now)
        .execution_options(synchronize_session=False)
    )
    session.refresh(record)


def _where(claim_: Claim):
    return (
        IdempotencyRecord.tenant_id == claim_.tenant_id,
        IdempotencyRecord.scope == claim_.scope,
        IdempotencyRecord.key == claim_.key,
        IdempotencyRecord.owner == claim_.owner,
        IdempotencyRecord.state == IdempotencyState.RUNNING,
    )


def attach(session: Session, claim_: Claim, resource_id: str) -> None:
    """Name the resource being created, in the transaction that writes it."""
    session.execute(
        update(IdempotencyRecord)
        .where(*_where(claim_))
        .values(resource_id=resource_id)
        .execution_options(synchronize_session=False)
    )


def succeed(session: Session, claim_: Claim) -> None:
    """The operation answered its resource: later requests with the key replay it."""
    session.execute(
        update(IdempotencyRecord)
        .where(*_where(claim_))
        .values(state=IdempotencyState.SUCCEEDED, completed_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def fail(session: Session, claim_: Claim, problem: Problem) -> None:
    """A conclusive failure (nothing was created): later requests replay ``problem``."""
    session.execute(
        update(IdempotencyRecord)
        .where(*_where(claim_))
        .values(
            state=IdempotencyState.FAILED, status_code=problem.status, problem=problem.body(), completed_at=utcnow()
        )
        .execution_options(synchronize_session=False)
    )


def unknown(session: Session, claim_: Claim) -> None:
    """The outcome cannot be told (the commit's answer was lost): the key is terminal."""
    session.execute(
        update(IdempotencyRecord)
        .where(*_where(claim_))
        .values(state=IdempotencyState.UNKNOWN, completed_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def settle_resource(
    session: Session,
    *,
    tenant_id: uuid.UUID,
    scope: str,
    resource_id: str,
    state: IdempotencyState,
    problem: Problem | None = None,
) -> None:
    """A worker learned the outcome of the operation that makes ``resource_id``: a running record
    naming it is settled (``state`` ``succeeded``, ``unknown``, or ``failed`` with ``problem``), so a
    replay after its request stopped waiting answers the outcome at once."""
    values: dict[str, Any] = {"state": state, "completed_at": utcnow()}
    if problem is not None:
        values.update(status_code=problem.status, problem=problem.body())
    session.execute(
        update(IdempotencyRecord)
        .where(
            col(IdempotencyRecord.tenant_id) == tenant_id,
            col(IdempotencyRecord.scope) == scope,
            col(IdempotencyRecord.resource_id) == resource_id,
            col(IdempotencyRecord.state) == IdempotencyState.RUNNING,
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def release(session: Session, claim_: Claim) -> None:
    """Forget the claim (an internal error before anything was committed): the key may be repeated."""
    session.execute(delete(IdempotencyRecord).where(*_where(claim_)).execution_options(synchronize_session=False))


def stored_problem(body: dict, status: int | None) -> Problem:
    """The problem a record keeps, rebuilt for replay."""
    extra = {k: v for k, v in body.items() if k not in ("type", "title", "status", "detail", "errors", "instance")}
    return Problem(
        status or int(body.get("status") or 400),
        body.get("detail"),
        title=body.get("title"),
        type=body.get("type", "about:blank"),
        errors=body.get("errors"),
        extra=extra or None,
    )
