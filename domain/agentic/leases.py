"""Operation leases: in-flight work on a payment method or an allowance.

A lease is a row (:class:`storage.models_agentic.OperationLease`), one per resource, with an
``operation`` (``enroll`` for a create's or a retry's enrollments, ``delete`` for a delete cascade),
an ``owner`` (the operation id) and an ``expires_at``. It is neither a Python lock nor a Redis lock:
it lives in the database, in the transaction that records the work, so it can never outlive its
work by more than its expiry. Its presence is what answers the ``409 ..._IN_PROGRESS`` problems:

* ``enroll`` held -> ``PAYMENT_METHOD_OPERATION_IN_PROGRESS``;
* ``delete`` held -> ``PAYMENT_METHOD_DELETE_IN_PROGRESS``;
* on an allowance: ``setup`` and ``update`` -> ``ALLOWANCE_UPDATE_IN_PROGRESS``, ``verify`` ->
  ``ALLOWANCE_VERIFICATION_IN_PROGRESS``, ``cancel`` -> ``ALLOWANCE_DELETE_IN_PROGRESS``, ``mint``
  (the five-minute mint lease, spec 001 section 8) -> ``ALLOWANCE_CREDENTIAL_IN_PROGRESS``.

The holder deletes its lease when the work ends (the last enrollment job of an operation, the
delete job); :func:`release_expired` (a beat sweep) frees leases whose holder died. An expired lease
is also taken over atomically by the next :func:`acquire`.
"""

from __future__ import annotations

import datetime as dt
import functools
import uuid

from sqlalchemy import ColumnElement, Delete, Insert, bindparam, delete, select
from sqlmodel import Session, col

from domain.agentic.errors import agentic_error
from infra.errors import Problem
from storage.db import rowcount, stage_write
from storage.models_agentic import OperationLease
from storage.sql import upsert_statement
from storage.types import table_of, utcnow

_LEASES = table_of(OperationLease)

ENROLL, DELETE = "enroll", "delete"
#: The operations on an allowance: its rails' setup, an update, a verification, a cancellation, a mint.
SETUP, UPDATE, VERIFY, CANCEL, MINT = "setup", "update", "verify", "cancel", "mint"
IN_PROGRESS_CODES = {
    ENROLL: "PAYMENT_METHOD_OPERATION_IN_PROGRESS",
    DELETE: "PAYMENT_METHOD_DELETE_IN_PROGRESS",
    SETUP: "ALLOWANCE_UPDATE_IN_PROGRESS",
    UPDATE: "ALLOWANCE_UPDATE_IN_PROGRESS",
    VERIFY: "ALLOWANCE_VERIFICATION_IN_PROGRESS",
    CANCEL: "ALLOWANCE_DELETE_IN_PROGRESS",
    MINT: "ALLOWANCE_CREDENTIAL_IN_PROGRESS",
}


def new_owner() -> str:
    """A fresh operation id (the owner name of a lease)."""
    return f"op_{uuid.uuid4().hex}"


def held(session: Session, resource_id: str, *, now: dt.datetime | None = None) -> OperationLease | None:
    """The live (unexpired) lease on ``resource_id``, or None."""
    now = now or utcnow()
    lease = session.get(OperationLease, resource_id, populate_existing=True)
    return lease if lease is not None and lease.expires_at > now else None


def in_progress(lease: OperationLease | str) -> Problem:
    """The 409 answered while ``lease`` (the row, or its ``operation``) is held."""
    operation = lease if isinstance(lease, str) else lease.operation
    return agentic_error(IN_PROGRESS_CODES.get(operation, "PAYMENT_METHOD_OPERATION_IN_PROGRESS"))


def acquire(
    session: Session, *, tenant_id: uuid.UUID, resource_id: str, operation: str, owner: str, seconds: float
) -> None:
    """Take the lease on ``resource_id`` for ``owner`` in the caller's transaction.

    One statement: inserts the row, or takes over an expired one (``INSERT ... ON CONFLICT DO UPDATE
    ... WHERE expires_at <= now``); the primary key makes one of two racing callers wait for the
    other's transaction and then find its live lease. Raises the ``409 ..._IN_PROGRESS`` problem of
    the live lease.
    """
    values = _acquire_values(
        tenant_id=tenant_id, resource_id=resource_id, operation=operation, owner=owner, seconds=seconds
    )
    if rowcount(session.execute(_acquire_statement(session.get_bind().dialect.name), values)) == 1:
        return
    current = held(session, resource_id)
    # expired between the two statements (extremely unlikely): the operation asked for, to repeat
    raise in_progress(current if current is not None else operation)


