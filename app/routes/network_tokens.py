"""Network tokens: ``/network-tokens`` (spec, core document sections 2 "Network token", "Network token
details", "Network token account", "Cryptogram"; 3 states; 4 "Network tokens").

Handlers are thin: the rules live in :mod:`domain.network_tokens.service`, :mod:`~domain.network_tokens.provisioning`
(create) and :mod:`~domain.network_tokens.cryptograms`. Every card network call runs in a
worker; a handler records the job, waits for its outcome without blocking the event loop (up to
``TESSERA_NETWORK_TOKEN_WAIT_SECONDS``, default 10 s) and answers with what is known.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import Field

from app.api import AnyOf, Api, Call
from app.schemas import RequestModel, ResponseModel
from domain.network_tokens import cryptograms, provisioning, service
from domain.network_tokens.views import READ, REVEAL
from infra.wait import Outcome
from storage.states import NetworkTokenStatus

api = Api()
TAG = "Network tokens"

_WAIT = (
    "The card network is called by a worker (the job id is the network's idempotency key); this request waits "
    "for the outcome up to `TESSERA_NETWORK_TOKEN_WAIT_SECONDS` (default 10 s) without holding a connection "
    "to the network."
)
_MASKING = (
    "`data.number` (the network token's own number, not the card's) is masked to its last four digits "
    "(`XXXXXXXXXXXX7892`) unless the key holds `network-token:reveal`; with both read and reveal, reveal wins."
)
_OBJECT = (
    "This implementation's design: `data` and `network_token` are null while the status is "
    "`inactive`; `card` is `{brand, bin (first six digits), last4, expiration_month, expiration_year}`; "
    "`token_id` / `token_intent_id` are null unless the network token was made from a token / a token intent "
    "(a token intent later converted to a token adds `token_id`, keeping `token_intent_id`); `_extras` is "
    "`{merchant_id, network_reference}` (the card network's own id of the token, null while inactive). "
    "`par` is the same for every network token of one card."
)
CREATE_TEXT = f"""Permission: `network-token:create`.

Exactly one source: `data` (raw card data), `token_id` (a card token of the tenant) or `token_intent_id` (a live \
token intent of the tenant); the source must hold card data with a number. `expiration_month` and \
`expiration_year` override the source's expiration: only with `token_id` or `token_intent_id`, only as a pair; \
the `card` object then shows the override values and the source is not changed. Violations answer 400 with \
`errors` keyed by property (`body`, `data.number`, `token_id`, `expiration_year` ...). The card's expiration, \
from the source or the overrides, must not be in the past.

Answers:
* **201** with the `active` network token when the network issued it within the wait.
* **202** with the network token `inactive` (its `data` null) when the network is slower: it becomes `active` \
when the worker finishes, with the event `network-token.created`. Poll `GET /network-tokens/{{id}}` or \
subscribe to the event.
* **422** when the network refuses: a problem with `code` `card_not_eligible` (title "Card not eligible") or \
`network_not_supported` (title "Network not supported"); no network token remains (the `inactive` record is \
removed, a decision of this implementation). When the refusal comes after a 202, the record is removed the same \
way, the \
event `network-token.failed` is emitted and `GET /network-tokens/{{id}}` answers 404 naming the failure.
* **422** "Provider not configured" for a production tenant when the deployment has no live card network \
(`TESSERA_CARD_NETWORK_URL`).
* **502** when the network could not be reached after every retry (a dead letter).

Transient network failures (timeouts, 5xx) are retried with backoff (1, 2, 4, 8, 16 s; six attempts). \
This implementation's design: `merchant_id` is passed to the network as given; the platform has no \
tenant merchant configuration yet, so without it the network's own default applies. Using `data` requires the \
caller to be PCI DSS compliant; that is a contractual matter the platform does not check (any key holding \
`network-token:create` may send it). `cardholder_info.name` defaults to the source card's `name`. A `token_id` \
or `token_intent_id` source needs no token or intent read permission: its card data never reaches the caller (only \
the `card` summary); the read is logged. Raw card data and cvc are kept encrypted only until provisioning ends. \
{_WAIT}

