"""SQLModel tables of the platform.

Every table that belongs to a tenant carries ``tenant_id`` and every query filters on it (see
``ARCHITECTURE.md``, security model). Secrets are stored only as AES-256-GCM ciphertext (columns
ending in ``_ct``) made by :mod:`storage.crypto`; API keys only as SHA-256 digests.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import (
    JSON,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    case,
    select,
    text,
)
from sqlalchemy.orm import column_property
from sqlmodel import Field, SQLModel

from storage.states import JOB_TAKEABLE, JOB_UNSUCCESSFUL, DeliveryStatus, JobStatus, WebhookStatus
from storage.types import state_type, table_of
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at

# ---- tenants, users, applications ----------------------------------------------------------------


class Tenant(SQLModel, table=True):
    """A tenant groups applications, tokens and every other resource."""

    __tablename__ = "tenants"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    name: str = Field(max_length=200)
    type: str = Field(max_length=16)  # production | test
    owner_id: uuid.UUID | None = Field(default=None)
    settings: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    security_contact_email: str | None = Field(default=None, max_length=200)
    webhook_secret_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    deleted_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class TenantDataKey(SQLModel, table=True):
    """One version of a tenant's AES-256 data key, wrapped by the master key or by AWS KMS.

    ``state``: ``active`` (new values are sealed with it; one per tenant), ``retiring`` (values
    sealed with it are being re-encrypted; still opens them), ``destroyed`` (its key bytes are
    gone: ``wrapped_key`` is NULL, ``destroyed_at`` says when). ``wrapped_by`` names the wrapping
    key (``master:<key check>`` or ``kms:<key id>``), so a rewrap finds the rows still under a
    previous one.
    """

    __tablename__ = "tenant_data_keys"

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    version: int = Field(default=1, sa_column=Column(Integer, primary_key=True, server_default=text("1")))
    state: str = Field(default="active", sa_column=Column(String(16), nullable=False, server_default="active"))
    wrapped_key: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    wrapping: str = Field(max_length=16)  # master | kms
    kms_key_id: str | None = Field(default=None, max_length=2048)
    wrapped_by: str | None = Field(default=None, max_length=2100)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    destroyed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class TenantIndexKey(SQLModel, table=True):
    """A tenant's derivation key, wrapped like its data keys: fingerprints, search indexes and
    invitation links are keyed by HKDF from it. It does not rotate with the data key, so a
    rotation leaves every fingerprint and search index matching without recomputing them (they are
    one-way digests: no value is readable from them, whatever the data key's age). For a tenant made
    before data keys had versions it holds the version 1 data key, from which those digests were
    derived. Deleted with the tenant's data keys when the tenant is shredded."""

    __tablename__ = "tenant_index_keys"

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    wrapped_key: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    wrapping: str = Field(max_length=16)  # master | kms
    kms_key_id: str | None = Field(default=None, max_length=2048)
    wrapped_by: str | None = Field(default=None, max_length=2100)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class KeyCheck(SQLModel, table=True):
    """The wrapping key the database's data keys are under (one row, ``id`` 1): ``wrapped_by`` names
    it (``master:<key check value>`` or ``kms:<key id>``) and ``check_value`` is a constant sealed
    by it, which a process's key must open before it serves (``storage.keys``)."""

    __tablename__ = "key_checks"

    id: int = Field(default=1, primary_key=True)
    wrapping: str = Field(max_length=16)
    wrapped_by: str = Field(max_length=2100)
    check_value: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    updated_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class KeyRotation(SQLModel, table=True):
    """A rotation of a tenant's data key to ``version``: the background job re-encrypting every
    value sealed under older versions (``done`` of ``total`` sealed values), ``running`` until none
    is left, then ``completed`` (the retiring versions are then destroyed)."""

    __tablename__ = "key_rotations"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    version: int
    status: str = Field(default="running", max_length=16)  # running | completed
    done: int = 0
    total: int = 0
    job_id: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    completed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class User(SQLModel, table=True):
    """A person who can be a member of tenants."""

    __tablename__ = "users"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    email: str = Field(max_length=320, sa_column_kwargs={"unique": True})
    first_name: str | None = Field(default=None, max_length=200)
    last_name: str | None = Field(default=None, max_length=200)
    picture: str | None = Field(default=None, max_length=2048)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class TenantMember(SQLModel, table=True):
    """A user's membership of a tenant with a role (OWNER, ADMIN, READ_ONLY)."""

    __tablename__ = "tenant_members"
    __table_args__ = (UniqueConstraint("tenant_id", "user_id", name="uq_tenant_members_user"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    user_id: uuid.UUID = Field(sa_column=Column(ForeignKey("users.id"), nullable=False))
    role: str = Field(max_length=16)
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class Application(SQLModel, table=True):
    """An application of a tenant: a type, a set of permissions and one or more API keys."""

    __tablename__ = "applications"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    name: str = Field(max_length=200)
    type: str = Field(max_length=32)
    permissions: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class ApplicationKey(SQLModel, table=True):
    """One API key of an application, stored as the SHA-256 digest of the key only."""

    __tablename__ = "application_keys"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    application_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("applications.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    key_digest: str = Field(sa_column=Column(String(64), nullable=False, unique=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


# ---- tokens --------------------------------------------------------------------------------------


#: Percent of a ``tokens`` page its inserts fill: the rest keeps an updated row's new version on its
#: page (a HOT update, no index entries); migration ``0016_tokens_fillfactor``.
TOKENS_FILLFACTOR = 80


class Token(SQLModel, table=True):
    """A vaulted value. ``data_ct`` is the AES-256-GCM ciphertext of the JSON data."""

    __tablename__ = "tokens"
    __table_args__ = (
        Index("ix_tokens_fingerprint", "tenant_id", "fingerprint"),
        Index("ix_tokens_parent", "tenant_id", "parent_id"),
        Index("ix_tokens_list", "tenant_id", "created_at", "id"),
        {"postgresql_with": {"fillfactor": TOKENS_FILLFACTOR}},
    )

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    id: str = Field(sa_column=Column(String(400), primary_key=True))
    type: str = Field(max_length=32)
    data_ct: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    mask: object | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    containers: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    meta: dict = Field(default_factory=dict, sa_column=Column("metadata", JSON, nullable=False))
    search_indexes: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    fingerprint: str | None = Field(default=None, max_length=64)
    fingerprint_expression: str | None = Field(default=None, max_length=4096)
    deduplicate_token: bool | None = None
    parent_id: str | None = Field(default=None, max_length=400)
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True, index=True))
    cvc_expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True, index=True))


