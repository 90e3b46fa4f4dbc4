"""Table of client encryption keys (core document section 2).

* ``client_encryption_keys``: X25519 key pairs for JWE ``ECDH-ES``; only the private key is kept,
  sealed under the tenant's data key (``private_key_ct``), and destroyed after expiry or deletion.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import Column, ForeignKey, LargeBinary
from sqlmodel import Field, SQLModel

from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class ClientEncryptionKey(SQLModel, table=True):
    """A client encryption key (core document section 2): the sealed X25519 private key and its life.

    ``private_key_ct`` is None once the key material was destroyed (after expiry or deletion).
    """

    __tablename__ = "client_encryption_keys"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    private_key_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    expires_at: dt.datetime = Field(sa_column=_ts(index=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    deleted_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    destroyed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
