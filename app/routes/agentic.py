"""Agentic payment methods: ``/agentic/payment-methods...`` (spec 001 sections 2-8), with the deprecated
agents (:mod:`app.routes.agents`) and a catch-all for the rest of ``/agentic/``.

Problems under ``/agentic/`` take the agentic form (spec 001 section 7): ``type`` is a stable code of
the error catalogue (``domain/agentic/errors.py``), ``title`` the first message of a validation
failure, ``errors`` every failing field. The form is the ``problems`` attribute of each route here
(:func:`app.routes.agentic_common.agentic_form`, :func:`~app.routes.agentic_common.agents_form`), so
the framework applies it to the framing problems raised before a handler runs (401, 403, 400 invalid
body, 413, 415) and to the handler's own; a catch-all route gives other paths under ``/agentic/``
their 404 and 405 in the same form.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Literal

from pydantic import EmailStr, Field, field_validator

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, decode_cursor
from app.routes import agents as agent_routes
from app.routes.agentic_common import (
    ERROR_FORM,
    ErrorsQuery,
    ProviderErrorPage,
    QueryModel,
    RailErrorOut,
    agentic_form,
    agents_form,
    check_pair,
    claim_key,
    record_with_key,
)
from app.schemas import RequestModel, ResponseModel
from domain.agentic import idempotency, leases, service
from domain.agentic.consumers import canonical_language_code, normalize_country_code
from domain.agentic.errors import agentic_error
from infra.errors import Problem
from storage.states import PaymentMethodStatus, RailStatus

api = Api()

TAG = "Agentic payment methods"
PREFIX = "/agentic/"
AGENTS_PREFIX = "/agentic/agents"


# ---- models --------------------------------------------------------------------------------------


class SourceIn(RequestModel):
    """The card source (a discriminated union on ``type``; one member)."""

    type: Literal["svc_card_token"] = Field(description="Exactly `svc_card_token`.")
    token_id: uuid.UUID = Field(description="The id (a uuid) of a card token of the tenant.")


class ConsumerIn(RequestModel):
    """The consumer of a payment method."""

    email: EmailStr
    id: uuid.UUID | None = Field(None, description="Generated (a uuid) when omitted.")
    country_code: str | None = Field(None, description="ISO 3166-1 alpha-2; lowercase is upper-cased.")
    language_code: str | None = Field(
        None, min_length=2, max_length=35, description="A BCP 47 tag, canonicalised (`en-gb` -> `en-GB`)."
    )

    @field_validator("country_code")
    @classmethod
    def _country(cls, value: str | None) -> str | None:
        return None if value is None else normalize_country_code(value)

    @field_validator("language_code")
    @classmethod
    def _language(cls, value: str | None) -> str | None:
        return None if value is None else canonical_language_code(value)


class CreateIn(RequestModel):
    """The body of ``POST /agentic/payment-methods``."""

    source: SourceIn
    consumer: ConsumerIn
    agent_id: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="An agent of the tenant (informational); unknown: 404 AGENT_NOT_FOUND.",
    )


class RetryIn(RequestModel):
    """The body of ``POST .../rails/retry``: an existing rail, named by its pair."""

    rail: Literal["agentic-token", "spt"]
    provider: Literal["vic", "agentpay", "psp"] = Field(
        description="Valid pairs: agentic-token with vic or agentpay; spt with psp."
    )


class ListQuery(QueryModel):
    """The query of ``GET /agentic/payment-methods``."""

    size: int = Field(20, ge=1, le=100, description="Items per page, 1 to 100.")
    start: str | None = Field(None, description="The opaque cursor from pagination.next.")
    consumer_id: uuid.UUID | None = Field(None, description="Only this consumer's payment methods.")
    status: Literal["active", "deleted", "all"] = "active"


class DisplayOut(ResponseModel):
    """Card display data (all nullable)."""

    art_url: str | None = None
    background_color: str | None = None
    foreground_color: str | None = None
    description: str | None = None
    issuer_name: str | None = None


class CardOut(ResponseModel):
    """The card object: display data only, never the number or the security code."""

    type: Literal["card"] = "card"
    brand: str | None = None
    bin: str | None = None
    last4: str | None = None
    expiration_month: int | None = None
    expiration_year: int | None = None
    funding: str | None = None
    segment: str | None = None
    issuer: dict[str, Any] | None = None
    issuer_country: dict[str, Any] | None = None
    display: DisplayOut | None = None


class RailOut(ResponseModel):
    """A payment method rail."""

    rail: Literal["agentic-token", "spt"]
    provider: Literal["vic", "agentpay", "psp"]
    status: RailStatus
    error: RailErrorOut | None = Field(None, description="Only when status is error.")
    provider_ids: dict[str, str] = Field(description="Informational; the key set is not a stable contract.")


class ConsumerOut(ResponseModel):
    """The consumer, with its (possibly generated) id."""

    id: str
    email: str
    country_code: str | None = None
    language_code: str | None = None


class PaymentMethodOut(ResponseModel):
    """A payment method."""

    id: str = Field(description="`pm_` + 32 hex characters.")
    source: dict[str, Any]
    status: PaymentMethodStatus
    consumer: ConsumerOut
    card: CardOut | None
    rails: list[RailOut]
    agent_id: str | None = Field(None, description="Present when supplied.")
    created_at: dt.datetime
    updated_at: dt.datetime


PaymentMethodPage = CursorPage[PaymentMethodOut]


# ---- payment methods -----------------------------------------------------------------------------


_CREATE_TEXT = ERROR_FORM + (
    "Rails follow from the card: visa provisions `agentic-token`/`vic`, mastercard `agentic-token`/`agentpay`, "
    "and visa, mastercard and amex (the networks the processor supports) `spt`/`psp`; another network answers "
    "400 UNSUPPORTED_PROVIDER. The payment method, one rail per pair and one enrollment job per rail are "
    "recorded in one transaction; the rails are enrolled in parallel by workers (one job each) while the "
    "request waits up to `TESSERA_AGENTIC_WAIT_SECONDS` (10 s). The answer is 201 even when every rail "
    "failed: each rail is `enabled`, `error` (with `error.code` from the catalogue; an unclassifiable provider "
    "failure, a provider that does not answer within `TESSERA_AGENTIC_PROVIDER_TIMEOUT_SECONDS` and transient "
    "failures past 4 attempts record PROVIDER_ENROLLMENT_FAILED) or `pending` (still enrolling, or pending at "
    "the provider). A pending rail completes later without any call and its outcome is delivered as the event "
    "`agentic.payment-method.rail.retried`; the platform polls the provider for pending enrollments (0.5 s "
    "backing off to 30 s, for about 20 minutes, then PROVIDER_ENROLLMENT_FAILED) rather than taking its "
    "callback. A production tenant whose deployment has no live URL for a provider gets that rail in error "
    "PROVIDER_NOT_CONFIGURED.\n\n"
    "`source.token_id` must name a live card token of the tenant with an unexpired expiration date (else 400 "
    "INVALID_TOKEN). The caller needs no token read permission: `agentic:payment-method:create` lets the "
    "platform read the card for the providers only (public applications, which hold create permissions "
    "alone, can create). The card number and security code are sent to the providers and never stored on the "
    "payment method nor returned. `card` starts with what the token tells (brand, last4, expiration) and takes "
    "the provider's display data (bin, funding, issuer, display ...); a later successful retry backfills "
    "display values still null. `consumer.id` is generated when absent; `country_code` must be an assigned "
    "ISO 3166-1 alpha-2 code (upper-cased); `language_code` is canonicalised (BCP 47, `langcodes`).\n\n"
    "Idempotency: header `<prefix>-IDEMPOTENCY-KEY` (prefix: `TESSERA_HEADER_PREFIX`; 1 to 255 printable "
    "ASCII characters), scoped to the tenant; the key alone "
    "defines sameness and records never expire. Same key and body after success: 201 with the original payment "
    "method in its current state. Different body (canonical JSON compared): 409 IDEMPOTENCY_CONFLICT. While the "
    "first request runs (it holds the key until it answers): 409 IDEMPOTENCY_IN_PROGRESS. A conclusive failure "
    "after the key was taken (INVALID_TOKEN, AGENT_NOT_FOUND, UNSUPPORTED_PROVIDER) is replayed with the same "
    "code and status; body validation failures (VALIDATION_ERROR) and framing errors are answered before the "
    "key is taken and are not recorded. When the outcome cannot be told (the commit's answer was lost) the "
    "answer, and every replay, is 409 CREATE_OUTCOME_UNKNOWN; a request whose process died leaves its key "
    "settled on the next replay: the payment method if it was committed, else CREATE_OUTCOME_UNKNOWN. An "
    "internal error known to have written nothing answers 500 INTERNAL_ERROR and frees the key (repeat once "
    "with it). Two requests racing on one key create one payment method (a unique constraint)."
)

_EVENT_TEXT = (
    "Event `agentic.payment-method.rail.retried` (this implementation's design): emitted when a "
    "rail that was shown `pending` (by this answer or because the provider reported it pending) settles, "
    "whether it came from a create or a retry; data `{payment_method: {id, status}, rail: {rail, provider, "
    "status, provider_ids, error?: {code}}}` in the standard delivery envelope."
)


@api.route(
    "POST",
    "/agentic/payment-methods",
    permission="agentic:payment-method:create",
    body=CreateIn,
    status=201,
    response=PaymentMethodOut,
    problems=agentic_form,
    tag=TAG,
    summary="Create a payment method",
    errors=(400, 404, 409, 413, 415, 500),
    description=_CREATE_TEXT + "\n\n" + _EVENT_TEXT,
)
async def create(call: Call):
    """``POST /agentic/payment-methods`` (spec 001 section 4): 201 with the payment method."""
    body: CreateIn = call.body
    settings = call.settings
    request = service.CreateRequest(
        token_id=str(body.source.token_id),
        consumer=body.consumer.model_dump(mode="json", exclude_none=True),
        source={"type": body.source.type, "token_id": str(body.source.token_id)},
        agent_id=body.agent_id,
    )
    owner = leases.new_owner()
    claim = await claim_key(call, idempotency.CREATE_PAYMENT_METHOD, owner)
    if isinstance(claim, idempotency.Replay):
        return 201, await call.db(service.replay, call.caller, claim.resource_id)
    started = await record_with_key(
        call, service.create_unit, call.caller, request, settings=settings, owner=owner, claim=claim
    )
    outcomes = await call.wait_for_jobs(started.job_ids, timeout=settings.agentic_wait_seconds)
    view = service.answered(call.require_caller(), started.known, outcomes, claim=claim)  # on the loop: no statement
    if view is not None:
        return 201, view
    return 201, await call.db(
        service.finish_create,
        call.caller,
        started.payment_method_id,
        claim=claim,
        outcomes=outcomes,
        known=started.known,
    )


@api.route(
    "GET",
    "/agentic/payment-methods",
    query=ListQuery,
    permission="agentic:payment-method:get",
    response=PaymentMethodPage,
    problems=agentic_form,
    tag=TAG,
    summary="List payment methods",
    errors=(400,),
    description=ERROR_FORM
    + (
        "Cursor pagination, newest first (created_at, then id). `size` 1 to 100 (default 20, else 400 "
        "VALIDATION_ERROR); `start` is the opaque cursor of `pagination.next`; `consumer_id` filters by consumer; "
        "`status` is `active` (default), `deleted` or `all`. A page may be shorter than `size` while more remain: "
        "the end is the absence of `pagination.next`."
    ),
)
async def list_(call: Call):
    """``GET /agentic/payment-methods``: a cursor page, newest first."""
    q: ListQuery = call.query
    data, next_position = await call.db(
        service.list_payment_methods,
        call.caller,
        size=q.size,
        after=decode_cursor(call, q.start),
        consumer_id=str(q.consumer_id) if q.consumer_id else None,
        status=q.status,
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "GET",
    "/agentic/payment-methods/{payment_method_id}",
    permission="agentic:payment-method:get",
    response=PaymentMethodOut,
    problems=agentic_form,
    tag=TAG,
    summary="Get a payment method",
    errors=(404,),
    description=ERROR_FORM + "404 PAYMENT_METHOD_NOT_FOUND when absent in the tenant. Deleted payment methods "
    "are returned with status `deleted`.",
)
async def get(call: Call):
    """``GET /agentic/payment-methods/{payment_method_id}``."""
    return await call.db(service.read_payment_method, call.caller, call.params["payment_method_id"])


@api.route(
    "POST",
    "/agentic/payment-methods/{payment_method_id}/rails/retry",
    permission="agentic:payment-method:create",
    body=RetryIn,
    response=PaymentMethodOut,
    problems=agentic_form,
    tag=TAG,
    summary="Retry a rail",
    errors=(400, 404, 409, 413, 415, 422),
    description=ERROR_FORM
    + (
        "Retries the enrollment of a rail in `error` or `pending` with its provider (the provider is told it is "
        "a retry), in a worker, waiting up to `TESSERA_AGENTIC_WAIT_SECONDS`. 200 with the complete payment "
        "method: the rail `enabled`, `pending` (the outcome arrives as the event; a retry still running when the "
        "wait ends is shown pending too) or, for a rejection, the problem: 422 with the provider's catalogue "
        "code (CARD_REJECTED, PROVIDER_ENROLLMENT_FAILED, RAIL_ENROLLMENT_INVALID, PROVIDER_NOT_CONFIGURED; "
        "`debug.provider_correlation` when the provider sent one) or 409 RAIL_ALREADY_ENROLLED; a rejected retry "
        "leaves the rail in `error` (with the latest code). A successful retry backfills null display values of "
        "`card`. Errors before any provider call: 400 VALIDATION_ERROR (body; an invalid rail/provider pair "
        "names the `provider` field; a rail already `enabled`), 404 PAYMENT_METHOD_NOT_FOUND, 400 "
        "PAYMENT_METHOD_DELETED, 400 RAIL_NOT_FOUND (a valid pair absent from the payment method), 400 "
        "INVALID_TOKEN (the card token is gone), 409 PAYMENT_METHOD_OPERATION_IN_PROGRESS (an enrollment or "
        "retry in flight), 409 PAYMENT_METHOD_DELETE_IN_PROGRESS, 409 PAYMENT_METHOD_DELETE_INCOMPLETE (a delete "
        "stopped during its cascade: repeat DELETE).\n\n" + _EVENT_TEXT
    ),
)
async def retry(call: Call):
    """``POST .../rails/retry``: 200 with the payment method, or the rejection's problem."""
    body: RetryIn = call.body
    check_pair(body.rail, body.provider)
    pm_id = call.params["payment_method_id"]
    started = await call.db(
        service.start_retry,
        call.caller,
        pm_id,
        rail=body.rail,
        provider=body.provider,
        settings=call.settings,
        owner=leases.new_owner(),
    )
    if started.failure is not None:
        raise agentic_error(started.failure)
    job_id = started.job_ids[0]
    outcomes = await call.wait_for_jobs([job_id], timeout=call.settings.agentic_wait_seconds)
    view = service.answered(call.require_caller(), started.known, outcomes)  # on the loop: no statement
    if view is not None:
        return view
    result = await call.db(
        service.finish_retry,
        call.caller,
        pm_id,
        rail=body.rail,
        provider=body.provider,
        job_id=job_id,
        outcome=outcomes.get(job_id),
        known=started.known,
    )
    if isinstance(result, Problem):
        raise result
    return result


