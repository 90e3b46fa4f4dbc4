"""Account updater jobs (second document: "Account updater job", section 4 "Account updater jobs",
section 6 event 1, section 8 limits; ``spec/SANDBOX.md``, account updater table).

The life of a job::

    pending --file found--> processing --every chunk done--> completed
       |                        \\--cannot finish--> failed      (both deliver account-updater.job.completed)
       +--1 h without a file--> removed (reads answer 404 at once)

1. **Create** (:func:`create_job`): a ``pending`` job row; the answer carries a pre-signed S3 PUT URL for
   the object ``account-updater/<tenant>/<job>/request.csv``, valid until ``expires_at`` (one hour).
2. **Detect** (:func:`detect_upload`): a ``HEAD`` of the job's object, run by the beat sweep
   (:func:`detect_uploads`), by an S3 ``ObjectCreated`` notification (:func:`notify_objects`) and when
   a client polls a pending job (at most every :data:`DETECT_EVERY_SECONDS`). Finding it moves the job
   to ``processing`` and records the ``account_updater.prepare`` job. A pending job past ``expires_at``
   reads as missing and is removed with its object by :func:`remove_expired_jobs`.
3. **Prepare** (:func:`scan_request` / :func:`apply_scan`): the file is read once as a stream and checked
   (size <= ``TESSERA_ACCOUNT_UPDATER_MAX_BYTES``, UTF-8 CSV, header, one field per column on every row);
   it is cut into chunks of ``TESSERA_ACCOUNT_UPDATER_CHUNK_ROWS`` rows recorded as byte ranges of the
   object (pinned by its ETag), and one ``account_updater.process_chunk`` job per chunk is recorded.
   A file that fails the checks fails the job with one message per problem in ``errors``.
4. **Chunks** (:func:`process_chunk` / :func:`apply_chunk`), in parallel on the workers: a ranged GET of
   the chunk's bytes, one query loading the chunk's tokens, data decrypted in the worker, one batch call
   to the card network, then **one transaction** that claims the chunk (``pending`` -> ``done``), bulk
   inserts the new card tokens (ids derived from the job's random seed and the row number, inserted
   with ON CONFLICT DO NOTHING), their log rows and ``token.created`` events, stores the chunk's result
   rows and adds the chunk to the job's counters. A chunk run twice (worker killed, message redelivered)
   finds itself claimed and writes nothing. The chunk that brings ``chunks_done`` to ``chunks_total``
   records the final step in that same transaction: this counter on the job row replaces a Celery chord
   (whose state would live in Redis only); every step is a platform job, relayed if its message is lost.
5. **Finish** (:func:`write_result` / :func:`complete_job`): the result CSV is streamed from the chunks'
   stored rows to S3 as a multipart upload (SSE ``AES256``), the job becomes ``completed`` and
   ``account-updater.job.completed`` is emitted with ``{job: {id, status}}``. A job that cannot finish
   (bad file, card network rejecting, retries exhausted) ends ``failed`` with the same event
   (:func:`fail_job`).

Result rows (spec: result codes; SANDBOX.md): ``UPD_*`` rows create a new card token (the old token is
untouched) and report ``new_token``; ``WRN_*``/``ERR_*`` rows report their code; rows without an update
are omitted. A ``token`` cell that names no live card token of the tenant is ``ERR_INVALID_TOKEN``; an
expiration cell that is not two digits (or only one of the two given) is ``ERR_INVALID_EXP_DATE``. The
result file holds token ids, two-digit expirations and codes only.
"""

from __future__ import annotations

import codecs
import csv
import datetime as dt
import hashlib
import io
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_plus

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import String, bindparam, func, insert, or_, select, update
from sqlmodel import Session, col

from config.settings import Settings, get_settings
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tokens.cards import DEFAULT_FINGERPRINT_EXPRESSIONS, default_card_mask, validate_card
from domain.tokens.service import DATA_PURPOSE
from domain.webhooks.events import emit
from infra import jobs
from infra.dispatch import enqueue_after_commit
from infra.jobs import PermanentError, TransientError
from infra.lookup import get_owned
from providers.account_updates import MAX_ITEMS, AccountUpdatesClient, UpdateItem, UpdateResult, base_url
from storage import s3
from storage.crypto import DecryptionError, get_keyring
from storage.db import rowcount, session_scope
from storage.keyset import keyset_page
from storage.models import AuditLog, Tenant, Token, TokenMetadata
from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob
from storage.states import AccountUpdaterStatus, ChunkStatus
from storage.types import table_of, utcnow

log = logging.getLogger("tessera.account_updater")

PREPARE_TASK = "account_updater.prepare"
CHUNK_TASK = "account_updater.process_chunk"
FINISH_TASK = "account_updater.finish"
DETECT_TASK = "account_updater.detect"
#: The subject type of the platform jobs working on an account updater job (``Job.subject_type``).
SUBJECT = "account_updater_job"
COMPLETED_EVENT = "account-updater.job.completed"

