"""Account updater jobs (second document: "Account updater job", section 4 "Account updater jobs",
section 6 event 1, section 8 limits; ``spec/SANDBOX.md``, account updater table): the verbs the routes
and tasks call.

The life of a job::

    pending --file found--> processing --every chunk done--> completed
       |                        \\--cannot finish--> failed      (both deliver account-updater.job.completed)
       +--1 h without a file--> removed (reads answer 404 at once)

1. **Create** (:func:`create_job`): a ``pending`` job row; the answer carries a pre-signed S3 PUT URL for
   the object ``account-updater/<tenant>/<job>/request.csv`` (:mod:`.s3_files`), valid until
   ``expires_at`` (one hour).
2. **Detect** (:func:`detect_upload`): a ``HEAD`` of the job's object, run by the beat sweep
   (:func:`detect_uploads`), by an S3 ``ObjectCreated`` notification (:func:`notify_objects`) and when
   a client polls a pending job (at most every :data:`DETECT_EVERY_SECONDS`). Finding it moves the job
   to ``processing`` and records the ``account_updater.prepare`` job (:mod:`.steps`). A pending job past
   ``expires_at`` reads as missing and is removed with its object by :func:`remove_expired_jobs`.
3. **Prepare** (:func:`scan_job_file` / :func:`apply_scan`): the file is read once as a stream and
   checked (size <= ``TESSERA_ACCOUNT_UPDATER_MAX_BYTES``, UTF-8 CSV, header, one field per column on
   every row, :mod:`.csv_files`); it is cut into chunks of ``TESSERA_ACCOUNT_UPDATER_CHUNK_ROWS`` rows
   recorded as byte ranges of the object (pinned by its ETag), and one ``account_updater.process_chunk``
   job per chunk is recorded. A file that fails the checks fails the job with one message per problem
   in ``errors``.
4. **Chunks** (:func:`.chunks.process_chunk` / :func:`.chunks.apply_chunk`), in parallel on the workers:
   each chunk's new tokens, log rows, events, result rows and counters are written in one transaction;
   the chunk that brings ``chunks_done`` to ``chunks_total`` records the final step in that same
   transaction. Every step is a platform job, relayed if its message is lost.
5. **Finish** (:func:`.results.write_result` / :func:`complete_job`): the result CSV is streamed from the
   chunks' stored rows to S3 as a multipart upload (SSE ``AES256``), the job becomes ``completed`` and
   ``account-updater.job.completed`` is emitted with ``{job: {id, status}}``. A job that cannot finish
   (bad file, card network rejecting, retries exhausted) ends ``failed`` with the same event
   (:func:`fail_job`).

Result rows (spec: result codes; SANDBOX.md) are described in :mod:`.results`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import uuid
from typing import Any
from urllib.parse import unquote_plus

from sqlalchemy import or_, select, update
from sqlmodel import Session, col

from config.settings import Settings, get_settings
from domain.account_updater.csv_files import Scan, empty_upload_error, scan_request
from domain.account_updater.s3_files import get_blocks, head_object, job_id_of_key, request_key
from domain.account_updater.steps import CHUNK_TASK, DETECT_TASK, FINISH_TASK, PREPARE_TASK, emit_outcome, record_step
from domain.account_updater.views import job_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra.dispatch import enqueue_after_commit
from infra.jobs import PermanentError, TransientError
from infra.lookup import get_owned
from providers.account_updates import MAX_ITEMS, base_url
from storage.db import rowcount, session_scope
from storage.keyset import keyset_page
from storage.models import Tenant
from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob
from storage.states import AccountUpdaterStatus
from storage.types import utcnow

log = logging.getLogger("tessera.account_updater")

DETECT_EVERY_SECONDS = 2.0
"""A poll of a pending job asks a worker to look for its file at most this often."""
JOB_ENTITY = "account-updater-job"  # the log rows' entity type of jobs


# ---- the resource --------------------------------------------------------------------------------


def _live_pending(job: AccountUpdaterJob, now: dt.datetime) -> bool:
    return job.status == AccountUpdaterStatus.PENDING and job.expires_at > now


def _visible(job: AccountUpdaterJob, now: dt.datetime) -> bool:
    return job.status != AccountUpdaterStatus.PENDING or job.expires_at > now


def create_job(session: Session, caller: Caller, *, now: dt.datetime | None = None) -> dict:
    """``POST /account-updater/jobs``: a new ``pending`` job whose upload window ends after
    ``TESSERA_ACCOUNT_UPDATER_UPLOAD_SECONDS`` (one hour); answers :func:`job_view`. Writes a log row."""
    now = now or utcnow()
    job_id = uuid.uuid4()
    job = AccountUpdaterJob(
        id=job_id,
        tenant_id=caller.tenant_id,
        request_key=request_key(caller.tenant_id, job_id),
        id_seed=secrets.token_hex(16),
        trace_id=caller.trace_id,
        created_by=caller.application_id,
        created_at=now,
        expires_at=now + dt.timedelta(seconds=get_settings().account_updater_upload_seconds),
    )
    session.add(job)
    audit.record(session, caller, entity_type=JOB_ENTITY, entity_id=job.id, operation="create")
    return job_view(job, now=now)


def get_job(
    session: Session, caller: Caller, job_id: uuid.UUID, *, now: dt.datetime | None = None
) -> AccountUpdaterJob:
    """The tenant's job; 404 when missing, another tenant's, or pending past its upload window."""
    now = now or utcnow()
    return get_owned(
        session,
        AccountUpdaterJob,
        job_id,
        caller.tenant_id,
        what="account updater job",
        where=lambda job: _visible(job, now),
    )


def read_job(session: Session, caller: Caller, job_id: uuid.UUID, *, now: dt.datetime | None = None) -> dict:
    """``GET /account-updater/jobs/{id}``: the job (404 as :func:`get_job`).

    Polling a pending job also asks a worker to look for its file (``account_updater.detect``), at most
    once every :data:`DETECT_EVERY_SECONDS` per job.
    """
    now = now or utcnow()
    job = get_job(session, caller, job_id, now=now)
    if job.status == AccountUpdaterStatus.PENDING:
        _request_detection(session, job, now)
    return job_view(job, now=now)


def _request_detection(session: Session, job: AccountUpdaterJob, now: dt.datetime) -> None:
    before = now - dt.timedelta(seconds=DETECT_EVERY_SECONDS)
    claimed = rowcount(
        session.execute(
            update(AccountUpdaterJob)
            .where(
                col(AccountUpdaterJob.id) == job.id,
                col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING,
                or_(col(AccountUpdaterJob.checked_at).is_(None), col(AccountUpdaterJob.checked_at) < before),
            )
            .values(checked_at=now)
            .execution_options(synchronize_session=False)
        )
    )
    if claimed:
        enqueue_after_commit(session, DETECT_TASK, job_id=str(job.id))


def list_jobs(
    session: Session, caller: Caller, *, size: int, after: dict | None, now: dt.datetime | None = None
) -> tuple[list[dict], dict | None]:
    """``GET /account-updater/jobs``: one page, newest first (keyset on created_at, id), expired
    pending jobs left out; returns ``(views, next position or None)``. 400 for a foreign cursor."""
    now = now or utcnow()
    query = select(AccountUpdaterJob).where(
        col(AccountUpdaterJob.tenant_id) == caller.tenant_id,
        or_(col(AccountUpdaterJob.status) != AccountUpdaterStatus.PENDING, col(AccountUpdaterJob.expires_at) > now),
    )
    rows, following = keyset_page(
        session, query, order=(AccountUpdaterJob.created_at, AccountUpdaterJob.id), size=size, after=after
    )
    return [job_view(job, now=now) for job in rows], following


# ---- upload detection and expiry -----------------------------------------------------------------


def start_processing(session: Session, job_id: uuid.UUID, *, now: dt.datetime | None = None) -> bool:
    """Move a live pending job to ``processing`` and record its prepare step (one winner); False when the
    job is not pending any more or its upload window has closed."""
    now = now or utcnow()
    moved = rowcount(
        session.execute(
            update(AccountUpdaterJob)
            .where(
                col(AccountUpdaterJob.id) == job_id,
                col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING,
                col(AccountUpdaterJob.expires_at) > now,
            )
            .values(status=AccountUpdaterStatus.PROCESSING, started_at=now, modified_at=now)
            .execution_options(synchronize_session=False)
        )
    )
    if not moved:
        return False
    job = session.get(AccountUpdaterJob, job_id, populate_existing=True)
    assert job is not None, "the row this transaction has just moved"
    record_step(session, job, PREPARE_TASK)
    return True


def detect_upload(job_id: uuid.UUID, *, now: dt.datetime | None = None) -> str:
    """Look for a pending job's file: ``started`` (found: now processing), ``waiting`` (no file yet) or
    ``skipped`` (not a live pending job). Raises TransientError when S3 cannot answer."""
    now = now or utcnow()
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        if job is None or not _live_pending(job, now):
            return "skipped"
        key = job.request_key
    if head_object(key) is None:
        return "waiting"
    with session_scope() as session:
        return "started" if start_processing(session, job_id) else "skipped"


def detect_uploads(*, batch: int = 200, now: dt.datetime | None = None) -> int:
    """The beat sweep: HEAD the objects of up to ``batch`` live pending jobs (least recently checked
    first) and start those whose file is there; returns how many started."""
    now = now or utcnow()
    with session_scope() as session:
        rows = session.scalars(
            select(AccountUpdaterJob)
            .where(
                col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING, col(AccountUpdaterJob.expires_at) > now
            )
            .order_by(col(AccountUpdaterJob.checked_at).asc().nulls_first(), col(AccountUpdaterJob.created_at))
            .limit(batch)
            .with_for_update(skip_locked=True)
        ).all()
        for job in rows:
            job.checked_at = now
        candidates = [(job.id, job.request_key) for job in rows]
    started = 0
    for job_id, key in candidates:
        try:
            found = head_object(key) is not None
        except TransientError:
            log.warning("S3 did not answer for job %s; the next sweep looks again", job_id)
            continue
        if found:
            with session_scope() as session:
                started += start_processing(session, job_id)
    return started


def notify_objects(session: Session, notification: Any) -> int:
    """An S3 event notification (``{"Records": [{"eventName": "ObjectCreated:...", "s3": {"bucket":
    {"name"}, "object": {"key"}}}]}``, as S3 sends to SQS/SNS/EventBridge bridges and MinIO to webhook
    targets; an SNS envelope ``{"Type": "Notification", "Message": "<that JSON>"}`` is opened first).

    Only a hint: for each ``ObjectCreated`` record naming a request file of this bucket whose job is
    live and pending, a detection task is sent after commit, which checks the object itself. Returns
    how many detections were requested. Never raises for malformed input.
    """
    if isinstance(notification, dict) and notification.get("Type") == "SubscriptionConfirmation":
        log.warning("S3 notification subscription to confirm: visit %s", notification.get("SubscribeURL"))
        return 0
    if isinstance(notification, dict) and notification.get("Type") == "Notification":
        try:
            notification = json.loads(notification.get("Message") or "")
        except (TypeError, ValueError):
            return 0
    records = notification.get("Records") if isinstance(notification, dict) else None
    if not isinstance(records, list):
        return 0
    name = get_settings().s3_bucket
    wanted: set[uuid.UUID] = set()
    for record in records[:1000]:
        if not isinstance(record, dict) or not str(record.get("eventName", "")).startswith("ObjectCreated"):
            continue
        target = _member(record, "s3")
        bucket_name = _member(target, "bucket").get("name")
        key = _member(target, "object").get("key")
        if bucket_name != name or not isinstance(key, str):
            continue
        job_id = job_id_of_key(unquote_plus(key))
        if job_id is not None:
            wanted.add(job_id)
    if not wanted:
        return 0
    now = utcnow()
    pending = session.scalars(
        select(col(AccountUpdaterJob.id)).where(
            col(AccountUpdaterJob.id).in_(list(wanted)),
            col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING,
            col(AccountUpdaterJob.expires_at) > now,
        )
    ).all()
    for job_id in pending:
        enqueue_after_commit(session, DETECT_TASK, job_id=str(job_id))
    return len(pending)


def _member(value: object, name: str) -> dict:
    """``value[name]`` when both are JSON objects, else an empty object."""
    found = value.get(name) if isinstance(value, dict) else None
    return found if isinstance(found, dict) else {}


def remove_expired_jobs(session: Session, *, now: dt.datetime | None = None, batch: int = 500) -> list[str]:
    """Delete up to ``batch`` jobs still pending at or after ``expires_at`` (spec: removed after one
    hour); returns the S3 keys of their request files for the caller to delete after commit."""
    now = now or utcnow()
    rows = session.scalars(
        select(AccountUpdaterJob)
        .where(col(AccountUpdaterJob.status) == AccountUpdaterStatus.PENDING, col(AccountUpdaterJob.expires_at) <= now)
        .order_by(col(AccountUpdaterJob.expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    keys = [job.request_key for job in rows]
    for job in rows:
        session.delete(job)
    return keys


# ---- ending a job --------------------------------------------------------------------------------


def fail_job(session: Session, job_id: uuid.UUID, errors: list[str], *, now: dt.datetime | None = None) -> bool:
    """End a processing job as ``failed`` with ``errors`` and emit ``account-updater.job.completed``
    (status failed); False when the job had already ended."""
    now = now or utcnow()
    job = session.get(AccountUpdaterJob, job_id, with_for_update=True, populate_existing=True)
    if job is None or job.status != AccountUpdaterStatus.PROCESSING:
        return False
    job.status = AccountUpdaterStatus.FAILED
    job.errors = [*list(job.errors or []), *errors][:50]
    job.completed_at = now
    job.modified_at = now
    session.add(job)
    emit_outcome(session, job)
    return True


def complete_job(session: Session, job_id: uuid.UUID, key: str, *, now: dt.datetime | None = None) -> bool:
    """End a processing job as ``completed`` with its result file at ``key``, drop the chunks' stored
    rows and emit ``account-updater.job.completed``; False when the job had already ended."""
    now = now or utcnow()
    job = session.get(AccountUpdaterJob, job_id, with_for_update=True, populate_existing=True)
    if job is None or job.status != AccountUpdaterStatus.PROCESSING:
        return False
    job.status = AccountUpdaterStatus.COMPLETED
    job.result_key = key
    job.completed_at = now
    job.modified_at = now
    session.add(job)
    session.execute(update(AccountUpdaterChunk).where(col(AccountUpdaterChunk.job_id) == job_id).values(result=None))
    emit_outcome(session, job)
    return True


def scan_job_file(job_id: uuid.UUID, settings: Settings | None = None) -> Scan:
    """The prepare step's slow part: HEAD then stream the job's request file (:func:`scan_request`).

    A file over the size limit is refused from its ``HEAD`` without reading it; a production tenant
    without a configured card network fails here, before any chunk runs. Raises TransientError when
    S3 cannot answer.
    """
    settings = settings or get_settings()
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        if job is None or job.status != AccountUpdaterStatus.PROCESSING:
            return Scan(errors=[])
        key = job.request_key
        tenant = session.get(Tenant, job.tenant_id)
        tenant_type = tenant.type if tenant else "test"
    try:
        base_url(tenant_type, settings)
    except PermanentError as exc:
        return Scan(errors=[str(exc)])
    head = head_object(key)
    if head is None:
        return Scan(errors=["The request file is gone."])
    limit = settings.account_updater_max_bytes
    if head["size"] > limit:
        return Scan(
            size=head["size"],
            errors=[f"The file is {head['size']:,} bytes, over the limit of {limit:,} bytes (30 MB)."],
        )
    if head["size"] == 0:
        return Scan(errors=[empty_upload_error(head.get("content_type"))])
    chunk_rows = max(1, min(settings.account_updater_chunk_rows, MAX_ITEMS))
    scan = scan_request(get_blocks(key, etag=head["etag"]), max_bytes=limit, chunk_rows=chunk_rows)
    scan.etag = head["etag"]
    return scan


def apply_scan(session: Session, job_id: uuid.UUID, scan: Scan) -> dict:
    """The prepare step's transaction: fail the job with the scan's errors, or record its layout, its
    chunks and one chunk job each (the final step directly for a file without rows)."""
    job = session.get(AccountUpdaterJob, job_id, with_for_update=True, populate_existing=True)
    if job is None or job.status != AccountUpdaterStatus.PROCESSING:
        return {"skipped": True}
    if scan.errors:
        fail_job(session, job_id, scan.errors)
        return {"errors": len(scan.errors)}
    if job.chunks_total is not None:  # already prepared (a repeated run): nothing to add
        return {"rows": job.rows_total, "chunks": job.chunks_total}
    job.columns = scan.columns
    job.request_etag = scan.etag
    job.request_bytes = scan.size
    job.rows_total = scan.rows
    job.chunks_total = len(scan.chunks)
    job.modified_at = utcnow()
    session.add(job)
    for number, plan in enumerate(scan.chunks):
        session.add(
            AccountUpdaterChunk(
                job_id=job.id,
                number=number,
                start_byte=plan.start_byte,
                end_byte=plan.end_byte,
                first_row=plan.first_row,
                row_count=plan.row_count,
            )
        )
    session.flush()
    for number in range(len(scan.chunks)):
        record_step(session, job, CHUNK_TASK, number=number)
    if not scan.chunks:
        record_step(session, job, FINISH_TASK)
    return {"rows": scan.rows, "chunks": len(scan.chunks)}
