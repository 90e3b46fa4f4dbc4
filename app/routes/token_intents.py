"""Token intents: ``/token-intents`` (spec, core document: the network token's ``token_intent_id``;
the tenant setting ``token_deduplication_behavior``). The endpoints are not shown by the spec: they
are designed here in its style and documented below; the rules live in :mod:`domain.network_tokens.token_intents`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Literal

from pydantic import Field

from app.api import AllOf, Api, Call
from app.routes.tokens import ConvertIn, TokenOut
from app.schemas import RequestModel, ResponseModel
from domain.network_tokens import token_intents as service

api = Api()
TAG = "Token intents"

_OBJECT = (
    "The token intent object (this implementation's design): `id`, `tenant_id`, `type` (`card`), "
    "`data`, `fingerprint` (the keyed fingerprint a card token of the same number gets by default, so an intent "
    "can be matched to tokens), `token_id` (the card token it became, else null), `created_by`, `created_at`, "
    "`converted_at`, `expires_at` (24 hours after creation). `data` is always masked like a card token's default "
    "mask: the number with its first six and last four digits, the expiration; `name` and `cvc` are never shown. "
    "No permission reveals an intent's data: it becomes readable in full only as a token. An intent past "
    "`expires_at` answers 404 at once; a beat sweep deletes it. A `cvc` is dropped after "
    "`TESSERA_CVC_RETENTION_SECONDS` like a card token's. The data is encrypted at rest with the tenant's key."
)


class TokenIntentIn(RequestModel):
    """`POST /token-intents`."""

    type: Literal["card"] = Field(description="Only `card` for now.")
    data: dict[str, Any] = Field(
        description="number (string of 12-19 digits passing the Luhn check, required), expiration_month and "
        "expiration_year (integers, together or not at all; an expired card is accepted, as by `POST /tokens`), "
        "cvc (3-4 digits), name (<= 200)."
    )


class TokenIntentData(ResponseModel):
    """An intent's card data, masked."""

    number: str = Field(description="Masked: first six and last four digits.")
    expiration_month: int | None = None
    expiration_year: int | None = None


class TokenIntentOut(ResponseModel):
    """The token intent object."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    type: Literal["card"]
    data: TokenIntentData
    fingerprint: str | None = None
    token_id: str | None = None
    created_by: uuid.UUID | None = None
    created_at: dt.datetime
    converted_at: dt.datetime | None = None
    expires_at: dt.datetime


@api.route(
    "POST",
    "/token-intents",
    permission="token-intent:create",
    body=TokenIntentIn,
    status=201,
    response=TokenIntentOut,
    tag=TAG,
    summary="Create a token intent",
    errors=(400,),
    description="Holds card data for 24 hours until it becomes a token (`POST /token-intents/{id}/convert`) or "
    "is used as the source of a network token (`POST /network-tokens` with `token_intent_id`). Card data follows "
    "the card token rules (400 keyed `data.number` ...); like a card token, an expired card is accepted (no "
    "expiry rule applies to either; a decision of this implementation). " + _OBJECT,
)
async def create(call: Call):
    """A new intent, expiring in 24 hours."""
    return await call.db(service.create_intent, call.caller, type=call.body.type, data=call.body.data)


@api.route(
    "GET",
    "/token-intents/{id}",
    permission="token-intent:read",
    response=TokenIntentOut,
    tag=TAG,
    summary="Get a token intent",
    errors=(404,),
    description="404 when missing, expired or another tenant's. " + _OBJECT,
)
async def get(call: Call):
    """The intent, data masked."""
    return await call.db(service.read_intent, call.caller, call.params["id"])


@api.route(
    "DELETE",
    "/token-intents/{id}",
    permission="token-intent:delete",
    status=204,
    tag=TAG,
    summary="Delete a token intent",
    errors=(404,),
    description="Removes the intent and its data. Tokens and network tokens made from it stay.",
)
async def delete(call: Call):
    """Remove the intent."""
    await call.db(service.delete_intent, call.caller, call.params["id"])


@api.route(
    "POST",
    "/token-intents/{id}/convert",
    permission=AllOf("token-intent:read", "token:pci:create"),
    body=ConvertIn,
    status=201,
    response=TokenOut,
    tag=TAG,
    summary="Convert a token intent into a card token",
    errors=(400, 404, 409),
    description="A token intent becomes a token here: the intent's data "
    "becomes a `card` token, answered 201 like `POST /tokens` (data by the caller's read access). The body is a JSON "
    "object, `{}` for the defaults, holding optional token request options: `id`, `metadata`, `mask`, "
    "`containers`, `search_indexes`, `fingerprint_expression`, `deduplicate_token`, `expires_at`, `parent_id`; "
    "`type` and `data` come from the intent (400 when sent). Deduplication, when it applies, always behaves as "
    "`update_existing` whatever the tenant's `token_deduplication_behavior`. Network tokens made from the "
    "intent gain the new `token_id` and keep their `token_intent_id`. An intent converts once: the intent stays "
    "until it expires, showing `token_id`, and a second conversion answers 409 with `token_id` in the problem.",
)
async def convert(call: Call):
    """The intent becomes a card token."""
    return await call.db(service.convert_intent, call.caller, call.params["id"], call.payload)