REQUEST_COLUMNS = ("token", "expiration_year", "expiration_month", "merchant_id")
REQUEST_HEADER = ",".join(REQUEST_COLUMNS)
RESULT_COLUMNS = (
    "token",
    "expiration_year",
    "expiration_month",
    "new_token",
    "new_expiration_year",
    "new_expiration_month",
    "result_code",
)
RESULT_HEADER = ",".join(RESULT_COLUMNS)
KEY_PREFIX = "account-updater"

DOWNLOAD_SECONDS = 3600
"""How long a ``download_url`` handed out by a read stays valid."""
DETECT_EVERY_SECONDS = 2.0
"""A poll of a pending job asks a worker to look for its file at most this often."""
MAX_FILE_ERRORS = 10
"""Reading a bad file stops after this many messages."""
PART_BYTES = 8 * 1024 * 1024
"""Multipart upload part size of the result file (S3's minimum is 5 MiB except for the last part)."""
READ_BLOCK = 1024 * 1024
JOB_ENTITY = "account-updater-job"  # the log rows' entity type of jobs
UPDATE_PREFIX = "UPD_"
INVALID_TOKEN = "ERR_INVALID_TOKEN"  # noqa: S105 - a result code, not a secret
INVALID_EXP_DATE = "ERR_INVALID_EXP_DATE"
UNDEFINED = "ERR_UNDEFINED"
CARD_CONTAINERS = ["/pci/high/"]


# ---- S3 ------------------------------------------------------------------------------------------

_encrypted_buckets: set[str] = set()
_bucket_lock = threading.Lock()


def bucket() -> str:
    """The platform bucket (created when missing by ``storage.s3``) with default encryption ``AES256``
    set once per process, so the request files that clients PUT are encrypted at rest as well."""
    name = s3.bucket()
    if name not in _encrypted_buckets:
        with _bucket_lock:
            if name not in _encrypted_buckets:
                try:
                    s3.get_client().put_bucket_encryption(
                        Bucket=name,
                        ServerSideEncryptionConfiguration={
                            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
                        },
                    )
                except (ClientError, BotoCoreError):
                    log.warning("could not set default encryption on bucket %s", name, exc_info=True)
                _encrypted_buckets.add(name)
    return name


def request_key(tenant_id: uuid.UUID, job_id: uuid.UUID) -> str:
    """The S3 key of a job's request file."""
    return f"{KEY_PREFIX}/{tenant_id}/{job_id}/request.csv"


def result_key(tenant_id: uuid.UUID, job_id: uuid.UUID) -> str:
    """The S3 key of a job's result file."""
    return f"{KEY_PREFIX}/{tenant_id}/{job_id}/result.csv"


def job_id_of_key(key: str) -> uuid.UUID | None:
    """The job id inside a request file key (None for any other key)."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != KEY_PREFIX or parts[3] != "request.csv":
        return None
    try:
        uuid.UUID(parts[1])
        return uuid.UUID(parts[2])
    except ValueError:
        return None


def _s3_error(exc: Exception, what: str) -> Exception:
    """Classify an S3 failure: missing object or changed file -> permanent, anything else -> transient."""
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404"):
            return PermanentError("FILE_MISSING", f"The request file is gone ({what}).")
        if code in ("PreconditionFailed", "412"):
            return PermanentError("FILE_CHANGED", "The request file was replaced while the job was processing it.")
    return TransientError(f"S3 failed ({what}): {type(exc).__name__}")


def head_object(key: str) -> dict | None:
    """``HEAD`` of ``key``: ``{"size", "etag", "last_modified", "content_type"}``, None when there is no
    such object.

    Raises TransientError when S3 cannot answer.
    """
    try:
        head = s3.get_client().head_object(Bucket=bucket(), Key=key)
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _s3_error(exc, "head") from exc
    except BotoCoreError as exc:
        raise _s3_error(exc, "head") from exc
    return {
        "size": head["ContentLength"],
        "etag": head.get("ETag"),
        "last_modified": head.get("LastModified"),
        "content_type": head.get("ContentType"),
    }


#: Content types that some S3-compatible servers (moto's, in ``tessera dev``) read as an HTML form,
#: storing an empty object: ``curl --data-binary`` sends the first unless told otherwise.
FORM_CONTENT_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def empty_upload_error(content_type: str | None) -> str:
    """The job error of a request file that arrived empty: when it was uploaded as a form, say so and
    how to upload it instead."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in FORM_CONTENT_TYPES:
        return (
            f"The file arrived empty: it was uploaded with Content-Type {kind}, which the S3 server read as a "
            "form (curl --data-binary sends that type). Upload the file itself, e.g. "
            "curl -T request.csv '<upload_url>' or add -H 'Content-Type: text/csv'."
        )
    return f"The file is empty; its first line must be the header {REQUEST_HEADER}."