class TokenMetadata(SQLModel, table=True):
    """One metadata pair of a token, kept beside the token for exact, case-sensitive filtering."""

    __tablename__ = "token_metadata"
    __table_args__ = (Index("ix_token_metadata_kv", "tenant_id", "key", "value"),)

    tenant_id: uuid.UUID = Field(primary_key=True)
    token_id: str = Field(sa_column=Column(String(400), primary_key=True))
    key: str = Field(sa_column=Column(String(255), primary_key=True))
    value: str = Field(sa_column=Column(String(1024), nullable=False))


class TokenSearchIndex(SQLModel, table=True):
    """A blind index: the keyed HMAC of one rendered search-index expression of a token."""

    __tablename__ = "token_search_indexes"
    __table_args__ = (Index("ix_token_search_digest", "tenant_id", "digest"),)

    tenant_id: uuid.UUID = Field(primary_key=True)
    token_id: str = Field(sa_column=Column(String(400), primary_key=True))
    digest: str = Field(sa_column=Column(String(64), primary_key=True))


class TokenIdempotencyKey(SQLModel, table=True):
    """One ``<prefix>-IDEMPOTENCY-KEY`` of a token creation (``scope``: ``tokens`` or ``tokenize``) and
    the answer it gave, sealed (``answer_ct``: it may hold token data). Kept at least 24 hours from
    ``created_at``; an older row is taken over by the next request with its key, and swept."""

    __tablename__ = "token_idempotency_keys"

    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True))
    scope: str = Field(sa_column=Column(String(16), primary_key=True))
    key: str = Field(sa_column=Column(String(255), primary_key=True))
    answer_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts(index=True))


