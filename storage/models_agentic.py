"""Tables: agentic payment methods, rails, provider errors, idempotency records, operation leases, agents
(second document).

* :class:`PaymentMethod` (``pm_`` ids) and one :class:`PaymentMethodRail` per provisioned rail. The
  card's full number and security code are never stored here: workers read them from the card token
  when they call a provider; ``card`` holds only the display data the spec lists.
* :class:`ProviderError` (``prv_`` ids): the errors history of ``GET .../errors``, kept 90 days.
* :class:`IdempotencyRecord`: one row per ``(tenant, scope, key)``; the primary key is what makes two
  racing requests with one key create one payment method. Records never expire.
* :class:`OperationLease`: in-flight work on a payment method (enrollment, retry, delete cascade); a
  row with an owner and an expiry, freed by its holder or by the lease sweep when the holder died.
* :class:`Agent` (``agt_`` ids): the deprecated agents resource.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, String, UniqueConstraint
from sqlmodel import Field, SQLModel

from storage.states import IdempotencyState, PaymentMethodStatus, RailStatus
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _now


class PaymentMethod(SQLModel, table=True):
    """A card source registered for agent-driven purchases (spec 001, section 2, Payment method).

    ``source`` is stored as supplied; ``token_id`` repeats its token id for the workers. ``consumer``
    is the normalised consumer (with the generated id); ``consumer_id`` repeats its id for filtering.
    ``delete_requested_at`` is set when a delete cascade starts and stays set, with ``status``
    still ``active``, when the cascade stopped half-way (the next DELETE resumes it).
    ``idempotency_key`` is unique per tenant: a second guard, beside the idempotency record, that one
    key never makes two payment methods.
    """

    __tablename__ = "agentic_payment_methods"
    __table_args__ = (
        Index("ix_agentic_payment_methods_list", "tenant_id", "created_at", "id"),
        Index("ix_agentic_payment_methods_consumer", "tenant_id", "consumer_id", "created_at"),
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_agentic_payment_methods_idempotency_key"),
    )

    id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    status: PaymentMethodStatus = Field(default=PaymentMethodStatus.ACTIVE, sa_type=state_type())
    source: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    token_id: str = Field(sa_column=Column(String(400), nullable=False))
    consumer: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    consumer_id: str = Field(sa_column=Column(String(64), nullable=False))
    card: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    agent_id: str | None = Field(default=None, max_length=255)
    idempotency_key: str | None = Field(default=None, max_length=255)
    created_by: uuid.UUID | None = None
    delete_requested_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    deleted_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    updated_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())


class PaymentMethodRail(SQLModel, table=True):
    """One rail of a payment method: ``rail``/``provider``, ``status`` (enabled, pending, error).

    ``error_code`` only while ``status`` is ``error``. ``enrollment_id`` is the provider's
    enrollment (polled while pending, removed by the delete cascade, which sets
    ``enrollment_removed_at``). ``job_id`` is the job currently working on the rail (an enrollment,
    a retry or a poll): a job whose id is no longer here was overtaken and its outcome is dropped.
    ``operation_id`` names the operation lease that job belongs to. ``attempt`` is ``create`` or
    ``retry`` (sent to the provider). ``notify`` is set once the rail was shown ``pending`` to a
    client: its settling then emits ``agentic.payment-method.rail.retried``.
    """

    __tablename__ = "agentic_payment_method_rails"
    __table_args__ = (
        UniqueConstraint("payment_method_id", "rail", "provider", name="uq_agentic_rails_pair"),
        Index("ix_agentic_rails_payment_method", "payment_method_id", "position"),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    payment_method_id: str = Field(
        sa_column=Column(String(40), ForeignKey("agentic_payment_methods.id", ondelete="CASCADE"), nullable=False)
    )
    position: int = 0
    rail: str = Field(max_length=32)  # agentic-token | spt
    provider: str = Field(max_length=32)  # vic | agentpay | psp
    status: RailStatus = Field(default=RailStatus.PENDING, sa_type=state_type())
    error_code: str | None = Field(default=None, max_length=64)
    provider_ids: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    enrollment_id: str | None = Field(default=None, max_length=255)
    enrollment_removed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    attempt: str = Field(default="create", max_length=16)  # create | retry
    job_id: uuid.UUID | None = None
    operation_id: str | None = Field(default=None, max_length=64)
    notify: bool = False
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    updated_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())


class ProviderError(SQLModel, table=True):
    """A provider failure (spec 001, section 2, Provider error object); never a provider body,
    message, source data or credential value. Removed ``provider_error_retention_days`` after
    ``occurred_at`` by the retention sweep."""

    __tablename__ = "agentic_provider_errors"
    __table_args__ = (
        Index("ix_agentic_provider_errors_payment_method", "tenant_id", "payment_method_id", "occurred_at", "id"),
        Index("ix_agentic_provider_errors_occurred", "occurred_at"),
    )

    id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    code: str = Field(max_length=64)
    title: str = Field(max_length=200)
    detail: str = Field(max_length=500)
    provider: str = Field(max_length=32)
    operation: str = Field(max_length=32)
    rail: str = Field(max_length=32)
    provider_code: str | None = Field(default=None, max_length=100)
    provider_correlation_id: str | None = Field(default=None, max_length=200)
    payment_method_id: str | None = Field(default=None, max_length=40)
    allowance_id: str | None = Field(default=None, max_length=40)
    payment_credential_id: str | None = Field(default=None, max_length=40)
    occurred_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())


class IdempotencyRecord(SQLModel, table=True):
    """The outcome of one ``<prefix>-IDEMPOTENCY-KEY`` (spec 001, section 8, Idempotency).

    ``state``: ``running`` (held by ``owner`` until ``expires_at``), ``succeeded`` (``resource_id``),
    ``failed`` (a conclusive failure: ``status_code`` and ``problem`` are replayed) or ``unknown``
    (terminal: ``CREATE_OUTCOME_UNKNOWN`` on every replay). ``request_hash`` is the SHA-256 of the
    canonical JSON body. Never expires.
    """

    __tablename__ = "agentic_idempotency_records"

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    scope: str = Field(sa_column=Column(String(64), primary_key=True))
    key: str = Field(sa_column=Column(String(255), primary_key=True))
    request_hash: str = Field(max_length=64)
    state: IdempotencyState = Field(default=IdempotencyState.RUNNING, sa_type=state_type())
    owner: str | None = Field(default=None, max_length=64)
    expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    resource_id: str | None = Field(default=None, max_length=40)
    status_code: int | None = None
    problem: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    completed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class OperationLease(SQLModel, table=True):
    """In-flight work on one resource (a payment method): ``operation`` (``enroll`` or ``delete``)
    held by ``owner`` until ``expires_at``. One row per resource: its presence is what answers
    ``409 ..._IN_PROGRESS``; the holder deletes it when done, the lease sweep when it expired."""

    __tablename__ = "agentic_operation_leases"
    __table_args__ = (Index("ix_agentic_operation_leases_expiry", "expires_at"),)

    resource_id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    operation: str = Field(max_length=16)
    owner: str = Field(max_length=64)
    acquired_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
    expires_at: dt.datetime = Field(sa_column=_ts())


class Agent(SQLModel, table=True):
    """A named AI assistant (deprecated resource, spec 001 section 2, Agent)."""

    __tablename__ = "agentic_agents"
    __table_args__ = (Index("ix_agentic_agents_tenant", "tenant_id", "created_at"),)

    id: str = Field(sa_column=Column(String(40), primary_key=True))
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    name: str = Field(max_length=255)
    enrollment_ids: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    status: str = Field(default="active", max_length=16)
    instance_details: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_now, sa_column=_ts())
