"""The public shapes of webhooks and their deliveries (``GET /webhooks``, ``GET /webhooks/{id}/deliveries``),
and the Standard Webhooks message id of a delivery (``webhook-id``)."""

from __future__ import annotations

import datetime as dt
import uuid

from storage.models import DELIVERY_STATUS, Webhook, WebhookAttempt, WebhookDelivery
from storage.states import DeliveryStatus


def webhook_view(webhook: Webhook) -> dict:
    """The public webhook object."""
    return {
        "id": webhook.id,
        "tenant_id": webhook.tenant_id,
        "status": webhook.status,
        "name": webhook.name,
        "url": webhook.url,
        "notify_email": webhook.notify_email,
        "events": list(webhook.events),
        "created_by": webhook.created_by,
        "created_at": webhook.created_at,
        "modified_by": webhook.modified_by,
        "modified_at": webhook.modified_at,
    }


def message_id(delivery_id: uuid.UUID) -> str:
    """The Standard Webhooks message id of a delivery (``webhook-id``), stable across retries."""
    return f"msg_{delivery_id.hex}"


def delivery_view(
    delivery: WebhookDelivery, job_status: str, due_at: dt.datetime, event_type: str, attempts: list[WebhookAttempt]
) -> dict:
    """A delivery with its attempts (newest attempt last); ``job_status`` and ``due_at`` are its job's."""
    status = DELIVERY_STATUS[job_status]
    return {
        "id": message_id(delivery.id),
        "webhook_id": delivery.webhook_id,
        "event_id": delivery.event_id,
        "event_type": event_type,
        "status": status,
        "next_attempt_at": due_at if status == DeliveryStatus.PENDING else None,
        "created_at": delivery.created_at,
        "completed_at": delivery.completed_at,
        "attempts": [
            {
                "number": a.number,
                "attempted_at": a.attempted_at,
                "outcome": a.outcome,
                "status_code": a.status_code,
                "duration_ms": a.duration_ms,
                "error": a.error,
            }
            for a in attempts
        ],
    }


def parse_message_id(value: str) -> uuid.UUID | None:
    """The delivery id inside a ``msg_...`` message id (or a plain uuid); None when malformed."""
    try:
        return uuid.UUID(value.removeprefix("msg_"))
    except ValueError:
        return None