@api.route(
    "GET",
    "/agentic/payment-methods/{payment_method_id}/errors",
    query=ErrorsQuery,
    permission="agentic:payment-method:get",
    response=ProviderErrorPage,
    problems=agentic_form,
    tag=TAG,
    summary="List a payment method's provider errors",
    errors=(400, 404),
    description=ERROR_FORM
    + (
        "The provider error objects (`prv_` ids) recorded whenever a provider enrollment of the payment method "
        "failed (`operation` `enrollment`) or a delete cascade could not remove one (`operation` `deletion`), "
        "newest first (occurred_at, then id), cursor paginated (`size` 1 to 100, default 20; `start`). Kept 90 "
        "days (`TESSERA_PROVIDER_ERROR_RETENTION_DAYS`), then removed by a beat sweep. `title` and `detail` are "
        "the catalogue's; provider bodies and messages, source data and credential values are never included "
        "(`provider_code` is the provider's own code, or `HTTP_<status>` when it sent none). 404 "
        "PAYMENT_METHOD_NOT_FOUND."
    ),
)
async def errors(call: Call):
    """``GET .../errors``: a cursor page of provider errors, newest first."""
    q: ErrorsQuery = call.query
    data, next_position = await call.db(
        service.list_provider_errors,
        call.caller,
        call.params["payment_method_id"],
        size=q.size,
        after=decode_cursor(call, q.start),
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "DELETE",
    "/agentic/payment-methods/{payment_method_id}",
    permission="agentic:payment-method:delete",
    status=204,
    problems=agentic_form,
    tag=TAG,
    summary="Delete a payment method",
    errors=(404, 409, 500),
    description=ERROR_FORM
    + (
        "204, no body. The cascade first cancels every allowance the payment method backs at its providers "
        "(they become `cancelled`, no further verification or minting), then removes each rail's enrollment at "
        "its provider, in a worker, while the request waits up to `TESSERA_AGENTIC_WAIT_SECONDS`; then the "
        "payment method is `deleted` (its updated_at moves once). A payment method with nothing enrolled and no "
        "allowance is deleted at once. 409 PAYMENT_METHOD_OPERATION_IN_PROGRESS also while an operation on one "
        "of its allowances (a mint, a verification, an update, a cancellation) is in flight. Repeating DELETE "
        "on a deleted payment method answers 204 without any provider call and "
        "leaves updated_at unchanged. 409 PAYMENT_METHOD_OPERATION_IN_PROGRESS while an enrollment or retry is "
        "in flight, 409 PAYMENT_METHOD_DELETE_IN_PROGRESS while a cascade runs (also when the wait ends first: "
        "repeat the DELETE), 500 PROVIDER_ALLOWANCE_CANCEL_FAILED when a provider removal failed: the cascade "
        "stopped half-way, retries answer 409 PAYMENT_METHOD_DELETE_INCOMPLETE, and the next DELETE resumes it "
        "with the removals still to do. 404 PAYMENT_METHOD_NOT_FOUND."
    ),
)
async def delete(call: Call):
    """``DELETE /agentic/payment-methods/{payment_method_id}``: 204."""
    pm_id = call.params["payment_method_id"]
    started = await call.db(service.start_delete, call.caller, pm_id, settings=call.settings, owner=leases.new_owner())
    if started.job_ids:
        await call.wait_for_jobs(started.job_ids, timeout=call.settings.agentic_wait_seconds)
        await call.db(service.finish_delete, call.caller, pm_id, started.job_ids)


# ---- everything else under /agentic/ -------------------------------------------------------------

#: The deprecated agents resource shares the registry, ahead of the catch-all route below.
api.routes.extend(agent_routes.api.routes)


@api.route(
    "*",
    "/agentic/{rest:.*}",
    problems=agentic_form,
    tag=TAG,
    summary="No resource",
    status=404,
    auth=False,
    documented=False,
)
async def nothing_here(call: Call):
    """Any other path under ``/agentic/``: 404 NOT_FOUND (405 METHOD_NOT_ALLOWED with ``Allow`` when the
    path exists with other methods), in the agentic form (plus ``Deprecation`` under the agents)."""
    request = call.request
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is request.match_info.route.resource:
            continue
        match, methods = await resource.resolve(request)
        if match is None:
            allowed |= methods
    if allowed:
        problem = Problem(
            405, "This method is not allowed on this path.", headers={"Allow": ", ".join(sorted(allowed))}
        )
    else:
        problem = Problem(404, "No resource exists at this path.")
    raise (agents_form if request.path.startswith(AGENTS_PREFIX) else agentic_form)(problem)
