"""The states of the platform's resources and work, one ``StrEnum`` per state column.

Models annotate their state columns with these, domain code compares against their members, and the
OpenAPI description lists their values (the route models use them as field types, so the docstrings of
those enums are the descriptions a client reads). A member equals
its string (``JobStatus.QUEUED == "queued"``), so the stored values and the HTTP contract are the
strings below; the columns stay ``VARCHAR``, and a value read back from the database is a plain
``str`` that compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum

# ---- slow work -----------------------------------------------------------------------------------


class JobStatus(StrEnum):
    """``Job.status`` (``infra.jobs`` draws the diagram): queued -> running -> a terminal state."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    CANCELLED = "cancelled"


#: The job states after which a job does no more work.
JOB_TERMINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DEAD, JobStatus.CANCELLED)
#: The job states a worker may still take (a running job whose lease expired is taken again).
JOB_TAKEABLE = (JobStatus.QUEUED, JobStatus.RUNNING)
#: The job states of a job that ended without success.
JOB_FAILED = (JobStatus.FAILED, JobStatus.DEAD)
#: The job states that end in failure, cancellation included.
JOB_UNSUCCESSFUL = (JobStatus.FAILED, JobStatus.DEAD, JobStatus.CANCELLED)


# ---- webhooks ------------------------------------------------------------------------------------


class WebhookStatus(StrEnum):
    """The status of a webhook: events are delivered to it while it is `enabled`."""

    ENABLED = "enabled"
    DISABLED = "disabled"


class DeliveryStatus(StrEnum):
    """The status of a webhook delivery: `pending` until it succeeded or failed for good."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# ---- network tokens ------------------------------------------------------------------------------


class NetworkTokenStatus(StrEnum):
    """The status of a network token: `inactive` while it is being provisioned."""

    ACTIVE = "active"
    INACTIVE = "inactive"
    SUSPENDED = "suspended"


# ---- agentic: payment methods, rails, allowances, credentials -----------------------------------


class PaymentMethodStatus(StrEnum):
    """The status of a payment method."""

    ACTIVE = "active"
    DELETED = "deleted"


class RailStatus(StrEnum):
    """The status of a payment method's rail: `pending` while its enrollment is under way."""

    ENABLED = "enabled"
    PENDING = "pending"
    ERROR = "error"


class AllowanceStatus(StrEnum):
    """The status of an allowance; one past its `expires_at` is `expired`."""

    PENDING_VERIFICATION = "pending_verification"
    ACTIVE = "active"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


#: The allowance states that hold money and can still be used.
ALLOWANCE_LIVE = (AllowanceStatus.PENDING_VERIFICATION, AllowanceStatus.ACTIVE)


class AllowanceRailStatus(StrEnum):
    """``AllowanceRail.status``: ``setting_up`` while its setup job runs (shown as ``inactive``)."""

    ACTIVE = "active"
    INACTIVE = "inactive"
    ERROR = "error"
    SETTING_UP = "setting_up"


class PublicAllowanceRailStatus(StrEnum):
    """The status of an allowance's rail: `inactive` until it is set up and verified."""

    ACTIVE = "active"
    INACTIVE = "inactive"
    ERROR = "error"


class CredentialState(StrEnum):
    """``PaymentCredential.state``: a minted token is ``minting`` until the provider answered."""

    MINTING = "minting"
    ISSUED = "issued"
    FAILED = "failed"


class IdempotencyState(StrEnum):
    """``IdempotencyRecord.state``: ``running`` while held, then one of the outcomes replayed."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


# ---- reactors ------------------------------------------------------------------------------------


class ReactorState(StrEnum):
    """The state of a reactor: `creating` or `updating` while a build runs."""

    CREATING = "creating"
    UPDATING = "updating"
    ACTIVE = "active"
    FAILED = "failed"
    OUTDATED = "outdated"


class ReactorRunStatus(StrEnum):
    """``ReactorRun.status``."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


# ---- account updater -----------------------------------------------------------------------------


class AccountUpdaterStatus(StrEnum):
    """The status of an account updater job: `pending` -> `processing` -> `completed` or `failed`."""

    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"


class ChunkStatus(StrEnum):
    """``AccountUpdaterChunk.status``: ``done`` once its result is written."""

    PENDING = "pending"
    DONE = "done"


# ---- tenant administration -----------------------------------------------------------------------


class InvitationStatus(StrEnum):
    """The status of an invitation: `EXPIRED` once past its `expires_at`."""

    PENDING = "PENDING"
    EXPIRED = "EXPIRED"


class InvitationLinkStatus(StrEnum):
    """``InvitationLink.status``: only an ``active`` link can be used."""

    ACTIVE = "active"
    SUPERSEDED = "superseded"
    REVOKED = "revoked"
    USED = "used"


class DocumentStatus(StrEnum):
    """``Document.status``."""

    UPLOADING = "uploading"
    READY = "ready"
    DELETED = "deleted"


# ---- wallets -------------------------------------------------------------------------------------


class WalletDomainStatus(StrEnum):
    """``WalletDomain.status``."""

    PENDING = "pending"
    VERIFIED = "verified"
