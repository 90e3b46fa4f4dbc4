"""Tasks of client encryption keys (``client_keys.*``).

``client_keys.destroy_client_keys`` (beat): destroys the private key material of keys past
``expires_at``, in batches with ``SKIP LOCKED``, safe to run twice or on two beat processes.
"""

from __future__ import annotations

from domain.client_keys import service as client_keys
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.types import utcnow
from tasks.sweeps import in_batches

BATCH = 500


@celery_app.task(name="client_keys.destroy_client_keys", base=TesseraTask)
def destroy_client_keys() -> int:
    """Destroy the private key material of client encryption keys past ``expires_at``; returns how many."""
    return in_batches(lambda s: client_keys.destroy_expired_keys(s, now=utcnow(), batch=BATCH), BATCH)
