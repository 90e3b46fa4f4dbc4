"""Tasks of tenant administration: invitation mails, document purges and the sweeps of expirations.

* ``mail.invitation(job_id)`` (``mail`` queue): sends the invitation mail of one link; the job is
  recorded with the invitation in one transaction and sent after the commit; transient SMTP failures
  are retried with backoff (a countdown up to a minute, later ones by the outbox relay).
* ``documents.purge(document_id)`` (``files`` queue): removes a deleted document's S3 object and row.
* Sweeps for beat, each in batches with ``SKIP LOCKED`` and safe to run twice or on two beat processes:
  ``tenant_admin.expire_invitations`` (PENDING past ``expires_at`` -> EXPIRED),
  ``tenant_admin.destroy_client_keys`` (private key material of expired client encryption keys),
  ``tenant_admin.sweep_documents`` (deleted documents and abandoned uploads).
"""

from __future__ import annotations

import uuid

from config.settings import get_settings
from domain.client_keys import service as client_keys
from domain.documents import service as documents
from domain.tenancy import invitations
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.db import session_scope
from storage.types import utcnow
from tasks.sweeps import in_batches

BATCH = 500


@celery_app.task(name=invitations.MAIL_TASK, base=TesseraTask, bind=True)
def invitation_mail(self, job_id: str) -> str:
    """Send the invitation mail of the link the job names (see ``domain.tenancy.invitations.deliver_mail``)."""
    return invitations.deliver_mail(uuid.UUID(job_id), self.worker_id(), get_settings(), session_scope)


@celery_app.task(name=documents.PURGE_TASK, base=TesseraTask)
def purge_document(document_id: str) -> bool:
    """Remove a deleted document's S3 object and row; False when there was nothing to do."""
    with session_scope() as session:
        return documents.purge_document(session, uuid.UUID(document_id))


@celery_app.task(name="tenant_admin.expire_invitations", base=TesseraTask)
def expire_invitations() -> int:
    """Move PENDING invitations past ``expires_at`` to EXPIRED; returns how many."""
    return in_batches(lambda s: invitations.expire_invitations(s, now=utcnow(), batch=BATCH), BATCH)


@celery_app.task(name="tenant_admin.destroy_client_keys", base=TesseraTask)
def destroy_client_keys() -> int:
    """Destroy the private key material of client encryption keys past ``expires_at``; returns how many."""
    return in_batches(lambda s: client_keys.destroy_expired_keys(s, now=utcnow(), batch=BATCH), BATCH)


@celery_app.task(name="tenant_admin.sweep_documents", base=TesseraTask)
def sweep_documents() -> int:
    """Remove deleted documents and abandoned uploads from S3 and the database; returns how many."""
    return in_batches(lambda s: documents.sweep_documents(s, now=utcnow(), batch=100), 100)
