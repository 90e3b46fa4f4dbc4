"""Rotating keys as background jobs: a tenant's data key, the wrapping (master or KMS) key, and
crypto-shredding a deleted tenant.

* **Tenant data key rotation** (:func:`start_rotation`, the ``keys.rotate`` job): a new version is
  made active (the old active one ``retiring``) and a :class:`~storage.models.KeyRotation` recorded
  with the count of values to re-encrypt; each pass of the job re-seals, chunk by chunk (each chunk
  its own short transaction, its rows locked with SKIP LOCKED so the tenant's own writes are never
  held for long, a pause between chunks), every value of :data:`~domain.keys.inventory.SEALED` and
  every document still under an older version, then records the next pass. Progress is read from the
  data itself (what is still sealed under an older version), so a pass killed anywhere is simply run
  again (the job's lease, the relay) and nothing is sealed twice. When none is left, and no process
  can still hold an older version as active (:data:`~storage.crypto.ACTIVE_VERSION_TTL`), the
  retiring versions' key bytes are destroyed in the transaction that completes the rotation.
* **Rewrap** (:func:`start_rewrap`, the ``keys.rewrap`` job): every wrapped key (data key versions
  and derivation keys) not under the current wrapping key is unwrapped with an accepted previous key
  and wrapped with the current one, in chunks, each row updated only if it is still what was read;
  at the end the key check moves under the current key.
* **Shredding** (``DELETE /tenants/self``, :func:`domain.tenancy.tenants.delete_tenant`): a tenant's
  wrapped keys are deleted in the transaction that marks it deleted; the ``keys.purge_tenant`` job
  then deletes its rows and S3 objects (:func:`purge_tenant`).

Every key event is an audit log row of the tenant (``entity_type`` ``key``, never key material) and an
operator log line.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import delete, func, or_, update
from sqlmodel import Session, col, select

from domain.documents import service as documents
from domain.keys.inventory import SEALED
from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from infra import jobs
from storage import key_check, s3
from storage.crypto import ACTIVE_VERSION_TTL, RETIRING, Keyring, Wrapper, get_keyring
from storage.db import rowcount, session_scope
from storage.models import Job, KeyRotation, Tenant, TenantDataKey, TenantIndexKey
from storage.models_documents import Document
from storage.sealed import count_by_version, count_stale, key_of, stale_rows, write_resealed
from storage.states import JOB_TERMINAL, DocumentStatus
from storage.types import utcnow

log = logging.getLogger("tessera.keys")

ROTATE_TASK = "keys.rotate"
REWRAP_TASK = "keys.rewrap"
ENTITY_TYPE = "key"
RUNNING, COMPLETED = "running", "completed"
#: Values re-sealed per transaction, and the pause between two chunks (seconds): the tenant's own
#: requests wait at most one chunk's time (a few tens of milliseconds) for a row, and the database keeps room for them.
CHUNK = 2000
PAUSE_SECONDS = 0.002
#: Wrapped keys rewrapped per transaction.
REWRAP_CHUNK = 200


def _audit(session: Session, tenant_id: uuid.UUID, entity_id: str, operation: str) -> None:
    tenant = session.get(Tenant, tenant_id)
    if tenant is not None:
        audit.record(session, system_caller(tenant), entity_type=ENTITY_TYPE, entity_id=entity_id, operation=operation)


# ---- tenant data key rotation --------------------------------------------------------------------


def _live_documents(tenant_id: uuid.UUID):
    return (
        col(Document.tenant_id) == tenant_id,
        col(Document.status).in_((DocumentStatus.READY, DocumentStatus.UPLOADING)),
    )


def stale_values(session: Session, tenant_id: uuid.UUID, version: int) -> int:
    """How many values of the tenant are sealed under a version other than ``version``."""
    counted = sum(count_stale(session, spec, tenant_id, version) for spec in SEALED)
    return (
        counted
        + session.exec(
            select(func.count())
            .select_from(Document)
            .where(*_live_documents(tenant_id), col(Document.key_version) != version)
        ).one()
    )


def start_rotation(session: Session, tenant_id: uuid.UUID, *, trace_id: str | None = None) -> KeyRotation:
    """Make the tenant's next data key version active and record its rotation and first pass (sent
    on commit). A rotation already running is returned as it is. Raises LookupError for an unknown
    or deleted tenant."""
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None or tenant.deleted_at is not None:
        raise LookupError(f"no tenant {tenant_id}")
    running = session.exec(
        select(KeyRotation).where(KeyRotation.tenant_id == tenant_id, KeyRotation.status == RUNNING)
    ).first()
    if running is not None:
        return running
    version = get_keyring().add_version(session, tenant_id)
    rotation = KeyRotation(tenant_id=tenant_id, version=version, total=stale_values(session, tenant_id, version))
    session.add(rotation)
    session.flush()
    job = jobs.record(
        session,
        kind=ROTATE_TASK,
        tenant_id=tenant_id,
        subject_type="key_rotation",
        subject_id=str(rotation.id),
        trace_id=trace_id,
        max_attempts=20,
    )
    rotation.job_id = job.id
    session.add(rotation)
    _audit(session, tenant_id, f"data-key-v{version}", "create")
    log.info(
        "tenant %s: data key version %s made; rotation %s re-encrypts %s values",
        tenant_id,
        version,
        rotation.id,
        rotation.total,
    )
    return rotation


@dataclass(frozen=True)
class PassOutcome:
    """What one pass did: ``resealed`` values, and whether values under older versions remain."""

    resealed: int
    remaining: bool


def rotate_pass(job: Any, *, budget_seconds: float) -> PassOutcome | None:
    """Re-seal the rotation's values still under older versions, chunk by chunk, for at most
    ``budget_seconds``; each chunk commits with the rotation's progress. None when the rotation is
    gone or completed. When nothing is left, waits until no process can still hold an older version
    as active and looks once more."""
    with session_scope() as session:
        rotation = session.get(KeyRotation, uuid.UUID(job.subject_id))
        if rotation is None or rotation.status != RUNNING:
            return None
        tenant_id, version, started = rotation.tenant_id, rotation.version, rotation.created_at
    deadline = time.monotonic() + budget_seconds
    resealed = 0
    keyring = get_keyring()
    while time.monotonic() < deadline:
        done = 0
        for spec in SEALED:
            after: tuple | None = None  # a keyset through the column: each chunk reads its own rows only
            while time.monotonic() < deadline:
                with session_scope() as session:
                    rows = stale_rows(session, spec, tenant_id, version, CHUNK, after)
                    if not rows:
                        break
                    fresh = [
                        keyring.reseal(session, tenant_id, spec.purpose, spec.resource_of(row), row.sealed, version)
                        for row in rows
                    ]
                    changed = write_resealed(session, spec, rows, fresh)
                    session.execute(
                        update(KeyRotation)
                        .where(col(KeyRotation.id) == rotation.id)
                        .values(done=col(KeyRotation.done) + changed)
                    )
                after = key_of(spec, rows[-1])
                done += changed
                time.sleep(PAUSE_SECONDS)
        done += _rotate_documents(tenant_id, version, rotation.id, deadline)
        resealed += done
        if done == 0:
            settle_by = started + dt.timedelta(seconds=2 * ACTIVE_VERSION_TTL)
            wait = (settle_by - utcnow()).total_seconds()
            if wait <= 0:
                break
            time.sleep(min(wait, max(0.0, deadline - time.monotonic())))  # then look once more
    with session_scope() as session:
        remaining = stale_values(session, tenant_id, version) > 0 or utcnow() < started + dt.timedelta(
            seconds=2 * ACTIVE_VERSION_TTL
        )
    return PassOutcome(resealed, remaining)


def _rotate_documents(tenant_id: uuid.UUID, version: int, rotation_id: uuid.UUID, deadline: float) -> int:
    """Write the content of documents under older versions again under ``version`` (a new S3 object;
    the row then points at it and the old object is removed); how many."""
    done = 0
    keyring = get_keyring()
    while time.monotonic() < deadline:
        with session_scope() as session:
            document = session.exec(
                select(Document)
                .where(
                    *_live_documents(tenant_id),
                    col(Document.key_version) != version,
                    col(Document.status) == DocumentStatus.READY,
                )
                .limit(1)
            ).first()
            if document is None:
                return done
            source = documents.Source(
                tenant_id=tenant_id,
                document_id=document.id,
                object_key=document.object_key,
                content_type=document.content_type,
                size=document.size,
                chunk_count=document.chunk_count,
                chunk_size=document.chunk_size,
                data_key=keyring.data_key(session, tenant_id, document.key_version),
            )
            new_key = keyring.data_key(session, tenant_id, version)
            old_object, moved_to = document.object_key, f"{documents.object_key(tenant_id, document.id)}.v{version}"
        documents.copy_sealed(source, data_key=new_key, key=moved_to)
        with session_scope() as session:
            changed = rowcount(
                session.execute(
                    update(Document)
                    .where(col(Document.id) == source.document_id, col(Document.object_key) == old_object)
                    .values(object_key=moved_to, key_version=version)
                )
            )
            session.execute(
                update(KeyRotation)
                .where(col(KeyRotation.id) == rotation_id)
                .values(done=col(KeyRotation.done) + changed)
            )
        documents.remove_object(old_object if changed else moved_to, None)
        done += changed
    return done


def settle_pass(session: Session, job: Any, outcome: PassOutcome | None) -> dict:
    """In the pass job's completing transaction: record the next pass, or complete the rotation
    (destroying its retiring versions). The job result: ``{"resealed", "next"}`` or ``{"completed"}``."""
    if outcome is None:
        return {"skipped": True}
    rotation = session.get(KeyRotation, uuid.UUID(job.subject_id), with_for_update=True)
    if rotation is None or rotation.status != RUNNING:
        return {"skipped": True}
    if outcome.remaining:
        following = jobs.record(
            session,
            kind=ROTATE_TASK,
            tenant_id=rotation.tenant_id,
            subject_type="key_rotation",
            subject_id=str(rotation.id),
            trace_id=job.trace_id,
            max_attempts=20,
        )
        rotation.job_id = following.id
        session.add(rotation)
        return {"resealed": outcome.resealed, "next": str(following.id)}
    keyring = get_keyring()
    retiring = session.exec(
        select(TenantDataKey).where(TenantDataKey.tenant_id == rotation.tenant_id, TenantDataKey.state == RETIRING)
    ).all()
    for row in retiring:
        keyring.destroy_version(session, rotation.tenant_id, row.version)
        _audit(session, rotation.tenant_id, f"data-key-v{row.version}", "delete")
    rotation.status, rotation.completed_at = COMPLETED, utcnow()
    session.add(rotation)
    log.info(
        "tenant %s: rotation %s to version %s completed (%s values); destroyed versions %s",
        rotation.tenant_id,
        rotation.id,
        rotation.version,
        rotation.done,
        [row.version for row in retiring],
    )
    return {"resealed": outcome.resealed, "completed": True}


def tenant_status(session: Session, tenant_id: uuid.UUID) -> dict:
    """``{"tenant_id", "active_version", "versions": [{"version", "state", "values", "destroyed_at"}],
    "rotation": {"status", "done", "total"} | None}``: ``values`` counts the sealed values under each
    version. Raises LookupError for an unknown tenant."""
    rows = session.exec(
        select(TenantDataKey).where(TenantDataKey.tenant_id == tenant_id).order_by(col(TenantDataKey.version))
    ).all()
    if not rows:
        raise LookupError(f"no tenant {tenant_id}")
    counted: dict[int, int] = {}
    for spec in SEALED:
        for version, number in count_by_version(session, spec, tenant_id).items():
            counted[version] = counted.get(version, 0) + number
    for version, number in session.execute(
        select(Document.key_version, func.count())
        .where(*_live_documents(tenant_id))
        .group_by(col(Document.key_version))
    ).all():
        counted[version] = counted.get(version, 0) + number
    rotation = session.exec(
        select(KeyRotation).where(KeyRotation.tenant_id == tenant_id).order_by(col(KeyRotation.created_at).desc())
    ).first()
    return {
        "tenant_id": str(tenant_id),
        "active_version": next((row.version for row in rows if row.state == "active"), None),
        "versions": [
            {
                "version": row.version,
                "state": row.state,
                "values": counted.get(row.version, 0),
                "destroyed_at": row.destroyed_at.isoformat() if row.destroyed_at else None,
            }
            for row in rows
        ],
        "rotation": None
        if rotation is None
        else {"status": rotation.status, "done": rotation.done, "total": rotation.total, "version": rotation.version},
    }


def tenants_with_keys(session: Session) -> list[uuid.UUID]:
    """The ids of the tenants that are not deleted (``tessera keys rotate --all``)."""
    return list(session.exec(select(Tenant.id).where(col(Tenant.deleted_at).is_(None))).all())


# ---- rewrap ---------------------------------------------------------------------------------------


#: The tables of wrapped keys.
WRAPPED: tuple[type[TenantDataKey] | type[TenantIndexKey], ...] = (TenantDataKey, TenantIndexKey)


def _not_current(model: type[TenantDataKey] | type[TenantIndexKey], current: str):
    return (col(model.wrapped_key).is_not(None), or_(col(model.wrapped_by).is_(None), col(model.wrapped_by) != current))


def under_previous(session: Session) -> int:
    """How many wrapped keys (data key versions and derivation keys) are not under the current
    wrapping key."""
    current = get_keyring().current.wrapped_by
    return sum(
        session.exec(select(func.count()).select_from(model).where(*_not_current(model, current))).one()
        for model in WRAPPED
    )


def status(session: Session) -> dict:
    """``{"wrapping": "master"|"kms", "wrapped_by", "key_check": "ok"|"mismatch",
    "data_keys_under_previous": N}``."""
    keyring = get_keyring()
    return {
        "wrapping": keyring.current.name,
        "wrapped_by": keyring.current.wrapped_by,
        "key_check": key_check.status(session, keyring),
        "data_keys_under_previous": under_previous(session),
    }


def start_rewrap(session: Session, *, trace_id: str | None = None) -> uuid.UUID:
    """Record a rewrap job (sent on commit); its id."""
    job = jobs.record(
        session,
        kind=REWRAP_TASK,
        tenant_id=None,
        subject_type="keys",
        subject_id="rewrap",
        trace_id=trace_id,
        max_attempts=20,
    )
    log.info("rewrap of every wrapped key under %s started (job %s)", get_keyring().current.wrapped_by, job.id)
    return job.id


def rewrap_settled(job_id: uuid.UUID):
    """A query of the unfinished rewrap jobs recorded since ``job_id`` (none: the rewrap ended)."""
    started = select(Job.created_at).where(col(Job.id) == job_id).scalar_subquery()
    return select(Job.id).where(
        col(Job.kind) == REWRAP_TASK, col(Job.created_at) >= started, col(Job.status).not_in(JOB_TERMINAL)
    )


def rewrap_pass(*, budget_seconds: float) -> PassOutcome:
    """Rewrap keys not under the current wrapping key, chunk by chunk, for at most ``budget_seconds``;
    each row is written only if it is still what was read."""
    keyring = get_keyring()
    current = keyring.current
    deadline = time.monotonic() + budget_seconds
    done = 0
    while time.monotonic() < deadline:
        moved = _rewrap_chunk(TenantDataKey, keyring, current) + _rewrap_chunk(TenantIndexKey, keyring, current)
        done += moved
        if moved == 0:
            break
    with session_scope() as session:
        remaining = under_previous(session) > 0
    return PassOutcome(done, remaining)


_Wrapped = TypeVar("_Wrapped", TenantDataKey, TenantIndexKey)


def _rewrap_chunk(model: type[_Wrapped], keyring: Keyring, current: Wrapper) -> int:
    """Rewrap up to :data:`REWRAP_CHUNK` rows of ``model`` not under ``current`` (rows another
    transaction holds are skipped); audit rows for their tenants. Returns how many."""
    with session_scope() as session:
        rows = session.exec(
            select(model)
            .where(*_not_current(model, current.wrapped_by))
            .limit(REWRAP_CHUNK)
            .with_for_update(skip_locked=True)
        ).all()
        tenants = set()
        for row in rows:
            if row.wrapped_key is None:
                continue
            plain, _ = keyring.unwrap(row.tenant_id, row.wrapped_key, row.wrapping, row.kms_key_id, row.wrapped_by)
            wrapped, kms_key_id = current.wrap(plain, row.tenant_id)
            row.wrapped_key, row.wrapping, row.kms_key_id, row.wrapped_by = (
                wrapped,
                current.name,
                kms_key_id,
                current.wrapped_by,
            )
            session.add(row)
            tenants.add(row.tenant_id)
        for tenant_id in tenants:
            _audit(session, tenant_id, "wrapping", "update")
        return len(rows)


def settle_rewrap(session: Session, job: Any, outcome: PassOutcome) -> dict:
    """Record the next pass, or move the key check under the current key (the rewrap is done)."""
    if outcome.remaining:
        following = jobs.record(
            session,
            kind=REWRAP_TASK,
            tenant_id=None,
            subject_type="keys",
            subject_id="rewrap",
            trace_id=job.trace_id,
            max_attempts=20,
        )
        return {"rewrapped": outcome.resealed, "next": str(following.id)}
    key_check.move_to_current(session)
    log.info("rewrap finished: every wrapped key and the key check are under %s", get_keyring().current.wrapped_by)
    return {"rewrapped": outcome.resealed, "completed": True}


# ---- shredding ------------------------------------------------------------------------------------


def purge_tenant(job: Any) -> int:
    """Delete a shredded tenant's S3 objects (everything under its prefixes) and its rows (the
    tenant row, whose foreign keys cascade to every table of the tenant); how many objects."""
    tenant_id = uuid.UUID(job.subject_id)
    removed = s3.delete_prefixes([f"{prefix}/{tenant_id}/" for prefix in s3.TENANT_PREFIXES])
    with session_scope() as session:
        session.execute(delete(Tenant).where(col(Tenant.id) == tenant_id, col(Tenant.deleted_at).is_not(None)))
    log.info("tenant %s purged: its rows and %s stored objects deleted", tenant_id, removed)
    return removed
