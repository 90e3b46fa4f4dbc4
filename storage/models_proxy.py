"""Tables: pre-configured proxies (core document section 4, Proxy; the management endpoints are ours).

* ``proxies``: a named destination with its request and response transforms. ``configuration`` (a map
  of strings the transforms read, typically destination credentials) is sealed under the tenant's
  data key (``configuration_ct``, :mod:`storage.crypto`, purpose ``proxy-configuration``). The proxy
  key callers send in ``<prefix>-PROXY-KEY`` is never stored: only its SHA-256 digest
  (``key_digest``), unique across tenants so that an anonymous call finds its proxy by the key alone.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, LargeBinary, String
from sqlmodel import Field, SQLModel

from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class Proxy(SQLModel, table=True):
    """A pre-configured proxy of a tenant.

    ``request_transforms`` / ``response_transforms`` are the validated transform objects as JSON
    arrays (``domain.proxy.transforms``); ``require_auth`` False lets a caller holding only the proxy
    key invoke it; ``application_id`` names the application whose permissions apply to such callers.
    """

    __tablename__ = "proxies"
    __table_args__ = (Index("ix_proxies_list", "tenant_id", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    name: str = Field(max_length=200)
    destination_url: str = Field(sa_column=Column(String(2048), nullable=False))
    request_transforms: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    response_transforms: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    configuration_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    require_auth: bool = True
    application_id: uuid.UUID | None = Field(
        default=None,
        sa_column=Column(ForeignKey("applications.id", ondelete="SET NULL"), nullable=True),
    )
    key_digest: str = Field(sa_column=Column(String(64), nullable=False, unique=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
