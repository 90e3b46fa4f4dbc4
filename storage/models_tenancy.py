"""Tables of tenancy: invitations and token activity (core document section 2).

* ``tenant_invitations``: an invitation of an email address to a tenant with a role; its status is
  ``PENDING`` or ``EXPIRED`` (an accepted invitation becomes a tenant member and is removed).
* ``tenant_invitation_links``: every acceptance link ever mailed for an invitation. The link token is
  never stored: only its SHA-256 digest (``token_digest``). A link is ``active`` until it is
  ``superseded`` (a resend), ``revoked`` (the invitation was deleted) or ``used`` (accepted).
* ``token_activity``: one row per (tenant, calendar month, token) that was created, read or used in
  that month: the exact count of monthly active tokens of the usage report.

Client encryption keys are in :mod:`storage.models_client_keys`, documents in :mod:`storage.models_documents`.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import Column, Date, ForeignKey, Index, String
from sqlmodel import Field, SQLModel

from storage.states import InvitationLinkStatus, InvitationStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class TenantInvitation(SQLModel, table=True):
    """An invitation to join a tenant (core document section 2, Invitation; section 3 states)."""

    __tablename__ = "tenant_invitations"
    __table_args__ = (
        Index("ix_tenant_invitations_list", "tenant_id", "created_at", "id"),
        Index("ix_tenant_invitations_due", "status", "expires_at"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    email: str = Field(max_length=320)
    role: str = Field(max_length=16)  # ADMIN | READ_ONLY
    status: InvitationStatus = Field(default=InvitationStatus.PENDING, sa_type=state_type())
    expires_at: dt.datetime = Field(sa_column=_ts())
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class InvitationLink(SQLModel, table=True):
    """One acceptance link mailed for an invitation; the token is kept only as its SHA-256 digest.

    ``invitation_id`` has no foreign key on purpose: the row outlives a deleted or accepted
    invitation so that its link answers "withdrawn" or "already used" rather than "unknown".
    """

    __tablename__ = "tenant_invitation_links"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    invitation_id: uuid.UUID = Field(index=True)
    token_digest: str = Field(sa_column=Column(String(64), nullable=False, unique=True))
    status: InvitationLinkStatus = Field(default=InvitationLinkStatus.ACTIVE, sa_type=state_type())
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    mailed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    used_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class TokenActivity(SQLModel, table=True):
    """A token that was active (created, read or used) in a calendar month (UTC), counted once."""

    __tablename__ = "token_activity"

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    month: dt.date = Field(sa_column=Column(Date, primary_key=True))  # the first day of the month
    token_id: str = Field(sa_column=Column(String(400), primary_key=True))
