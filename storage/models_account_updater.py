"""Tables: Account updater jobs and their chunks (second document: Account updater job).

* :class:`AccountUpdaterJob` is the resource of ``/account-updater/jobs``: its state
  (``pending`` -> ``processing`` -> ``completed`` | ``failed``), where its files live in S3, its error
  messages and its progress counters (``rows_done`` of ``rows_total``, ``chunks_done`` of
  ``chunks_total``).
* :class:`AccountUpdaterChunk` is one slice of the request file (a byte range of the S3 object, so a
  worker reads only its slice) and, once processed, that slice's result rows as CSV text (token ids,
  two-digit expirations and result codes only: never card data). A chunk is claimed ``pending`` ->
  ``done`` in the transaction that writes its new tokens, its result and the job's counters, so a
  chunk run twice counts and creates once.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, LargeBinary, String
from sqlmodel import Field, SQLModel

from storage.states import AccountUpdaterStatus, ChunkStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class AccountUpdaterJob(SQLModel, table=True):
    """An account updater job of a tenant (spec: Account updater job).

    ``expires_at`` ends the upload window (creation + ``TESSERA_ACCOUNT_UPDATER_UPLOAD_SECONDS``);
    ``id_seed`` (32 hex characters, random) derives the ids of the tokens the job creates, so a chunk
    run twice names the same tokens. ``columns`` is the request file's header in file order.
    """

    __tablename__ = "account_updater_jobs"
    __table_args__ = (
        Index("ix_account_updater_jobs_list", "tenant_id", "created_at", "id"),
        Index("ix_account_updater_jobs_status", "status", "expires_at"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    status: AccountUpdaterStatus = Field(default=AccountUpdaterStatus.PENDING, sa_type=state_type())
    request_key: str = Field(max_length=1024)
    result_key: str | None = Field(default=None, max_length=1024)
    request_etag: str | None = Field(default=None, max_length=200)
    request_bytes: int | None = None
    columns: list | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    errors: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    rows_total: int | None = None
    rows_done: int = 0
    chunks_total: int | None = None
    chunks_done: int = 0
    id_seed: str = Field(sa_column=Column(String(32), nullable=False))
    trace_id: str | None = Field(default=None, max_length=64)
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    expires_at: dt.datetime = Field(sa_column=_ts())
    checked_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    started_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    completed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class AccountUpdaterChunk(SQLModel, table=True):
    """One slice of a job's request file: bytes ``[start_byte, end_byte)`` holding data rows
    ``first_row`` .. ``first_row + row_count - 1`` (1-based, the header excluded, blank lines skipped).

    ``result`` holds the slice's result rows as CSV text without a header once ``status`` is ``done``
    (emptied when the job's result file is written).
    """

    __tablename__ = "account_updater_chunks"

    job_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("account_updater_jobs.id", ondelete="CASCADE"), primary_key=True)
    )
    number: int = Field(primary_key=True)
    start_byte: int
    end_byte: int
    first_row: int
    row_count: int
    status: ChunkStatus = Field(default=ChunkStatus.PENDING, sa_type=state_type())
    result: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    result_rows: int = 0
    new_tokens: int = 0
    done_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