def _get_blocks(key: str, *, etag: str | None = None, byte_range: tuple[int, int] | None = None) -> Iterator[bytes]:
    """Stream an object (or bytes ``[start, end)`` of it) in blocks of about 1 MiB, pinned to ``etag``."""
    params: dict[str, Any] = {"Bucket": bucket(), "Key": key}
    if etag:
        params["IfMatch"] = etag
    if byte_range is not None:
        start, end = byte_range
        if end <= start:
            return
        params["Range"] = f"bytes={start}-{end - 1}"
    try:
        body = s3.get_client().get_object(**params)["Body"]
        try:
            yield from body.iter_chunks(READ_BLOCK)
        finally:
            body.close()
    except (ClientError, BotoCoreError) as exc:
        raise _s3_error(exc, "read") from exc


def delete_object(key: str) -> None:
    """Delete an object, best effort (logged when S3 refuses)."""
    try:
        s3.get_client().delete_object(Bucket=bucket(), Key=key)
    except (ClientError, BotoCoreError):
        log.warning("could not delete %s", key, exc_info=True)


# ---- the resource --------------------------------------------------------------------------------


def _live_pending(job: AccountUpdaterJob, now: dt.datetime) -> bool:
    return job.status == AccountUpdaterStatus.PENDING and job.expires_at > now


def _visible(job: AccountUpdaterJob, now: dt.datetime) -> bool:
    return job.status != AccountUpdaterStatus.PENDING or job.expires_at > now


def job_view(job: AccountUpdaterJob, *, now: dt.datetime | None = None) -> dict:
    """The job object (spec: Account updater job) plus ``progress``.

    Always: ``id, tenant_id, status, created_by, created_at, errors``. While pending: ``upload_url`` (a
    pre-signed PUT valid until ``expires_at``) and ``expires_at``. From processing on: ``progress``
    ``{rows_done, rows_total}`` (``rows_total`` null until the file has been read). When completed:
    ``download_url`` (a pre-signed GET valid :data:`DOWNLOAD_SECONDS` from this read).
    """
    now = now or utcnow()
    view: dict[str, Any] = {
        "id": job.id,
        "tenant_id": job.tenant_id,
        "status": job.status,
        "created_by": job.created_by,
        "created_at": job.created_at,
        "errors": list(job.errors or []),
    }
    if job.status == AccountUpdaterStatus.PENDING:
        remaining = max(1, math.ceil((job.expires_at - now).total_seconds()))
        bucket()
        view["upload_url"] = s3.presigned_url("PUT", job.request_key, expires_in=remaining)
        view["expires_at"] = job.expires_at
    else:
        view["progress"] = {"rows_done": job.rows_done, "rows_total": job.rows_total}
    if job.status == AccountUpdaterStatus.COMPLETED and job.result_key:
        bucket()
        view["download_url"] = s3.presigned_url("GET", job.result_key, expires_in=DOWNLOAD_SECONDS)
    return view


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
    jobs.record(
        session,
        kind=PREPARE_TASK,
        tenant_id=job.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(job.id),
        trace_id=job.trace_id,
    )
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
            .order_by(col(AccountUpdaterJob.checked_at).asc().nulls_first(), AccountUpdaterJob.created_at)
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
        target = record.get("s3") if isinstance(record.get("s3"), dict) else {}
        bucket_name = (target.get("bucket") or {}).get("name") if isinstance(target.get("bucket"), dict) else None
        key = (target.get("object") or {}).get("key") if isinstance(target.get("object"), dict) else None
        if bucket_name != name or not isinstance(key, str):
            continue
        job_id = job_id_of_key(unquote_plus(key))
        if job_id is not None:
            wanted.add(job_id)
    if not wanted:
        return 0
    now = utcnow()
    pending = session.scalars(
        select(AccountUpdaterJob.id).where(
            col(AccountUpdaterJob.id).in_(list(wanted)),
            AccountUpdaterJob.status == AccountUpdaterStatus.PENDING,
            AccountUpdaterJob.expires_at > now,
        )
    ).all()
    for job_id in pending:
        enqueue_after_commit(session, DETECT_TASK, job_id=str(job_id))
    return len(pending)


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


def _emit_outcome(session: Session, job: AccountUpdaterJob) -> None:
    emit(
        session,
        tenant_id=job.tenant_id,
        type=COMPLETED_EVENT,
        data={"job": {"id": str(job.id), "status": job.status}},
        trace_id=job.trace_id,
    )


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
    _emit_outcome(session, job)
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
    _emit_outcome(session, job)
    return True


# ---- reading the request file --------------------------------------------------------------------


