"""The result rows of account updater jobs and the result file (second document, section 4 "Account
updater jobs": result codes; ``spec/SANDBOX.md``, account updater table).

Each chunk stores its result rows as CSV text (:func:`chunk_result`); the final step streams the
header and every chunk's rows, in order, to S3 (:func:`write_result`). ``UPD_*`` rows report the new
token, ``WRN_*``/``ERR_*`` rows their code; rows without an update are omitted. The file holds token
ids, two-digit expirations and codes only: never card data.
"""

from __future__ import annotations

import csv
import io
import logging
import uuid
from collections.abc import Mapping

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import select
from sqlmodel import col

from domain.account_updater.csv_files import RESULT_HEADER, Row
from domain.account_updater.s3_files import bucket, result_key, s3_error
from storage import s3
from storage.db import session_scope
from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob
from storage.states import AccountUpdaterStatus

log = logging.getLogger("tessera.account_updater")

UPDATE_PREFIX = "UPD_"
INVALID_TOKEN = "ERR_INVALID_TOKEN"  # noqa: S105 - a result code, not a secret
INVALID_EXP_DATE = "ERR_INVALID_EXP_DATE"
UNDEFINED = "ERR_UNDEFINED"
PART_BYTES = 8 * 1024 * 1024
"""Multipart upload part size of the result file (S3's minimum is 5 MiB except for the last part)."""

#: A row's outcome: ``(row, result code, expiration year, expiration month)`` (the expiration sent to
#: the network; None when none was).
Outcome = tuple[Row, str, int | None, int | None]
#: A new token of a row: ``(token id, expiration year, expiration month)``.
NewCard = tuple[str, int | None, int | None]


def _yy(year: int | None) -> str:
    return "" if year is None else f"{year % 100:02d}"


def _mm(month: int | None) -> str:
    return "" if month is None else f"{month:02d}"


def chunk_result(outcomes: Mapping[int, Outcome], new_tokens: Mapping[int, NewCard]) -> tuple[bytes, int]:
    """The result rows of one chunk as CSV text without a header (``\\r\\n`` line ends), in row order,
    and their count. ``outcomes`` and ``new_tokens`` are keyed by row number. Expirations are two
    digits: the ones sent to the network, or the row's cells as written for a row refused before
    (``ERR_INVALID_TOKEN``, ``ERR_INVALID_EXP_DATE``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    count = 0
    for row_number in sorted(outcomes):
        row, code, year, month = outcomes[row_number]
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
    return buffer.getvalue().encode(), count


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
        raise s3_error(exc, "result upload") from exc
    upload_id = upload["UploadId"]
    parts: list[dict[str, object]] = []

    def send(body: bytes) -> None:
        answer = client.upload_part(Bucket=name, Key=key, UploadId=upload_id, PartNumber=len(parts) + 1, Body=body)
        parts.append({"PartNumber": len(parts) + 1, "ETag": answer["ETag"]})

    try:
        buffer = bytearray((RESULT_HEADER + "\r\n").encode())
        for number in range(chunks):
            with session_scope() as session:
                blob = session.execute(
                    select(col(AccountUpdaterChunk.result)).where(
                        col(AccountUpdaterChunk.job_id) == job_id, col(AccountUpdaterChunk.number) == number
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
        raise s3_error(exc, "result upload") from exc
    return key
