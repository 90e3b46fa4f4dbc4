"""The public dict shapes of account updater jobs returned to the API (second document: "Account updater
job")."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from domain.account_updater.s3_files import presigned_url
from storage.models_account_updater import AccountUpdaterJob
from storage.states import AccountUpdaterStatus
from storage.types import utcnow

DOWNLOAD_SECONDS = 3600
"""How long a ``download_url`` handed out by a read stays valid."""


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
        view["upload_url"] = presigned_url("PUT", job.request_key, expires_in=remaining)
        view["expires_at"] = job.expires_at
    else:
        view["progress"] = {"rows_done": job.rows_done, "rows_total": job.rows_total}
    if job.status == AccountUpdaterStatus.COMPLETED and job.result_key:
        view["download_url"] = presigned_url("GET", job.result_key, expires_in=DOWNLOAD_SECONDS)
    return view