# ---- events, webhooks ----------------------------------------------------------------------------


class Event(SQLModel, table=True):
    """Something that happened in a tenant; fanned out to webhooks as delivery rows."""

    __tablename__ = "events"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    type: str = Field(max_length=100)
    trace_id: str | None = Field(default=None, max_length=64)
    data: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


class Webhook(SQLModel, table=True):
    """A tenant's webhook subscription."""

    __tablename__ = "webhooks"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    name: str = Field(max_length=200)
    url: str = Field(max_length=2048)
    notify_email: str | None = Field(default=None, max_length=320)
    events: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    status: WebhookStatus = Field(default=WebhookStatus.ENABLED, sa_type=state_type())
    failing_since: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    disabled_reason: str | None = Field(default=None, max_length=500)
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class WebhookDelivery(SQLModel, table=True):
    """One event to one webhook: the public record of a delivery. Its work is the ``webhooks.deliver``
    :class:`Job` with the same id (status, attempts, ``due_at``, lease, last error live there).

    ``id`` is the Standard Webhooks message id, kept across retries, and the id of its job (deleting
    the job deletes the delivery). ``status`` is the public status derived from the job's
    (:data:`DELIVERY_STATUS`).
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_webhook", "webhook_id", "created_at"),)

    id: uuid.UUID = Field(
        default_factory=uuid.uuid4, sa_column=Column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    )
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    webhook_id: uuid.UUID = Field(sa_column=Column(ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False))
    event_id: uuid.UUID = Field(sa_column=Column(ForeignKey("events.id", ondelete="CASCADE"), nullable=False))
    last_status_code: int | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    completed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class WebhookAttempt(SQLModel, table=True):
    """One HTTP attempt of a delivery."""

    __tablename__ = "webhook_attempts"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    delivery_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    number: int
    outcome: str = Field(max_length=32)
    status_code: int | None = None
    duration_ms: int
    error: str | None = Field(default=None, max_length=500)
    attempted_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


# ---- slow work -----------------------------------------------------------------------------------


#: The rows of the partial index ``ix_jobs_deliveries_waiting``: webhook deliveries not settled yet.
_DELIVERIES_WAITING = "kind = 'webhooks.deliver' AND status IN ('queued', 'running')"
#: The rows of the partial index ``ix_jobs_takeable``: the jobs a worker may still take.
_TAKEABLE = "status IN (" + ", ".join(f"'{status}'" for status in JOB_TAKEABLE) + ")"


class Job(SQLModel, table=True):
    """A recorded piece of slow work (provider calls, file processing, a webhook delivery: the job with
    the delivery's id) run by a Celery task.

    Written in the same transaction as the change that needs it; the task is sent after commit and
    re-sent by the beat relay while the job is still ``queued`` past ``due_at``. A worker takes the
    lease (``lease_owner`` / ``lease_expires_at``) before working; the job id is the provider-side
    idempotency key.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_due", "status", "due_at"),
        Index("ix_jobs_subject", "subject_type", "subject_id", "subject_number"),
        # a tenant's webhook deliveries still to deliver (the fairness checks of domain.webhooks)
        Index(
            "ix_jobs_deliveries_waiting",
            "tenant_id",
            "due_at",
            postgresql_where=text(_DELIVERIES_WAITING),
            sqlite_where=text(_DELIVERIES_WAITING),
        ),
        # the takeable jobs of a kind, per tenant, oldest due first (infra.fairness picks the next one);
        # built CONCURRENTLY by migration 0015_jobs_takeable
        Index(
            "ix_jobs_takeable",
            "kind",
            "tenant_id",
            "due_at",
            postgresql_where=text(_TAKEABLE),
            sqlite_where=text(_TAKEABLE),
        ),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID | None = Field(
        default=None, sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True)
    )
    kind: str = Field(max_length=100)  # the Celery task name that runs it
    #: What the job works on (``infra.jobs.record``): its type, its id, a part number, its operation.
    subject_type: str | None = Field(default=None, max_length=40)
    subject_id: str | None = Field(default=None, max_length=400)
    subject_number: int | None = None
    operation_id: str | None = Field(default=None, max_length=64)
    status: JobStatus = Field(default=JobStatus.QUEUED, sa_type=state_type())
    attempts: int = 0
    max_attempts: int = 5
    due_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    enqueued_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    lease_owner: str | None = Field(default=None, max_length=200)
    lease_expires_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    last_error: str | None = Field(default=None, max_length=1000)
    result: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    trace_id: str | None = Field(default=None, max_length=64)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    updated_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


