"""Rotating keys as background jobs: a tenant's data key, the wrapping (master or KMS) key, and
crypto-shredding a deleted tenant.

* **Tenant data key rotation** (:func:`start_rotation`, the ``keys.rotate`` job): a new version is
  made active (the old active one ``retiring``) and a :class:`~storage.models.KeyRotation` recorded
  with the count of values to re-encrypt; each pass of the job re-seals, chunk by chunk, every value
  of :data:`~domain.keys.inventory.SEALED` and every document still under an older version, then
  records the next pass. A chunk is read without locks and resealed while the previous ones are
  written (two at once, on connections of their own); each written chunk is its own short
  transaction that changes a row only if it still holds the value read (the tenant's own writes
  win and are never held for long), and the pause after it adapts to how busy the database is
  (:mod:`domain.keys.sweeps`). Progress is read from the data itself (what is still sealed under an
  older version), so a pass killed anywhere is simply run again (the job's lease, the relay) and
  nothing is sealed twice. When the count after a sweep finds none left, and no process can still
  hold an older version as active (:data:`~storage.crypto.ACTIVE_VERSION_TTL`), the retiring
  versions' key bytes are destroyed in the transaction that completes the rotation.
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
from domain.keys.sweeps import Throttle, sweep_column
from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from infra import jobs
from storage import key_check, s3
from storage.crypto import ACTIVE_VERSION_TTL, RETIRING, Keyring, Wrapper, get_keyring
from storage.db import rowcount, session_scope
from storage.models import Job, KeyRotation, Tenant, TenantDataKey, TenantIndexKey
from storage.models_documents import Document
from storage.sealed import count_by_version, count_stale, key_from
from storage.states import JOB_TERMINAL, DocumentStatus, JobStatus
from storage.types import utcnow

log = logging.getLogger("tessera.keys")

ROTATE_TASK = "keys.rotate"
REWRAP_TASK = "keys.rewrap"
ENTITY_TYPE = "key"
RUNNING, COMPLETED = "running", "completed"
#: Values re-sealed per transaction: the tenant's own writes of a row wait at most for one chunk's
#: UPDATE and commit (about 10-20 ms), and a request that runs beside a chunk's write is held up by
#: that much at most; as fast per value as chunks ten times larger (29,000 values/s on 300,000 tokens).
CHUNK = 500
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
    """What one pass did: ``resealed`` values, and whether values under older versions remain;
    ``resume`` is where its first sweep stopped (``[column name, primary key as JSON]``), where the
    next pass's first sweep starts rather than read again what this one did."""

    resealed: int
    remaining: bool
    resume: list | None = None


def rotate_pass(job: Any, *, budget_seconds: float) -> PassOutcome | None:
    """Re-seal the rotation's values still under older versions for at most ``budget_seconds``:
    sweeps through every column of :data:`SEALED` (chunks of :data:`CHUNK`, read and resealed while
    the previous ones are written, each written chunk committed with the rotation's progress, paced
    by a :class:`~domain.keys.sweeps.Throttle`; the first sweep from where the previous pass stopped) and the documents,
    each sweep followed by one count of what is left, until none is. None when the rotation is gone
    or completed. Nothing is left (``remaining`` False) once a count made after no process can
    still hold an older version as active finds none; until then the pass waits for that moment and
    counts once more."""
    with session_scope() as session:
        rotation = session.get(KeyRotation, uuid.UUID(job.subject_id))
        if rotation is None or rotation.status != RUNNING:
            return None
        rotation_id, tenant_id, version, started = (
            rotation.id,
            rotation.tenant_id,
            rotation.version,
            rotation.created_at,
        )
    settle_by = started + dt.timedelta(seconds=2 * ACTIVE_VERSION_TTL)
    deadline = time.monotonic() + budget_seconds
    resealed, clean, throttle = 0, False, Throttle()
    resume: list | None
    stopped: list | None
    resume, stopped, sweep = _resume_point(rotation_id), None, True
    while stopped is None and time.monotonic() < deadline:
        swept = 0
        if sweep:
            for spec in SEALED:
                after = None
                if resume is not None:  # the first sweep goes on where the previous pass stopped
                    if spec.name != resume[0]:
                        continue
                    after, resume = key_from(spec, resume[1]), None
                changed, stopped_at = sweep_column(
                    spec, tenant_id, version, rotation_id, deadline, throttle, chunk=CHUNK, after=after
                )
                swept += changed
                if stopped_at is not None or time.monotonic() >= deadline:  # [] : stopped between two columns
                    stopped = [] if stopped_at is None else [spec.name, [_json(value) for value in stopped_at]]
                    break
            if stopped is not None:
                resealed += swept
                break
            swept += _rotate_documents(tenant_id, version, rotation_id, deadline)
            resealed += swept
        counted_at = utcnow()
        with session_scope() as session:  # a count reads the rows in their order on disk: cheaper than a sweep
            left = stale_values(session, tenant_id, version)
        if left and sweep and not swept:
            break  # what is left cannot be resealed now (a document still uploading): the next pass looks again
        sweep = left > 0
        if not sweep:
            clean = counted_at >= settle_by
            if clean:
                break
            # values may still be sealed by a process holding an older version as active: count once more then
            time.sleep(max(0.0, min((settle_by - utcnow()).total_seconds(), deadline - time.monotonic())))
    log.info("rotation %s: %s values resealed in this pass (paused %.1f s)", rotation_id, resealed, throttle.paused)
    return PassOutcome(resealed, not clean, stopped or None)


def _json(value: Any) -> Any:
    return str(value) if isinstance(value, uuid.UUID) else value


def _resume_point(rotation_id: uuid.UUID) -> list | None:
    """Where the rotation's previous pass stopped (its job result's ``resume``), or None."""
    with session_scope() as session:
        result = session.exec(
            select(Job.result)
            .where(
                col(Job.kind) == ROTATE_TASK,
                col(Job.subject_id) == str(rotation_id),
                col(Job.status) == JobStatus.SUCCEEDED,
            )
            .order_by(col(Job.created_at).desc())
            .limit(1)
        ).first()
    resume = result.get("resume") if isinstance(result, dict) else None
    if isinstance(resume, list) and len(resume) == 2 and any(spec.name == resume[0] for spec in SEALED):
        return resume
    return None


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
        if outcome.resume is not None:
            return {"resealed": outcome.resealed, "next": str(following.id), "resume": outcome.resume}
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
    rotation = rotation_progress(session, tenant_id)  # first: a rotation read as completed has
    # destroyed the versions read after it
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
        "rotation": rotation,
    }


def rotation_progress(session: Session, tenant_id: uuid.UUID) -> dict | None:
    """The tenant's latest rotation, ``{"status": "running"|"completed", "done", "total", "version"}``
    (``done`` and ``total`` count sealed values), or None: one row read, what a wait for the rotation
    polls (:func:`tenant_status` also counts every value of the tenant)."""
    rotation = session.exec(
        select(KeyRotation).where(KeyRotation.tenant_id == tenant_id).order_by(col(KeyRotation.created_at).desc())
    ).first()
    if rotation is None:
        return None
    return {"status": rotation.status, "done": rotation.done, "total": rotation.total, "version": rotation.version}


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
