"""Table of documents (core document section 2).

* ``documents``: an uploaded file, encrypted in chunks under the tenant's data key and stored in S3
  under ``object_key``; ``status`` is ``uploading``, ``ready`` or ``deleted``.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, BigInteger, Column, ForeignKey, Index, Integer
from sqlmodel import Field, SQLModel

from storage.states import DocumentStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class Document(SQLModel, table=True):
    """An encrypted document (core document section 2): metadata here, content in S3.

    The content is cut into plaintext chunks of ``chunk_size`` bytes, each sealed with AES-256-GCM
    under the tenant's data key of version ``key_version``; ``chunk_count`` and ``size`` (plaintext
    bytes) let a reader detect a truncated object. ``upload_id`` is the S3 multipart upload while
    ``status`` is ``uploading``. A key rotation writes the content again under the new version, to a
    new ``object_key``.
    """

    __tablename__ = "documents"
    __table_args__ = (Index("ix_documents_sweep", "status", "created_at"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    meta: dict = Field(default_factory=dict, sa_column=Column("metadata", JSON, nullable=False))
    content_type: str = Field(max_length=255)
    size: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    chunk_size: int
    chunk_count: int = 0
    object_key: str = Field(max_length=1024)
    upload_id: str | None = Field(default=None, max_length=1024)
    key_version: int = Field(default=1, sa_column=Column(Integer, nullable=False, server_default="1"))
    status: DocumentStatus = Field(default=DocumentStatus.UPLOADING, sa_type=state_type())
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    deleted_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