#: The public status of a webhook delivery (the API's words) for each status of its job.
DELIVERY_STATUS: dict[str, DeliveryStatus] = {
    JobStatus.QUEUED: DeliveryStatus.PENDING,
    JobStatus.RUNNING: DeliveryStatus.PENDING,
    JobStatus.SUCCEEDED: DeliveryStatus.SUCCEEDED,
    JobStatus.FAILED: DeliveryStatus.FAILED,
    JobStatus.DEAD: DeliveryStatus.FAILED,
    JobStatus.CANCELLED: DeliveryStatus.FAILED,
}
#: The job statuses behind each public delivery status.
DELIVERY_JOB_STATUSES: dict[str, tuple[JobStatus, ...]] = {
    DeliveryStatus.PENDING: JOB_TAKEABLE,
    DeliveryStatus.SUCCEEDED: (JobStatus.SUCCEEDED,),
    DeliveryStatus.FAILED: JOB_UNSUCCESSFUL,
}


def delivery_status(job_status):
    """The SQL expression of the public delivery status for the SQL expression ``job_status``."""
    return case(
        (job_status.in_(DELIVERY_JOB_STATUSES[DeliveryStatus.PENDING]), DeliveryStatus.PENDING.value),
        (job_status == JobStatus.SUCCEEDED, DeliveryStatus.SUCCEEDED.value),
        else_=DeliveryStatus.FAILED.value,
    )


#: ``WebhookDelivery.status``: the public status, read from the delivery's job with the delivery (read-only).
WebhookDelivery.status = column_property(
    select(delivery_status(table_of(Job).c.status))
    .where(table_of(Job).c.id == table_of(WebhookDelivery).c.id)
    .correlate_except(table_of(Job))
    .scalar_subquery()
)


# ---- audit ---------------------------------------------------------------------------------------


class AuditLog(SQLModel, table=True):
    """A log row: who did what to which entity. Never holds sensitive data."""

    __tablename__ = "audit_logs"
    __table_args__ = (Index("ix_audit_logs_list", "tenant_id", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False))
    actor_id: uuid.UUID | None = None
    actor_type: str | None = Field(default=None, max_length=32)
    entity_type: str = Field(max_length=64)
    entity_id: str = Field(max_length=400)
    operation: str = Field(max_length=32)
    message: str = Field(max_length=500)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())


# The tables of each capability live in a module of their own; importing them here puts every table
# on SQLModel.metadata (Alembic, the migration check).
from storage import (  # noqa: E402, F401
    models_account_updater,
    models_agentic,
    models_allowances,
    models_client_keys,
    models_documents,
    models_network_tokens,
    models_proxy,
    models_reactors,
    models_tenancy,
    models_wallets,
)