class _Lines:
    """Lines of a byte stream (line endings kept, decoded as UTF-8) and the byte offset reached.

    ``position`` is the offset just after the last line handed out, so after ``csv.reader`` returns a
    record it is the offset where the next record starts. Raises :class:`_FileError` for bytes that are
    not UTF-8 text or that contain NUL.
    """

    def __init__(self, blocks: Iterable[bytes], *, start: int = 0, max_bytes: int | None = None, strip_bom=False):
        self._blocks = blocks
        self.position = start
        self.read = 0
        self._max = max_bytes
        self._strip_bom = strip_bom
        self.line_number = 0

    def __iter__(self) -> Iterator[str]:
        pending = b""
        first = True
        for block in self._blocks:
            self.read += len(block)
            if self._max is not None and self.read > self._max:
                raise _FileError(f"The file is over the limit of {self._max:,} bytes (30 MB).")
            buffer = pending + block if pending else block
            begin = 0
            while True:
                end = buffer.find(b"\n", begin)
                if end < 0:
                    break
                line = buffer[begin : end + 1]
                begin = end + 1
                if first:
                    first = False
                    if self._strip_bom and line.startswith(codecs.BOM_UTF8):
                        self.position += len(codecs.BOM_UTF8)
                        line = line[len(codecs.BOM_UTF8) :]
                yield self._text(line)
            pending = buffer[begin:]
        if pending:
            if first and self._strip_bom and pending.startswith(codecs.BOM_UTF8):
                self.position += len(codecs.BOM_UTF8)
                pending = pending[len(codecs.BOM_UTF8) :]
            yield self._text(pending)

    def _text(self, line: bytes) -> str:
        self.line_number += 1
        if b"\x00" in line:
            raise _FileError(f"The file is not a CSV text file: line {self.line_number} contains NUL bytes.")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise _FileError(f"The file is not a CSV text file: line {self.line_number} is not UTF-8 text.") from None
        self.position += len(line)
        return text


class _FileError(Exception):
    """A request file that cannot be processed (the message is shown in the job's ``errors``)."""


@dataclass
class ChunkPlan:
    """One chunk of a request file: bytes ``[start_byte, end_byte)``, data rows from ``first_row``."""

    start_byte: int
    end_byte: int
    first_row: int
    row_count: int


@dataclass
class Scan:
    """What reading a request file found: its columns, rows, chunks, ETag and size, or ``errors``."""

    columns: list[str] = field(default_factory=list)
    rows: int = 0
    chunks: list[ChunkPlan] = field(default_factory=list)
    etag: str | None = None
    size: int = 0
    errors: list[str] = field(default_factory=list)


def parse_header(record: list[str]) -> tuple[list[str], list[str]]:
    """``(columns, errors)`` of a header record: names trimmed and lower-cased; ``token`` required;
    the other known columns (``expiration_year``, ``expiration_month``, ``merchant_id``) optional, in any
    order; unknown or repeated names are errors."""
    columns = [name.strip().lower() for name in record]
    errors = []
    unknown = [name for name in columns if name not in REQUEST_COLUMNS]
    repeated = sorted({name for name in columns if columns.count(name) > 1})
    if "token" not in columns:
        errors.append(f"The header must name the column token; expected {REQUEST_HEADER}.")
    if unknown:
        errors.append(
            f"The header names unknown columns ({', '.join(repr(u) for u in unknown[:5])}); expected {REQUEST_HEADER}."
        )
    if repeated:
        errors.append(f"The header names a column more than once ({', '.join(repeated)}).")
    return columns, errors


def scan_request(blocks: Iterable[bytes], *, max_bytes: int, chunk_rows: int) -> Scan:
    """Read a request file once, as a stream: check it and cut it into chunks of ``chunk_rows`` rows.

    Checks: at most ``max_bytes``; UTF-8 text without NUL; parseable CSV; a header (see
    :func:`parse_header`); every row with as many fields as the header. Blank lines are skipped and not
    counted. Stops after :data:`MAX_FILE_ERRORS` messages. Memory use is one block and one record.
    """
    scan = Scan()
    lines = _Lines(blocks, max_bytes=max_bytes, strip_bom=True)
    reader = csv.reader(lines, strict=True)
    try:
        header = next(reader, None)
        while header == []:
            header = next(reader, None)
        if header is None:
            scan.errors.append(f"The file is empty; its first line must be the header {REQUEST_HEADER}.")
            return scan
        scan.columns, scan.errors = parse_header(header)
        if scan.errors:
            return scan
        width = len(scan.columns)
        chunk_start, chunk_first, in_chunk = lines.position, 1, 0
        for record in reader:
            if not record:
                continue
            scan.rows += 1
            if len(record) != width:
                scan.errors.append(
                    f"Row {scan.rows} (line {reader.line_num}) has {len(record)} fields; the header has {width}."
                )
                if len(scan.errors) >= MAX_FILE_ERRORS:
                    scan.errors.append(f"Reading stopped after {MAX_FILE_ERRORS} errors.")
                    return scan
                continue
            in_chunk += 1
            if in_chunk == chunk_rows:
                scan.chunks.append(ChunkPlan(chunk_start, lines.position, chunk_first, in_chunk))
                chunk_start, chunk_first, in_chunk = lines.position, scan.rows + 1, 0
        if in_chunk:
            scan.chunks.append(ChunkPlan(chunk_start, lines.position, chunk_first, in_chunk))
    except _FileError as exc:
        scan.errors.append(str(exc))
    except csv.Error as exc:
        scan.errors.append(f"The file is not valid CSV: {exc} (line {reader.line_num}).")
    scan.size = lines.read
    return scan


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
    scan = scan_request(_get_blocks(key, etag=head["etag"]), max_bytes=limit, chunk_rows=chunk_rows)
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
        jobs.record(
            session,
            kind=CHUNK_TASK,
            tenant_id=job.tenant_id,
            subject_type=SUBJECT,
            subject_id=str(job.id),
            subject_number=number,
            trace_id=job.trace_id,
        )
    if not scan.chunks:
        jobs.record(
            session,
            kind=FINISH_TASK,
            tenant_id=job.tenant_id,
            subject_type=SUBJECT,
            subject_id=str(job.id),
            trace_id=job.trace_id,
        )
    return {"rows": scan.rows, "chunks": len(scan.chunks)}


