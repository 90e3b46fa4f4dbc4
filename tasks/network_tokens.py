"""Tasks of network tokens (``network_tokens.*``, routed to the ``providers`` queue).

Each is a :class:`infra.task.JobTask` running one recorded job: ``perform`` makes the card network
call (outside any transaction, the job id as idempotency key) and ``apply`` / ``on_job_failure`` write
the outcome through :mod:`domain.network_tokens.provisioning` (provision), :mod:`~domain.network_tokens.cryptograms`
and :mod:`domain.network_tokens.service` (the others). The lease lasts ``TESSERA_JOB_LEASE_SECONDS``
(longer than the provider's connect + read timeouts). ``network_tokens.expire_token_intents`` is the
beat sweep of expired token intents.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlmodel import Session

from domain.network_tokens import cryptograms, provisioning, records, service, token_intents
from infra import jobs
from infra.celery import celery_app
from infra.task import JobTask, TesseraTask
from storage.db import session_scope
from storage.models import Job
from storage.types import utcnow
from tasks.sweeps import in_batches

SWEEP_BATCH = 500


class NetworkTokenJob(JobTask):
    """Base of the network-token job tasks: the lease follows ``TESSERA_JOB_LEASE_SECONDS``."""

    abstract = True
    lease_seconds = 0.0
    lease_settings = {"job_lease_seconds": 1.0}


class Provision(NetworkTokenJob):
    """``network_tokens.provision``: ask the network for the network token of an ``inactive`` one.

    Transient failures are retried after 1, 2, 4, 8 s ... (the handler waits 10 s by default, so a
    network that recovers quickly still gives a 201); six attempts, then a dead letter.
    """

    name = records.PROVISION_TASK
    backoff_base = records.PROVISION_BACKOFF_BASE
    apply_to_leased_job = True

    def lease_reads(self) -> jobs.LeaseReads:
        """See :func:`domain.network_tokens.provisioning.provisioning_reads`."""
        return provisioning.provisioning_reads()

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The network's :class:`~providers.card_network.ProvisionedToken` (None: nothing to do)."""
        found = provisioning.provisioning_input(job, inputs)
        if found is None:
            return None
        network, card = found
        return network.provision(card, idempotency_key=str(job.id))

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.network_tokens.provisioning.apply_provisioned`."""
        return provisioning.apply_provisioned(session, job, outcome)

    def outcome_write(self, job: Job, outcome: Any) -> jobs.OutcomeWrite | None:
        """See :func:`domain.network_tokens.provisioning.provisioned_write`."""
        return provisioning.provisioned_write(job, outcome)

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        """See :func:`domain.network_tokens.provisioning.provisioning_failed`."""
        provisioning.provisioning_failed(session, job, error)


class _Change(NetworkTokenJob):
    abstract = True
    action = ""

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The network's status after the change (None: the network token was removed meanwhile)."""
        with session_scope() as session:
            found = service.change_input(session, job)
        if found is None:
            return None
        network, reference = found
        return getattr(network, self.action)(reference, idempotency_key=str(job.id))

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.network_tokens.service.apply_change`."""
        return service.apply_change(session, job, self.action, outcome)

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        """See :func:`domain.network_tokens.service.change_failed`."""
        service.change_failed(session, job, error)


class Suspend(_Change):
    """``network_tokens.suspend``: suspend at the network, then mark the network token ``suspended``."""

    name = records.SUSPEND_TASK
    action = "suspend"


class Resume(_Change):
    """``network_tokens.resume``: resume at the network, then mark the network token ``active``."""

    name = records.RESUME_TASK
    action = "resume"


class DeleteAtNetwork(NetworkTokenJob):
    """``network_tokens.delete``: delete the network's token whose id is the job's subject (the
    platform's row is already gone). Retried until the network confirms; then a dead letter."""

    name = records.DELETE_TASK

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The network's status of the token (``deleted``)."""
        with session_scope() as session:
            network, reference = service.delete_input(session, job)
        return network.delete(reference, idempotency_key=str(job.id))

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """The job result: the network's status."""
        return {"status": outcome}


class CardArt(NetworkTokenJob):
    """``network_tokens.card_art``: fetch the card art and store it on the network token."""

    name = records.CARD_ART_TASK

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The card art object (None: the network token was removed meanwhile)."""
        with session_scope() as session:
            found = service.network_reference_input(session, job)
        if found is None:
            return None
        network, reference = found
        return network.card_art(reference)

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.network_tokens.service.apply_card_art`."""
        return service.apply_card_art(session, job, outcome)


class MakeCryptogram(NetworkTokenJob):
    """``network_tokens.cryptogram``: a fresh cryptogram, sealed to the waiting request's one-time key
    (the job result holds only that sealed value, wiped when the request reads it)."""

    name = records.CRYPTOGRAM_TASK

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The sealed cryptogram ``{"sealed", "eci"}`` (None: the network token was removed)."""
        with session_scope() as session:
            found = service.network_reference_input(session, job)
        if found is None:
            return None
        network, reference = found
        return cryptograms.seal_cryptogram(job, network.cryptogram(reference, idempotency_key=str(job.id)))

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """The job result: the sealed cryptogram."""
        return outcome or {"skipped": True}


for _task in (Provision(), Suspend(), Resume(), DeleteAtNetwork(), CardArt(), MakeCryptogram()):
    celery_app.register_task(_task)


@celery_app.task(name=records.EXPIRE_INTENTS_TASK, base=TesseraTask)
def expire_token_intents() -> int:
    """Beat sweep: delete token intents past their 24 hours and drop intents' cvc past retention.

    Works in batches of 500 in short transactions (``SKIP LOCKED``), at most 20 batches a run;
    returns how many intents were deleted or rewritten.
    """
    now = utcnow()
    return sum(
        in_batches(partial(step, now=now, batch=SWEEP_BATCH), SWEEP_BATCH)
        for step in (token_intents.delete_expired_intents, token_intents.purge_intent_verification_codes)
    )
