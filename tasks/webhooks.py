"""Webhook delivery (``webhooks.*`` tasks run on the ``webhooks`` queue).

``webhooks.deliver(delivery_ids)`` delivers a batch of about a hundred deliveries, each the job with
the delivery's id (:func:`domain.webhooks.deliveries.deliver_batch`). A batch where a delivery failed
ends in Flower as RETRY (retries are scheduled) or FAILURE (a delivery failed for good, or its job is
a dead letter), after its outcomes are committed: the message is acknowledged either way and nothing
runs twice.
"""

from __future__ import annotations

import uuid

from config.settings import get_settings
from domain.webhooks import deliveries as webhooks
from infra import metrics
from infra.celery import DELIVER_TASK, celery_app
from infra.task import TesseraTask


@celery_app.task(name=DELIVER_TASK, base=TesseraTask, bind=True)
def deliver(self, delivery_ids: list[str]) -> dict[str, int]:
    """Attempt each delivery (leased, so a duplicate message or a second worker does nothing twice).

    Returns the count of each outcome when every delivery succeeded (or was not due).
    """
    outcome = webhooks.deliver_batch([uuid.UUID(i) for i in delivery_ids], self.worker_id(), get_settings())
    metrics.webhook_outcomes(outcome.counts)
    return self.report(
        outcome.counts, retrying=outcome.retrying, failed=outcome.failed - outcome.dead, dead=outcome.dead
    )
