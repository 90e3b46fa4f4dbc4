"""Webhooks: ``/webhooks`` (spec, core document section 4, Webhooks; section 6, Events)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Literal

from pydantic import EmailStr, Field

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, cursor_query, decode_cursor
from app.schemas import Audited, Name, RequestModel, ResponseModel
from domain.tenancy.tenants import webhook_signing_secret
from domain.webhooks import service
from domain.webhooks.events import EVENT_TYPES
from storage.states import DeliveryStatus, WebhookStatus

api = Api()
TAG = "Webhooks"


class WebhookIn(RequestModel):
    name: Name
    url: str = Field(
        min_length=1,
        max_length=2048,
        description="http or https; checked for form only here. "
        "Private, loopback and link-local addresses are refused at delivery time.",
    )
    notify_email: EmailStr | None = Field(None, description="Told when the webhook is disabled after failing.")
    events: list[str] = Field(min_length=1, max_length=100)


class WebhookUpdate(WebhookIn):
    status: WebhookStatus | None = None


class WebhookOut(Audited):
    id: uuid.UUID
    tenant_id: uuid.UUID
    status: WebhookStatus
    name: str
    url: str
    notify_email: str | None
    events: list[str]


class SigningKeyOut(ResponseModel):
    key: str = Field(description="The Standard Webhooks secret, `whsec_` + base64.")


class AttemptOut(ResponseModel):
    number: int
    attempted_at: dt.datetime
    outcome: Literal["success", "http_error", "timeout", "connection_error", "refused"]
    status_code: int | None
    duration_ms: int
    error: str | None


class DeliveryOut(ResponseModel):
    id: str = Field(description="The message id sent as `webhook-id`; the same on every retry.")
    webhook_id: uuid.UUID
    event_id: uuid.UUID
    event_type: str
    status: DeliveryStatus
    next_attempt_at: dt.datetime | None
    created_at: dt.datetime
    completed_at: dt.datetime | None
    attempts: list[AttemptOut]


ListQuery = cursor_query(100)

_DELIVERY_TEXT = (
    "Deliveries POST `{event: {id, type, timestamp, tenant_id, trace_id, data}, delivered_at}` signed with the "
    "Standard Webhooks scheme: headers `webhook-id` (one message id per event and webhook, kept across retries), "
    "`webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>` under the key "
    "of GET /webhooks/signing-key. Any non-2xx answer or a timeout (10 s) is retried after 5 s, 30 s, 2 min, "
    "10 min, 30 min, 2 h, 5 h, 10 h and 10 h (TESSERA_WEBHOOK_RETRY_SCHEDULE), or after Retry-After when longer. "
    "Redirects are not followed. A webhook failing for 5 days (TESSERA_WEBHOOK_DISABLE_AFTER_SECONDS) without a "
    "success is disabled and notify_email is told."
)


@api.route(
    "POST",
    "/webhooks",
    permission="webhooks:create",
    body=WebhookIn,
    status=201,
    response=WebhookOut,
    tag=TAG,
    summary="Create a webhook",
    errors=(400,),
    description="New webhooks start enabled. " + _DELIVERY_TEXT,
)
async def create(call: Call):
    b = call.body
    return await call.db(
        service.create_webhook, call.caller, name=b.name, url=b.url, notify_email=b.notify_email, events=b.events
    )


@api.route(
    "GET",
    "/webhooks",
    permission="webhooks:read",
    query=ListQuery,
    response=CursorPage[WebhookOut],
    tag=TAG,
    summary="List webhooks",
    errors=(400,),
    description="Cursor pagination, oldest first.",
)
async def list_(call: Call):
    q = call.query
    data, next_position = await call.db(
        service.list_webhooks, call.caller, size=q.size, after=decode_cursor(call, q.start)
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "GET",
    "/webhooks/event-types",
    permission="webhook:read",
    response=list[str],
    tag=TAG,
    summary="List the event types",
)
async def event_types(call: Call):
    return list(EVENT_TYPES)


@api.route(
    "GET",
    "/webhooks/signing-key",
    permission="webhook:read",
    response=SigningKeyOut,
    tag=TAG,
    summary="Get the tenant's webhook signing key",
    description="The secret that signs every delivery of the tenant (Standard Webhooks).",
)
async def signing_key(call: Call):
    return {"key": await call.db(webhook_signing_secret, call.require_caller().tenant_id)}


@api.route(
    "GET",
    "/webhooks/{id}",
    permission="webhook:read",
    response=WebhookOut,
    tag=TAG,
    summary="Get a webhook",
    errors=(404,),
)
async def get(call: Call):
    return await call.db(service.read_webhook, call.caller, call.uuid_param(what="webhook"))


@api.route(
    "PUT",
    "/webhooks/{id}",
    permission="webhooks:update",
    body=WebhookUpdate,
    response=WebhookOut,
    tag=TAG,
    summary="Update a webhook",
    errors=(400, 404),
    description="Replaces name, url, notify_email and events; `status` enables or disables it.",
)
async def update(call: Call):
    b = call.body
    return await call.db(
        service.update_webhook,
        call.caller,
        call.uuid_param(what="webhook"),
        name=b.name,
        url=b.url,
        notify_email=b.notify_email,
        events=b.events,
        status=b.status,
    )


@api.route(
    "DELETE",
    "/webhooks/{id}",
    permission="webhooks:delete",
    status=204,
    tag=TAG,
    summary="Delete a webhook",
    errors=(404,),
)
async def delete(call: Call):
    await call.db(service.delete_webhook, call.caller, call.uuid_param(what="webhook"))


@api.route(
    "GET",
    "/webhooks/{id}/deliveries",
    permission="webhook:read",
    query=ListQuery,
    response=CursorPage[DeliveryOut],
    tag=TAG,
    summary="List a webhook's deliveries and their attempts",
    errors=(400, 404),
    description="Cursor pagination, newest first. " + _DELIVERY_TEXT,
)
async def deliveries(call: Call):
    q = call.query
    data, next_position = await call.db(
        service.list_deliveries,
        call.caller,
        call.uuid_param(what="webhook"),
        size=q.size,
        after=decode_cursor(call, q.start),
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "POST",
    "/webhooks/{id}/deliveries/{delivery_id}/redeliver",
    permission="webhooks:update",
    status=202,
    response=DeliveryOut,
    tag=TAG,
    summary="Deliver a delivery again",
    errors=(404,),
    description="Schedules one more attempt now, with the same message id (`webhook-id`).",
)
async def redeliver(call: Call):
    return await call.db(service.redeliver, call.caller, call.uuid_param(what="webhook"), call.params["delivery_id"])