def stage_acquire(
    session: Session, *, tenant_id: uuid.UUID, resource_id: str, operation: str, owner: str, seconds: float
) -> None:
    """:func:`acquire` sent with the transaction's other writes just before its commit
    (``storage.db.stage_write``), for a caller that holds the lock of the resource's row and found no
    live lease on it (every lease of a payment method is taken with the payment method locked, so
    none can appear before the commit): nothing to check, no round trip of its own. The statement is
    built once per database kind, its values bound by name (``lease_...``)."""
    stage_write(
        session,
        _acquire_statement(session.get_bind().dialect.name),
        _acquire_values(
            tenant_id=tenant_id, resource_id=resource_id, operation=operation, owner=owner, seconds=seconds
        ),
    )


@functools.cache
def _acquire_statement(dialect_name: str) -> Insert:
    """The one statement taking a lease, over an expired lease too (:func:`storage.sql.upsert_statement`),
    built once for ``dialect_name``: its values the bind parameters ``lease_<column>``
    (:func:`_acquire_values`); an expired lease is one whose ``expires_at`` is not after
    ``lease_acquired_at``."""
    columns = table_of(OperationLease).c
    values = {
        name: bindparam(f"lease_{name}", type_=columns[name].type)
        for name in ("resource_id", "tenant_id", "operation", "owner", "acquired_at", "expires_at")
    }
    return upsert_statement(
        dialect_name, OperationLease, values, index=["resource_id"], when=columns.expires_at <= values["acquired_at"]
    )


def _acquire_values(
    *, tenant_id: uuid.UUID, resource_id: str, operation: str, owner: str, seconds: float
) -> dict[str, object]:
    """The values of :func:`_acquire_statement`: the lease on ``resource_id`` for ``owner``, from now
    for ``seconds``."""
    now = utcnow()
    return {
        "lease_resource_id": resource_id,
        "lease_tenant_id": tenant_id,
        "lease_operation": operation,
        "lease_owner": owner,
        "lease_acquired_at": now,
        "lease_expires_at": now + dt.timedelta(seconds=seconds),
    }


def release(session: Session, resource_id: str, owner: str, *, unless=None) -> bool:
    """Delete ``owner``'s lease on ``resource_id`` (another owner's is left alone); True when deleted.

    ``unless``: an optional SQL condition (for example an ``EXISTS`` of the operation's unfinished
    jobs) that keeps the lease when true; checked in the same statement."""
    return rowcount(session.execute(release_statement(resource_id, owner, unless=unless))) == 1


def release_statement(resource_id: str | ColumnElement[str], owner: str | ColumnElement[str], *, unless=None) -> Delete:
    """The ``DELETE`` of :func:`release` (for a caller that sends it with its other writes,
    ``storage.db.stage_write``, or within one statement: then ``resource_id`` and ``owner`` may be
    SQL expressions)."""
    statement = delete(_LEASES).where(_LEASES.c.resource_id == resource_id, _LEASES.c.owner == owner)
    return statement if unless is None else statement.where(~unless)


def release_expired(session: Session, *, now: dt.datetime | None = None, batch: int = 1000) -> int:
    """Delete up to ``batch`` expired leases (their holder died); returns how many."""
    now = now or utcnow()
    ids = (
        session.execute(
            select(col(OperationLease.resource_id))
            .where(col(OperationLease.expires_at) <= now)
            .limit(batch)
            .with_for_update(skip_locked=True)
        )
        .scalars()
        .all()
    )
    if not ids:
        return 0
    session.execute(
        delete(OperationLease)
        .where(col(OperationLease.resource_id).in_(ids), col(OperationLease.expires_at) <= now)
        .execution_options(synchronize_session=False)
    )
    return len(ids)
