"""Webhook delivery (``webhooks.*`` tasks run on the ``webhooks`` queue)."""

from __future__ import annotations

import logging
import uuid

from config.settings import get_settings
from domain.webhooks import service as webhooks
from infra.celery import celery_app
from infra.task import TesseraTask
from storage.db import session_scope

log = logging.getLogger("tessera.tasks.webhooks")


@celery_app.task(name="webhooks.deliver", base=TesseraTask, bind=True)
def deliver(self, delivery_ids: list[str]) -> dict[str, int]:
    """Attempt each delivery (leased, so a duplicate message or a second worker does nothing twice).

    Returns the count of each outcome; failures are recorded and retried by due time, not raised.
    """
    settings = get_settings()
    outcomes: dict[str, int] = {}
    for delivery_id in delivery_ids:
        outcome = webhooks.attempt(uuid.UUID(delivery_id), self.worker_id(), settings, session_scope)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes
