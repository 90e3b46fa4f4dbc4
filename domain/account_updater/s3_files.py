"""Where an account updater job's files live in S3 (second document, section 4 "Account updater jobs"):
the platform bucket (encrypted by default), the keys ``account-updater/<tenant>/<job>/request.csv`` and
``.../result.csv``, and the reads the steps make of them (``HEAD``, streamed and ranged ``GET``).

S3 failures are classified for the job steps: a missing or replaced file is an
``infra.jobs.PermanentError`` (the job fails), anything else an ``infra.jobs.TransientError`` (retried).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from infra.jobs import PermanentError, TransientError
from storage import s3

log = logging.getLogger("tessera.account_updater")

KEY_PREFIX = "account-updater"
READ_BLOCK = 1024 * 1024
"""Bytes per block of a streamed read."""

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


def s3_error(exc: Exception, what: str) -> Exception:
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
        raise s3_error(exc, "head") from exc
    except BotoCoreError as exc:
        raise s3_error(exc, "head") from exc
    return {
        "size": head["ContentLength"],
        "etag": head.get("ETag"),
        "last_modified": head.get("LastModified"),
        "content_type": head.get("ContentType"),
    }


def get_blocks(key: str, *, etag: str | None = None, byte_range: tuple[int, int] | None = None) -> Iterator[bytes]:
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
        raise s3_error(exc, "read") from exc


def presigned_url(method: str, key: str, *, expires_in: int) -> str:
    """A pre-signed ``method`` (``PUT`` or ``GET``) URL of ``key`` in the platform bucket, valid
    ``expires_in`` seconds (the bucket's default encryption set first, see :func:`bucket`)."""
    bucket()
    return s3.presigned_url(method, key, expires_in=expires_in)


def delete_object(key: str) -> None:
    """Delete an object, best effort (logged when S3 refuses)."""
    try:
        s3.get_client().delete_object(Bucket=bucket(), Key=key)
    except (ClientError, BotoCoreError):
        log.warning("could not delete %s", key, exc_info=True)