{_MASKING} {_OBJECT}"""


class Address(RequestModel):
    """A cardholder address: every line optional."""

    line1: str | None = Field(None, max_length=200)
    line2: str | None = Field(None, max_length=200)
    line3: str | None = Field(None, max_length=200)
    postal_code: str | None = Field(None, max_length=32)
    city: str | None = Field(None, max_length=200)
    state_code: str | None = Field(None, max_length=16)
    country_code: str | None = Field(None, max_length=3)


class CardholderInfo(RequestModel):
    """The cardholder sent to the network (`name` defaults to the source card's `name`)."""

    name: str | None = Field(None, max_length=200)
    address: Address | None = None


class NetworkTokenIn(RequestModel):
    """`POST /network-tokens`: exactly one of `data`, `token_id`, `token_intent_id`."""

    data: dict[str, Any] | None = Field(
        None,
        description="number (string, required), expiration_month (integer 1-12, required), "
        "expiration_year (four-digit integer, required), cvc (string of 3-4 digits, optional).",
    )
    token_id: str | None = Field(None, min_length=1, max_length=400, description="A card token of the tenant.")
    token_intent_id: uuid.UUID | None = Field(None, description="A live token intent of the tenant.")
    expiration_month: int | None = Field(None, ge=1, le=12, strict=True, description="Override; with expiration_year.")
    expiration_year: int | None = Field(None, ge=1000, le=9999, strict=True, description="Four-digit override.")
    cardholder_info: CardholderInfo | None = None
    merchant_id: uuid.UUID | None = Field(None, description="The tenant's merchant at the network.")


class NetworkTokenData(ResponseModel):
    """The network token's own card data (the DPAN and its expiration)."""

    number: str = Field(description="The network token's number: masked to its last four digits unless reveal.")
    expiration_month: int
    expiration_year: int


class Product(ResponseModel):
    """The card product."""

    code: str | None = None


class Issuer(ResponseModel):
    """The issuing bank."""

    name: str | None = None
    country: str | None = None


class IssuerCountry(ResponseModel):
    """The issuer's country."""

    alpha2: str | None = None
    name: str | None = None
    numeric: str | None = None


class NetworkTokenDetails(ResponseModel):
    """Network token details (`network_token`), as the card network gives them."""

    bin: str = Field(description="Six to eight digits.")
    last4: str
    expiration_month: int
    expiration_year: int
    brand: str | None = None
    funding: str | None = None
    segment: str | None = None
    product: Product | None = None
    issuer: Issuer | None = None
    issuer_country: IssuerCountry | None = None
    additional: list[dict[str, Any]] = Field(default_factory=list)


class CardOut(ResponseModel):
    """The card the network token was made from (expiration overrides applied)."""

    brand: str | None = None
    bin: str | None = None
    last4: str
    expiration_month: int
    expiration_year: int


class Extras(ResponseModel):
    """`_extras`: the merchant sent and the network's own id of the token."""

    merchant_id: str | None = None
    network_reference: str | None = None


class NetworkTokenOut(ResponseModel):
    """The network token object."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    data: NetworkTokenData | None = None
    network_token: NetworkTokenDetails | None = None
    card: CardOut
    status: NetworkTokenStatus
    par: str | None = None
    token_id: str | None = None
    token_intent_id: uuid.UUID | None = None
    created_by: uuid.UUID | None = None
    created_at: dt.datetime
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = None
    extras: Extras = Field(alias="_extras")


class Image(ResponseModel):
    """A card art image."""

    url: str | None = None
    description: str | None = None
    height: int | None = None
    width: int | None = None


class CardArt(ResponseModel):
    """Card art; availability varies by network and any member may be null."""

    background_color: str | None = Field(None, description="Hex colour, e.g. #1A1F71.")
    logo: Image | None = None
    card_image: Image | None = None


class AccountOut(ResponseModel):
    """The network token account."""

    card_art: CardArt


class CryptogramOut(ResponseModel):
    """A fresh cryptogram and its electronic commerce indicator."""

    cryptogram: str
    eci: str


async def _wait(call: Call, job_id: uuid.UUID) -> Outcome:
    """Wait for the job to settle, up to the configured bound (woken by its outcome message); its outcome
    (status and the safe part of its result)."""
    outcomes = await call.wait_for_jobs([job_id], timeout=call.settings.network_token_wait_seconds)
    return outcomes[job_id]


@api.route(
    "POST",
    "/network-tokens",
    permission="network-token:create",
    body=NetworkTokenIn,
    status=201,
    response=NetworkTokenOut,
    tag=TAG,
    summary="Create a network token (201 active, or 202 inactive while the network works)",
    errors=(400, 422, 502),
    description=CREATE_TEXT,
)
async def create(call: Call):
    """Record, wait, answer 201 / 202 / 422 (see the description)."""
    started = await call.db(provisioning.create_network_token, call.caller, call.body.model_dump())
    outcome = await _wait(call, started.job_id)
    answered = provisioning.settled_answer(None, call.require_caller(), started, outcome)  # on the loop: no statement
    if answered is not None:
        return answered
    return await call.db(provisioning.provisioning_outcome, call.caller, started, outcome=outcome)


@api.route(
    "GET",
    "/network-tokens/{id}",
    permission=AnyOf(READ, REVEAL),
    response=NetworkTokenOut,
    tag=TAG,
    summary="Get a network token",
    errors=(404,),
    description=f"{_MASKING} {_OBJECT} A network token removed because its provisioning failed answers 404 "
    "with a `code` naming the failure (a decision of this implementation); another tenant's answers a plain 404.",
)
async def get(call: Call):
    """The network token by the read rules."""
    return await call.db(service.read_network_token, call.caller, call.params["id"])


@api.route(
    "GET",
    "/network-tokens/{id}/account",
    permission=AnyOf(READ, REVEAL),
    response=AccountOut,
    tag=TAG,
    summary="Get a network token's account (card art)",
    errors=(404, 409, 502, 504),
    description="The card art the network issued for this network token: `background_color`, `logo` and "
    "`card_image` (each image `{url, description, height, width}`); availability varies by network and any of "
    "them may be null. Card art is fetched by a worker on the first call and then answered from storage for "
    "24 hours (a decision of this implementation); creating a network token never waits for it. Errors: 404 when the "
    "network token does not exist; 409 while it is `inactive` (no art exists yet); 502 when the network "
    f"refused or failed; 504 when it did not answer within the wait. {_WAIT}",
)
async def account(call: Call):
    """Card art: from storage when fresh, else fetched by a worker."""
    found = await call.db(service.card_art_start, call.caller, call.params["id"])
    if isinstance(found, dict):
        return found
    await _wait(call, found.job_id)
    return await call.db(service.card_art_outcome, call.caller, found)


@api.route(
    "POST",
    "/network-tokens/{id}/cryptogram",
    permission="network-token:cryptogram",
    response=CryptogramOut,
    tag=TAG,
    summary="Generate a cryptogram",
    errors=(404, 409, 502, 504),
    description="No body. A fresh `cryptogram` on every call, with its `eci` (`05` visa, `02` mastercard in the "
    "sandbox). Cryptograms are never stored: the worker seals the network's answer to a one-time key held only "
    "by this request and the sealed value is wiped once read. Only an `active` network token has cryptograms "
    "(409 otherwise, also when the network says it is not active); 502 when the network failed; 504 when it did "
    "not answer within the wait. Long and short cryptograms: the network's default form is returned (the "
    f"selection is this implementation's design). {_WAIT}",
)
async def cryptogram(call: Call):
    """A cryptogram sealed by the worker to this request's one-time key, opened here."""
    private, public = cryptograms.reply_keypair()
    started = await call.db(cryptograms.cryptogram_start, call.caller, call.params["id"], public)
    await _wait(call, started.job_id)
    sealed = await call.db(cryptograms.cryptogram_outcome, started)
    return cryptograms.open_cryptogram(private, started, sealed)


_CHANGE_TEXT = (
    "No body. The network is told by a worker and the state changes when it confirms: **200** with the network "
    "token in its new state when that happens within the wait, else **202** with the network token as it still "
    "is (a decision of this implementation); the change and its event (`{event}`) follow when the network confirms. "
    "409 when the network token is not `{required}` (also `inactive`) or another suspend/resume of it is under "
    "way, or when the network has deleted it; 502 when the network refused or could not be reached (nothing "
    f"changed). {_MASKING}"
)


@api.route(
    "PUT",
    "/network-tokens/{id}/suspend",
    permission="network-token:suspend",
    response=NetworkTokenOut,
    tag=TAG,
    summary="Suspend a network token",
    errors=(404, 409, 502),
    description="`active` -> `suspended`: it cannot be used for future transactions. "
    + _CHANGE_TEXT.format(event="network-token.suspended", required="active"),
)
async def suspend(call: Call):
    """Suspend at the network, then here."""
    return await _change(call, "suspend")


@api.route(
    "PUT",
    "/network-tokens/{id}/resume",
    permission="network-token:resume",
    response=NetworkTokenOut,
    tag=TAG,
    summary="Resume a network token",
    errors=(404, 409, 502),
    description="`suspended` -> `active`: usable again. "
    + _CHANGE_TEXT.format(event="network-token.resumed", required="suspended"),
)
async def resume(call: Call):
    """Resume at the network, then here."""
    return await _change(call, "resume")


async def _change(call: Call, action: str):
    """Record the change's job, wait for the network (bounded), answer the token as it then is."""
    started = await call.db(service.request_change, call.caller, call.params["id"], action)
    await _wait(call, started.job_id)
    return await call.db(service.change_outcome, call.caller, started)


@api.route(
    "DELETE",
    "/network-tokens/{id}",
    permission="network-token:delete",
    status=204,
    tag=TAG,
    summary="Delete a network token",
    errors=(404,),
    description="From any state: the network token is removed at once (204, event `network-token.deleted`) and "
    "the network is told by a worker, retried until it confirms "
    "(a decision of this implementation: the answer does not "
    "wait for the network). Deleting an `inactive` network token cancels its provisioning; if the network "
    "issues the token anyway, it is deleted there as soon as it answers.",
)
async def delete(call: Call):
    """Remove now; the network is told by a worker."""
    await call.db(service.delete_network_token, call.caller, call.params["id"])
