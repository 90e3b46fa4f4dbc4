"""Tasks of tenancy (``tenancy.*``): the invitation expiry sweep (invitation mails are in
:mod:`tasks.mail`).

``tenancy.expire_invitations`` (beat): PENDING invitations past ``expires_at`` -> EXPIRED, in batches
with ``SKIP LOCKED``, safe to run twice or on two beat processes.
"""

from __future__ import annotations

from domain.tenancy import invitations
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.types import utcnow
from tasks.sweeps import in_batches

BATCH = 500


@celery_app.task(name="tenancy.expire_invitations", base=TesseraTask)
def expire_invitations() -> int:
    """Move PENDING invitations past ``expires_at`` to EXPIRED; returns how many."""
    return in_batches(lambda s: invitations.expire_invitations(s, now=utcnow(), batch=BATCH), BATCH)