# ---- chunks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One data row of a request file (cells as written, trimmed)."""

    number: int
    token: str
    expiration_year: str
    expiration_month: str
    merchant_id: str


def read_rows(blocks: Iterable[bytes], columns: list[str], *, start: int, first_row: int) -> Iterator[Row]:
    """The data rows of one chunk's bytes, numbered from ``first_row`` (blank lines skipped, as in
    :func:`scan_request`)."""
    index = {name: position for position, name in enumerate(columns)}
    positions = [index.get(name) for name in REQUEST_COLUMNS]
    number = first_row
    for record in csv.reader(_Lines(blocks, start=start), strict=True):
        if not record:
            continue
        token, year, month, merchant = (
            record[p].strip() if p is not None and p < len(record) else "" for p in positions
        )
        yield Row(number, token, year, month, merchant)
        number += 1


def _two_digits(cell: str) -> int | None:
    return int(cell) if len(cell) == 2 and cell.isascii() and cell.isdigit() else None


def _yy(year: int | None) -> str:
    return "" if year is None else f"{year % 100:02d}"


def _mm(month: int | None) -> str:
    return "" if month is None else f"{month:02d}"


def new_token_id(seed: str, row_number: int) -> str:
    """The id of the token created for a row: a version-4-shaped uuid from SHA-256 of the job's secret
    seed and the row number, so a chunk run twice names the same tokens and nobody can guess them."""
    digest = bytearray(hashlib.sha256(f"{seed}:{row_number}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x40
    digest[8] = (digest[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(digest)))


@dataclass
class ChunkOutcome:
    """What processing one chunk produced, written by :func:`apply_chunk`: the result rows as CSV text,
    the rows of the new tokens (ready for a bulk insert), and counts."""

    rows: int
    result: bytes
    result_rows: int
    tokens: list[dict]
    skipped: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage (``read``, ``load``, ``network``, ``build``), kept in the job's result."""


@dataclass
class _Card:
    """A loaded card token: its plain data (its containers and metadata are read only for updates)."""

    data: dict
    containers: list = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


def tokens_by_ids(session: Session, tenant_id: uuid.UUID, ids: list[str], *columns):
    """``SELECT columns`` of the tenant's tokens among ``ids``, by primary key.

    On PostgreSQL the ids are joined as ``unnest(:ids)`` so every row is a primary-key lookup whatever the
    table statistics say (``IN (5000 values)`` lets the planner pick a scan of the tenant's tokens, ~3x
    slower); elsewhere a plain ``IN``.
    """
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import ARRAY

        ids_array = bindparam("token_ids", ids, type_=ARRAY(String))
        wanted = func.unnest(ids_array).table_valued("id").render_derived(name="wanted")
        return (
            select(*columns)
            .select_from(wanted)
            .join(Token, (col(Token.tenant_id) == tenant_id) & (col(Token.id) == wanted.c.id))
        )
    return select(*columns).where(col(Token.tenant_id) == tenant_id, col(Token.id).in_(ids))


def load_cards(session: Session, tenant_id: uuid.UUID, ids: Iterable[str], now: dt.datetime) -> dict[str, _Card]:
    """The live card tokens of the tenant among ``ids``, decrypted: one query for the whole chunk.

    Tokens of another type, expired ones and ones whose data does not open are left out (their rows are
    ``ERR_INVALID_TOKEN``).
    """
    wanted = [i for i in set(ids) if i and len(i) <= 400]
    if not wanted:
        return {}
    keyring = get_keyring()
    found: dict[str, _Card] = {}
    rows = session.execute(
        tokens_by_ids(session, tenant_id, wanted, Token.id, Token.data_ct, Token.expires_at).where(Token.type == "card")
    ).all()
    for token_id, data_ct, expires_at in rows:
        if expires_at is not None and expires_at <= now:
            continue
        try:
            data = json.loads(keyring.decrypt(session, tenant_id, DATA_PURPOSE, token_id, data_ct))
        except (DecryptionError, ValueError):
            log.warning("token %s of tenant %s does not open; reported as ERR_INVALID_TOKEN", token_id, tenant_id)
            continue
        if isinstance(data, dict) and isinstance(data.get("number"), str):
            found[token_id] = _Card(data)
    return found


def load_placements(session: Session, tenant_id: uuid.UUID, cards: dict[str, _Card]) -> None:
    """Fill in the containers and metadata of ``cards`` (the tokens that get a successor): one query."""
    if not cards:
        return
    for token_id, containers, metadata in session.execute(
        tokens_by_ids(session, tenant_id, list(cards), Token.id, Token.containers, Token.meta)
    ).all():
        cards[token_id].containers = list(containers or [])
        cards[token_id].metadata = dict(metadata or {})


@dataclass
class _Pending:
    row: Row
    card: _Card
    month: int | None
    year: int | None


def process_chunk(
    job_id: uuid.UUID, number: int, *, now: dt.datetime | None = None, client: AccountUpdatesClient | None = None
) -> ChunkOutcome:
    """A chunk's slow part (no transaction held while calling out): read its bytes from S3, load its
    tokens, ask the card network once, build its result rows and its new tokens (sealed under the
    tenant key). Returns a skipped outcome when the job has ended or the chunk is done already.

    Raises TransientError (S3 or network unavailable: retried) or PermanentError (file changed or gone,
    the network refusing the call, production without a network: the job fails).
    """
    now = now or utcnow()
    clock = _Clock()
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        chunk = session.get(AccountUpdaterChunk, (job_id, number))
        if (
            job is None
            or chunk is None
            or job.status != AccountUpdaterStatus.PROCESSING
            or chunk.status != ChunkStatus.PENDING
        ):
            return ChunkOutcome(0, b"", 0, [], skipped=True)
        tenant = session.get(Tenant, job.tenant_id)
        tenant_type = tenant.type if tenant else "test"
        job_info = (
            job.tenant_id,
            job.request_key,
            job.request_etag,
            list(job.columns or []),
            job.id_seed,
            job.created_by,
        )
        span = (chunk.start_byte, chunk.end_byte, chunk.first_row)
    tenant_id, key, etag, columns, seed, created_by = job_info
    start, end, first_row = span
    rows = list(
        read_rows(_get_blocks(key, etag=etag, byte_range=(start, end)), columns, start=start, first_row=first_row)
    )
    clock.lap("read")
    with session_scope() as session:
        cards = load_cards(session, tenant_id, (row.token for row in rows), now)
    clock.lap("load")

    results: dict[int, tuple[Row, str, int | None, int | None]] = {}  # row number -> (row, code, year, month)
    pending: list[_Pending] = []
    for row in rows:
        year_cell, month_cell = _two_digits(row.expiration_year), _two_digits(row.expiration_month)
        card = cards.get(row.token)
        if card is None:
            results[row.number] = (row, INVALID_TOKEN, None, None)
            continue
        if row.expiration_year or row.expiration_month:
            if year_cell is None or month_cell is None:
                results[row.number] = (row, INVALID_EXP_DATE, None, None)
                continue
            year, month = 2000 + year_cell, month_cell
        else:
            year, month = card.data.get("expiration_year"), card.data.get("expiration_month")
            if type(year) is not int or type(month) is not int:
                year = month = None
        pending.append(_Pending(row, card, month, year))

    answers: list[UpdateResult] = []
    if pending:
        client = client or AccountUpdatesClient(tenant_type)
        items = [
            UpdateItem(str(p.row.number), p.card.data["number"], p.month, p.year, p.row.merchant_id or None)
            for p in pending
        ]
        answers = client.updates(items, idempotency_key=f"{job_id}:{number}")
    clock.lap("network")

    new_tokens: dict[int, tuple[str, int | None, int | None]] = {}
    token_rows: list[dict] = []
    with session_scope() as session:
        keyring = get_keyring()
        load_placements(
            session,
            tenant_id,
            {
                item.row.token: item.card
                for item, answer in zip(pending, answers, strict=True)
                if answer.code and answer.code.startswith(UPDATE_PREFIX)
            },
        )
        for item, answer in zip(pending, answers, strict=True):
            code = answer.code
            results[item.row.number] = (item.row, code, item.year, item.month) if code else None
            if not code or not code.startswith(UPDATE_PREFIX):
                continue
            new_month = answer.new_expiration_month
            new_year = answer.new_expiration_year
            pan = answer.new_pan or item.card.data["number"]
            if answer.new_pan is None and new_month is None:
                continue  # an update without anything new: reported without a new token
            data: dict[str, Any] = {"number": pan}
            if new_month is not None and new_year is not None:
                data["expiration_month"], data["expiration_year"] = new_month, new_year
            if isinstance(item.card.data.get("name"), str):
                data["name"] = item.card.data["name"]
            valid, problems = validate_card(data, today=now.date())
            if problems:
                results[item.row.number] = (item.row, UNDEFINED, item.year, item.month)
                continue
            token_id = new_token_id(seed, item.row.number)
            token_rows.append(_token_row(session, keyring, tenant_id, token_id, valid, item.card, created_by, now))
            new_tokens[item.row.number] = (token_id, valid.get("expiration_year"), valid.get("expiration_month"))

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    count = 0
    for row_number in sorted(n for n, value in results.items() if value):
        row, code, year, month = results[row_number]
        if code in (INVALID_TOKEN, INVALID_EXP_DATE) and year is None:
            year_out, month_out = row.expiration_year, row.expiration_month
        else:
            year_out, month_out = _yy(year), _mm(month)
        created = new_tokens.get(row_number)
        if created:
            writer.writerow((row.token, year_out, month_out, created[0], _yy(created[1]), _mm(created[2]), code))
        else:
            writer.writerow((row.token, year_out, month_out, "", "", "", code))
        count += 1
    clock.lap("build")
    return ChunkOutcome(len(rows), buffer.getvalue().encode(), count, token_rows, seconds=clock.laps)


class _Clock:
    """Wall time of successive stages."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 4)
        self._last = now


def _token_row(
    session: Session,
    keyring,
    tenant_id: uuid.UUID,
    token_id: str,
    data: dict,
    old: _Card,
    created_by: uuid.UUID | None,
    now: dt.datetime,
) -> dict:
    """The ``tokens`` row of a new card token, as ``domain.tokens.service.create_tokens`` writes one for the
    request ``{"type": "card", "data": data, "containers": <old>, "metadata": <old>}``: data sealed
    under the tenant key, default card mask, default fingerprint expression and its fingerprint."""
    plain = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    containers = list(dict.fromkeys(old.containers)) or list(CARD_CONTAINERS)
    if any(not str(c).startswith("/pci/") for c in containers):
        containers = list(CARD_CONTAINERS)
    return {
        "tenant_id": tenant_id,
        "id": token_id,
        "type": "card",
        "data_ct": keyring.encrypt(session, tenant_id, DATA_PURPOSE, token_id, plain),
        "mask": default_card_mask(),
        "containers": containers,
        "metadata": dict(old.metadata),
        "search_indexes": [],
        "fingerprint": keyring.fingerprint(session, tenant_id, data["number"]),
        "fingerprint_expression": DEFAULT_FINGERPRINT_EXPRESSIONS["card"],
        "deduplicate_token": None,
        "parent_id": None,
        "created_by": created_by,
        "created_at": now,
        "modified_by": None,
        "modified_at": None,
        "expires_at": None,
        "cvc_expires_at": None,
    }


def bulk_insert(session: Session, table, rows: list[dict], *, ignore_conflicts: bool = False) -> None:
    """Insert ``rows`` (dicts keyed by column) into ``table`` in the session's transaction, in bulk.

    PostgreSQL: ``psycopg2.extras.execute_values`` (one multi-row statement per 1,000 rows; about twice as
    fast as SQLAlchemy's executemany), each value passed through its column type's bind processor so the
    stored values are those SQLAlchemy would write. Elsewhere (SQLite): SQLAlchemy's executemany.
    ``ignore_conflicts`` skips rows whose key exists (``ON CONFLICT DO NOTHING``).
    """
    if not rows:
        return
    dialect = session.get_bind().dialect
    if dialect.name == "postgresql":
        from psycopg2.extras import execute_values

        names = list(rows[0])
        processors = [table.c[name].type.bind_processor(dialect) for name in names]
        values = []
        for row in rows:
            line = []
            for name, process in zip(names, processors, strict=True):
                value = row[name]
                if process is not None and value is not None:
                    value = process(value)
                line.append(str(value) if isinstance(value, uuid.UUID) else value)
            values.append(tuple(line))
        columns = ", ".join(f'"{name}"' for name in names)
        conflict = " ON CONFLICT DO NOTHING" if ignore_conflicts else ""
        cursor = session.connection().connection.driver_connection.cursor()
        try:
            execute_values(
                cursor,
                f'INSERT INTO "{table.name}" ({columns}) VALUES %s{conflict}',  # noqa: S608 - names come from the table
                values,
                page_size=1000,
            )
        finally:
            cursor.close()
        return
    if ignore_conflicts:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        session.execute(sqlite_insert(table).on_conflict_do_nothing(), rows)
    else:
        session.execute(insert(table), rows)


def _token_created_events(
    session: Session, tenant_id: uuid.UUID, token_ids: list[str], trace_id: str | None, now: dt.datetime
) -> None:
    """``token.created`` for each new token, in bulk (``domain.webhooks.events.emit`` of a list)."""
    emit(
        session,
        tenant_id=tenant_id,
        type="token.created",
        trace_id=trace_id,
        data=[{"token": {"id": token_id, "type": "card"}} for token_id in token_ids],
    )


def apply_chunk(
    session: Session, job_id: uuid.UUID, number: int, outcome: ChunkOutcome, *, now: dt.datetime | None = None
) -> dict:
    """A chunk's transaction: lock the job, claim the chunk, write its tokens (with their metadata
    rows, log rows and ``token.created`` events), its result rows and the job's counters; record the
    final step when this was the last chunk. A chunk already claimed, or a job that has ended, writes
    nothing (``{"skipped": True}``)."""
    now = now or utcnow()
    if outcome.skipped:
        return {"skipped": True}
    clock = _Clock()
    job = session.get(AccountUpdaterJob, job_id, with_for_update=True, populate_existing=True)
    if job is None or job.status != AccountUpdaterStatus.PROCESSING:
        return {"skipped": True}
    clock.lap("lock")
    claimed = rowcount(
        session.execute(
            update(AccountUpdaterChunk)
            .where(
                col(AccountUpdaterChunk.job_id) == job_id,
                col(AccountUpdaterChunk.number) == number,
                col(AccountUpdaterChunk.status) == ChunkStatus.PENDING,
            )
            .values(
                status=ChunkStatus.DONE,
                result=outcome.result,
                result_rows=outcome.result_rows,
                new_tokens=len(outcome.tokens),
                done_at=now,
            )
            .execution_options(synchronize_session=False)
        )
    )
    if not claimed:
        return {"skipped": True}
    tokens = outcome.tokens
    bulk_insert(session, table_of(Token), tokens, ignore_conflicts=True)
    bulk_insert(
        session,
        table_of(TokenMetadata),
        ignore_conflicts=True,
        rows=[
            {"tenant_id": t["tenant_id"], "token_id": t["id"], "key": k, "value": v}
            for t in tokens
            for k, v in t["metadata"].items()
        ],
    )
    bulk_insert(
        session,
        table_of(AuditLog),
        [
            {
                "id": uuid.uuid4(),
                "tenant_id": job.tenant_id,
                "actor_id": job.created_by,
                "actor_type": "application",
                "entity_type": "card",
                "entity_id": t["id"],
                "operation": "create",
                "message": "Card created",
                "created_at": now,
            }
            for t in tokens
        ],
    )
    _token_created_events(session, job.tenant_id, [t["id"] for t in tokens], job.trace_id, now)
    job.chunks_done += 1
    job.rows_done += outcome.rows
    job.modified_at = now
    session.add(job)
    if job.chunks_done >= (job.chunks_total or 0):
        jobs.record(
            session,
            kind=FINISH_TASK,
            tenant_id=job.tenant_id,
            subject_type=SUBJECT,
            subject_id=str(job.id),
            trace_id=job.trace_id,
        )
    session.flush()
    clock.lap("write")
    return {
        "rows": outcome.rows,
        "results": outcome.result_rows,
        "new_tokens": len(tokens),
        "seconds": {**outcome.seconds, **clock.laps},
    }


# ---- the result file -----------------------------------------------------------------------------


def write_result(job_id: uuid.UUID) -> str | None:
    """The final step's slow part: stream the header and every chunk's stored rows, in order, to S3 as a
    multipart upload (parts of :data:`PART_BYTES`, SSE ``AES256``); returns the key (None when the job
    has ended). Memory holds one part. Raises TransientError when S3 fails (the upload is aborted)."""
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        if job is None or job.status != AccountUpdaterStatus.PROCESSING:
            return None
        key = result_key(job.tenant_id, job.id)
        chunks = job.chunks_total or 0
    client = s3.get_client()
    name = bucket()
    try:
        upload = client.create_multipart_upload(
            Bucket=name, Key=key, ServerSideEncryption="AES256", ContentType="text/csv"
        )
    except (ClientError, BotoCoreError) as exc:
        raise _s3_error(exc, "result upload") from exc
    upload_id, parts = upload["UploadId"], []

    def send(body: bytes) -> None:
        answer = client.upload_part(Bucket=name, Key=key, UploadId=upload_id, PartNumber=len(parts) + 1, Body=body)
        parts.append({"PartNumber": len(parts) + 1, "ETag": answer["ETag"]})

    try:
        buffer = bytearray((RESULT_HEADER + "\r\n").encode())
        for number in range(chunks):
            with session_scope() as session:
                blob = session.execute(
                    select(AccountUpdaterChunk.result).where(
                        AccountUpdaterChunk.job_id == job_id, AccountUpdaterChunk.number == number
                    )
                ).scalar_one_or_none()
            buffer += blob or b""
            if len(buffer) >= PART_BYTES:
                send(bytes(buffer))
                buffer.clear()
        send(bytes(buffer))
        client.complete_multipart_upload(Bucket=name, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    except (ClientError, BotoCoreError) as exc:
        try:
            client.abort_multipart_upload(Bucket=name, Key=key, UploadId=upload_id)
        except (ClientError, BotoCoreError):
            log.warning("could not abort the result upload of job %s", job_id, exc_info=True)
        raise _s3_error(exc, "result upload") from exc
    return key
