"""Tasks of tenant administration: the sweeps of expirations (invitation mails are in :mod:`tasks.mail`,
document purges in :mod:`tasks.documents`).

* Sweeps for beat, each in batches with ``SKIP LOCKED`` and safe to run twice or on two beat processes:
  ``tenant_admin.expire_invitations`` (PENDING past ``expires_at`` -> EXPIRED),
  ``tenant_admin.destroy_client_keys`` (private key material of expired client encryption keys),
  ``tenant_admin.sweep_documents`` (deleted documents and abandoned uploads).
"""

from __future__ import annotations

from domain.client_keys import service as client_keys
from domain.documents import service as documents
from domain.tenancy import invitations
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.types import utcnow
from tasks.sweeps import in_batches

BATCH = 500


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
