"""Tables: agentic allowances, their rails and payment credentials (second document, section 7).

* :class:`Allowance` (``alw_`` ids): spending authority backed by a payment method. Its four amounts
  are exact decimals (``NUMERIC(19, 4)``) in one ``currency``; the database itself enforces
  ``amount_available + amount_reserved + amount_spent = amount`` and that none is negative, so no
  crash, race or bug can make the money stop adding up.
* :class:`AllowanceRail`: one per rail of the payment method, with the provider's allowance.
* :class:`PaymentCredential` (``pcr_`` ids): a mint. Its row is written when the amount is reserved
  (``state`` ``minting``), and becomes ``issued`` when the provider answered; the credential value is
  never stored readable: ``sealed`` holds it encrypted (AES-256-GCM, the tenant's data key) only
  between the worker's commit and the answer to the request, which clears it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

from sqlalchemy import JSON, CheckConstraint, Column, ForeignKey, Index, LargeBinary, Numeric, String, UniqueConstraint
from sqlmodel import Field, SQLModel

from storage.states import AllowanceRailStatus, AllowanceStatus, CredentialState
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _now

#: Exact decimals: 15 integer digits and 4 decimals (what the providers take).
MONEY = Numeric(19, 4, asdecimal=True)


def _money(nullable: bool = False) -> Column:
    return Column(MONEY, nullable=nullable)


class Allowance(SQLModel, table=True):
    """An allowance: ``status`` ``pending_verification``, ``active``, ``cancelled`` or ``expired``.

    ``operation`` names the change a worker is making (``update``, ``cancel``) with its values in
    ``pending_update`` (the provider is asked first; the row changes only when every provider
    agreed). ``delete_requested_at`` is set when a cancellation starts and stays set while one stopped
    half-way (the next DELETE resumes it). ``reserved_by`` is the credential whose mint holds
    ``amount_reserved`` (under the ``mint`` operation lease).
    """

    __tablename__ = "agentic_allowances"
    __table_args__ = (
        CheckConstraint(
            "amount_available + amount_reserved + amount_spent = amount", name="ck_agentic_allowances_balance"
        ),
        CheckConstraint(
            "amount > 0 AND amount_available >= 0 AND amount_reserved >= 0 AND amount_spent >= 0",
            name="ck_agentic_allowances_non_negative",
        ),
        Index("ix_agentic_allowances_list", "tenant_id", "created_at", "id"),
        Index("ix_agentic_allowances_payment_method", "payment_method_id", "status"),
        Index("ix_agentic_allowances_reserved", "amount_reserved"),
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_agentic_allowances_idempotency_key"),
    )

    id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    payment_method_id: str = Field(
        sa_column=Column(String(40), ForeignKey("agentic_payment_methods.id", ondelete="CASCADE"), nullable=False)
    )
    status: AllowanceStatus = Field(default=AllowanceStatus.PENDING_VERIFICATION, sa_type=state_type(24))
    currency: str = Field(sa_column=Column(String(3), nullable=False))
    amount: Decimal = Field(sa_column=_money())
    amount_available: Decimal = Field(sa_column=_money())
    amount_reserved: Decimal = Field(default=Decimal(0), sa_column=_money())
    amount_spent: Decimal = Field(default=Decimal(0), sa_column=_money())
    reserved_by: str | None = Field(default=None, max_length=40)
    description: str | None = Field(default=None, max_length=1000)
    expires_at: dt.datetime = Field(sa_column=_ts())
    idempotency_key: str | None = Field(default=None, max_length=255)
    operation: str | None = Field(default=None, max_length=16)
    pending_update: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    delete_requested_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    updated_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())


class AllowanceRail(SQLModel, table=True):
    """One rail of an allowance: ``status`` ``active``, ``inactive`` (awaiting verification) or
    ``error`` (``error_code``); ``setting_up`` while its setup job runs. ``provider_allowance_id`` is
    the provider's allowance; ``enrollment_id`` the payment method rail's enrollment it was set up
    on. ``verification`` is ``None``, ``otp_sent``, ``verified`` or ``failed``; ``otp_sealed`` the
    code being submitted (encrypted, cleared by the job). ``cancelled_at`` is set once the provider
    cancelled it (the cascade resumes with the rails still to do). ``job_id`` the job working on it.
    """

    __tablename__ = "agentic_allowance_rails"
    __table_args__ = (
        UniqueConstraint("allowance_id", "rail", "provider", name="uq_agentic_allowance_rails_pair"),
        Index("ix_agentic_allowance_rails_allowance", "allowance_id", "position"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    allowance_id: str = Field(
        sa_column=Column(String(40), ForeignKey("agentic_allowances.id", ondelete="CASCADE"), nullable=False)
    )
    position: int = 0
    rail: str = Field(max_length=32)
    provider: str = Field(max_length=32)
    status: AllowanceRailStatus = Field(default=AllowanceRailStatus.SETTING_UP, sa_type=state_type())
    error_code: str | None = Field(default=None, max_length=64)
    provider_ids: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    enrollment_id: str | None = Field(default=None, max_length=255)
    provider_allowance_id: str | None = Field(default=None, max_length=255)
    verification: str | None = Field(default=None, max_length=16)
    otp_sealed: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    cancelled_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    job_id: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    updated_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())


class PaymentCredential(SQLModel, table=True):
    """A mint of an allowance (``pcr_`` ids): ``state`` ``minting`` (reserved, the provider not yet
    answered), ``issued`` or ``failed``. An unknown outcome deletes the row (no credential record
    exists; the amount is spent). ``mpp`` holds ``{key_set_url, challenge}`` for an ``mpp`` mint."""

    __tablename__ = "agentic_payment_credentials"
    __table_args__ = (
        CheckConstraint("amount > 0", name="ck_agentic_payment_credentials_amount"),
        Index("ix_agentic_payment_credentials_allowance", "allowance_id", "created_at"),
    )

    id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    allowance_id: str = Field(
        sa_column=Column(String(40), ForeignKey("agentic_allowances.id", ondelete="CASCADE"), nullable=False)
    )
    rail: str = Field(max_length=32)
    provider: str = Field(max_length=32)
    format: str = Field(max_length=16)
    currency: str = Field(sa_column=Column(String(3), nullable=False))
    amount: Decimal = Field(sa_column=_money())
    state: CredentialState = Field(default=CredentialState.MINTING, sa_type=state_type())
    mpp: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    provider_credential_id: str | None = Field(default=None, max_length=255)
    sealed: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    job_id: uuid.UUID | None = None
    expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
