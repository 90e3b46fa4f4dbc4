"""Beat sweeps (``sweeps.*`` on the ``sweeps`` queue): the outbox relay, expirations, stale leases.

Each sweep works in batches inside short transactions, takes rows with ``SKIP LOCKED`` where it
changes them, and stops after a bounded number of batches; a second sweep running at the same time
(two beat processes) finds nothing left to do twice.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlmodel import Session

from config.settings import get_settings
from domain.tokens import idempotency
from domain.tokens import service as tokens
from infra import outbox
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.db import session_scope
from storage.types import utcnow

MAX_BATCHES = 20


def in_batches(step: Callable[[Session], int], batch: int) -> int:
    """Run ``step(session)`` in its own transaction until it handles fewer than ``batch`` rows."""
    total = 0
    for _ in range(MAX_BATCHES):
        with session_scope() as session:
            done = step(session)
        total += done
        if done < batch:
            break
    return total


@celery_app.task(name="sweeps.relay_outbox", base=TesseraTask)
def relay_outbox() -> int:
    """Re-send the tasks of stranded deliveries and jobs."""
    grace = get_settings().outbox_relay_after_seconds
    return in_batches(lambda s: outbox.relay(s, grace_seconds=grace, batch=1000), 1000)


@celery_app.task(name="sweeps.release_stale_leases", base=TesseraTask)
def release_stale_leases() -> int:
    """Return jobs whose worker died to the queue."""
    return in_batches(lambda s: outbox.release_stale_leases(s, batch=1000), 1000)


@celery_app.task(name="sweeps.delete_expired_tokens", base=TesseraTask)
def delete_expired_tokens() -> int:
    """Delete tokens past their ``expires_at``."""
    return in_batches(lambda s: tokens.delete_expired_tokens(s, now=utcnow(), batch=500), 500)


@celery_app.task(name="sweeps.forget_idempotency_keys", base=TesseraTask)
def forget_idempotency_keys() -> int:
    """Delete token creation idempotency keys first used more than 24 hours ago."""
    return in_batches(lambda s: idempotency.forget_old_keys(s, now=utcnow(), batch=500), 500)


@celery_app.task(name="sweeps.purge_card_verification_codes", base=TesseraTask)
def purge_card_verification_codes() -> int:
    """Drop card verification codes kept longer than ``TESSERA_CVC_RETENTION_SECONDS``."""
    return in_batches(lambda s: tokens.purge_card_verification_codes(s, now=utcnow(), batch=500), 500)
