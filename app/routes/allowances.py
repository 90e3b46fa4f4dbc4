"""Allowances and payment credentials: ``/agentic/allowances...`` (spec 001 sections 3, 7 and 8).

The reference names these endpoints through its error catalogue, idempotency table and limits but
shows no shapes: the contract here is the platform's, in the style of the payment method endpoints,
and is written into each operation's OpenAPI description. Problems take the agentic form
(:func:`app.routes.agentic_common.agentic_form`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import AwareDatetime, Field

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, decode_cursor
from app.routes.agentic_common import (
    ERROR_FORM,
    ErrorsQuery,
    ProviderErrorPage,
    QueryModel,
    RailErrorOut,
    agentic_form,
    check_pair,
    claim_key,
    record_with_key,
)
from app.schemas import RequestModel, ResponseModel
from domain.agentic import allowances as service
from domain.agentic import credentials, idempotency, leases
from domain.agentic.errors import agentic_error, validation_error
from domain.agentic.money import currency_errors, parse_money
from infra.errors import Problem
from storage.states import AllowanceStatus, PublicAllowanceRailStatus

api = Api()

TAG = "Agentic allowances"
MERGE_PATCH = ("application/merge-patch+json", "application/json")
Rail = Literal["agentic-token", "spt"]
Provider = Literal["vic", "agentpay", "psp"]


# ---- models --------------------------------------------------------------------------------------


class MoneyIn(RequestModel):
    """An amount: ``value`` a decimal string (a JSON number is read as its decimal), ``currency`` an
    ISO 4217 code."""

    value: str | int | float = Field(
        description='A decimal string above 0, like "25.00"; at most the '
        "currency's minor unit digits (USD 2, JPY 0, BHD 3)."
    )
    currency: str = Field(min_length=3, max_length=3, description="ISO 4217, like USD (lower case is upper-cased).")


class AllowanceCreateIn(RequestModel):
    """The body of ``POST /agentic/allowances``."""

    payment_method_id: str = Field(min_length=1, max_length=40)
    amount: MoneyIn
    description: str | None = Field(None, max_length=service.MAX_DESCRIPTION)
    expires_at: AwareDatetime | None = Field(None, description="Default 30 days from now; at most a year away.")


class AllowancePatchIn(RequestModel):
    """The merge-patch body of ``PATCH /agentic/allowances/{allowance_id}``."""

    amount: MoneyIn | None = None
    description: str | None = Field(None, max_length=service.MAX_DESCRIPTION, description="null clears it.")
    expires_at: AwareDatetime | None = None


class VerificationIn(RequestModel):
    """The body of ``POST .../rails/verify``."""

    rail: Rail
    provider: Provider
    action: Literal["start", "submit_otp"]
    otp: str | None = Field(None, min_length=1, max_length=16, description="Required for submit_otp.")


class MppIn(RequestModel):
    """What an ``mpp`` credential is sealed for."""

    key_set_url: str = Field(
        min_length=1, max_length=2048, description="The merchant's JWK set address (fetched through the SSRF guard)."
    )
    challenge: str = Field(min_length=1, max_length=1024)


class CredentialMintIn(RequestModel):
    """The body of ``POST .../credentials``."""

    rail: Rail
    provider: Provider
    format: Literal["card", "network-token", "identifier", "mpp"]
    amount: MoneyIn
    mpp: MppIn | None = None


class AllowanceListQuery(QueryModel):
    """The query of ``GET /agentic/allowances``."""

    size: int = Field(20, ge=1, le=100, description="Items per page, 1 to 100.")
    start: str | None = Field(None, description="The opaque cursor from pagination.next.")
    payment_method_id: str | None = Field(None, max_length=40)
    status: AllowanceStatus | None = None


class MoneyOut(ResponseModel):
    """An exact amount."""

    value: str = Field(description='A decimal string, like "25.00" (never a number).')
    currency: str


class AllowanceRailOut(ResponseModel):
    """An allowance rail."""

    rail: Rail
    provider: Provider
    status: PublicAllowanceRailStatus
    error: RailErrorOut | None = Field(None, description="Only when status is error.")
    provider_ids: dict[str, str] = Field(description="Informational; the key set is not a stable contract.")


class AllowanceOut(ResponseModel):
    """An allowance."""

    id: str = Field(description="`alw_` + 32 hex characters.")
    payment_method_id: str
    status: AllowanceStatus
    amount: MoneyOut
    amount_available: MoneyOut
    amount_reserved: MoneyOut
    amount_spent: MoneyOut
    description: str | None
    expires_at: dt.datetime
    rails: list[AllowanceRailOut]
    created_at: dt.datetime
    updated_at: dt.datetime


AllowancePage = CursorPage[AllowanceOut]


class VerificationOut(ResponseModel):
    """A verification step's outcome."""

    status: Literal["otp_sent", "verified"]
    rail: AllowanceRailOut


class CredentialOut(ResponseModel):
    """A payment credential."""

    id: str = Field(description="`pcr_` + 32 hex characters.")
    allowance_id: str
    rail: Rail
    provider: Provider
    format: Literal["card", "network-token", "identifier", "mpp"]
    amount: MoneyOut
    credential: dict[str, Any] | None = Field(
        None,
        description="Only in the mint's answer: {number, expiration_month, expiration_year, cvc} (card, "
        "network-token), {id} (identifier) or {token} (mpp).",
    )
    expires_at: dt.datetime | None
    created_at: dt.datetime


# ---- helpers -------------------------------------------------------------------------------------


def _amount(amount: MoneyIn, path: str = "amount") -> tuple[Any, str]:
    """``(Decimal, currency)`` of a body amount, else 400 VALIDATION_ERROR naming its fields."""
    currency = amount.currency.upper()
    errors: dict[str, list[str]] = {}
    messages = currency_errors(currency)
    if messages:
        errors[f"{path}.currency"] = messages
    value, messages = parse_money(amount.value, currency)
    if messages:
        errors[f"{path}.value"] = messages
    if errors:
        raise validation_error(errors)
    return value, currency


def _allowance_id(call: Call) -> str:
    return call.params["allowance_id"]


_CONTRACT = (
    "The allowance contract is this implementation's design: an allowance `alw_...` "
    "{id, payment_method_id, status (`pending_verification` until every rail "
    "that needs verification is verified, `active`, `cancelled`, `expired`: terminal, also shown once "
    '`expires_at` passed), amount, amount_available, amount_reserved, amount_spent (each `{value: "25.00", '
    'currency: "USD"}`: exact decimal strings with the currency\'s minor unit digits, never numbers; '
    "available + reserved + spent = amount at every moment, enforced by the database), description, "
    "expires_at, rails [{rail, provider, status: active | inactive | error, error?: {code}, provider_ids}], "
    "created_at, updated_at}. "
)


# ---- allowances ----------------------------------------------------------------------------------


@api.route(
    "POST",
    "/agentic/allowances",
    permission="agentic:allowance:create",
    body=AllowanceCreateIn,
    status=201,
    response=AllowanceOut,
    problems=agentic_form,
    tag=TAG,
    summary="Create an allowance",
    errors=(400, 404, 409, 413, 415, 500),
    description=ERROR_FORM
    + _CONTRACT
    + (
        "Body: `payment_method_id`, `amount`, optional `description` (at most 1,000 characters) and `expires_at` "
        "(default 30 days from now; in the future and at most a year away, else 400 VALIDATION_ERROR). The "
        "payment method's `enabled` rails become the allowance's rails, each set up at its provider in parallel "
        "by workers (one job each) while the request waits up to `TESSERA_AGENTIC_WAIT_SECONDS`; 201 even when "
        "a rail failed: that rail is `error` with its code (PROVIDER_ALLOWANCE_FAILED for a rejection or an "
        "unclassifiable failure, PROVIDER_NOT_CONFIGURED) and a provider error object is recorded; a rail still "
        "being set up when the wait ends is shown `inactive`. `agentic-token` rails start `inactive` until "
        "verified (POST .../rails/verify), `spt` rails are `active` from creation. An allowance whose every rail "
        "failed is `active` with no usable rail (mints answer RAIL_NOT_ACTIVE). Errors: 404 "
        "PAYMENT_METHOD_NOT_FOUND, 400 PAYMENT_METHOD_DELETED (also while its delete runs), 400 NO_ACTIVE_RAILS "
        "(no enabled rail). Idempotency: header `<prefix>-IDEMPOTENCY-KEY` exactly as for payment method "
        "creates (same key and body: 201 with the allowance as it is now; another body: 409 "
        "IDEMPOTENCY_CONFLICT; while running: 409 IDEMPOTENCY_IN_PROGRESS; conclusive failures replayed; a lost "
        "commit: 409 CREATE_OUTCOME_UNKNOWN on every replay: list by payment_method_id before creating again "
        "with a new key). Event `agentic.allowance.updated` `{allowance: {id, status}}` on every status change."
    ),
)
async def create(call: Call):
    """``POST /agentic/allowances``: 201 with the allowance."""
    body: AllowanceCreateIn = call.body
    value, currency = _amount(body.amount)
    request = service.CreateRequest(body.payment_method_id, value, currency, body.description, body.expires_at)
    owner = leases.new_owner()
    claim = await claim_key(call, idempotency.CREATE_ALLOWANCE, owner)
    if isinstance(claim, idempotency.Replay):
        return 201, await call.db(service.read_allowance, call.caller, claim.resource_id)
    recorded = await record_with_key(
        call, service.create_unit, call.caller, request, settings=call.settings, owner=owner, claim=claim
    )
    await call.wait_for_jobs(recorded.job_ids, timeout=call.settings.agentic_wait_seconds)
    return 201, await call.db(service.finish_create, call.caller, recorded.resource_id, claim=claim)


@api.route(
    "GET",
    "/agentic/allowances",
    query=AllowanceListQuery,
    permission="agentic:allowance:get",
    response=AllowancePage,
    problems=agentic_form,
    tag=TAG,
    summary="List allowances",
    errors=(400,),
    description=ERROR_FORM
    + (
        "Cursor pagination, newest first (created_at, then id). `size` 1 to 100 (default 20); `start` the "
        "opaque cursor of `pagination.next`; `payment_method_id` and `status` filter (`expired` includes live "
        "allowances past their expiry). The end is the absence of `pagination.next`."
    ),
)
async def list_(call: Call):
    """``GET /agentic/allowances``: a cursor page, newest first."""
    q: AllowanceListQuery = call.query
    data, next_position = await call.db(
        service.list_allowances,
        call.caller,
        size=q.size,
        after=decode_cursor(call, q.start),
        payment_method_id=q.payment_method_id,
        status=q.status,
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "GET",
    "/agentic/allowances/{allowance_id}",
    permission="agentic:allowance:get",
    response=AllowanceOut,
    problems=agentic_form,
    tag=TAG,
    summary="Get an allowance",
    errors=(404,),
    description=ERROR_FORM + _CONTRACT + "404 ALLOWANCE_NOT_FOUND when absent in the tenant.",
)
async def get(call: Call):
    """``GET /agentic/allowances/{allowance_id}``."""
    return await call.db(service.read_allowance, call.caller, _allowance_id(call))


@api.route(
    "GET",
    "/agentic/allowances/{allowance_id}/errors",
    query=ErrorsQuery,
    permission="agentic:allowance:get",
    response=ProviderErrorPage,
    problems=agentic_form,
    tag=TAG,
    summary="List an allowance's provider errors",
    errors=(400, 404),
    description=ERROR_FORM
    + (
        "The provider error objects (`prv_` ids) recorded for the allowance: rail setups (`operation` "
        "`allowance`), updates (`allowance_update`), verifications (`verification`), cancellations "
        "(`cancellation`) and mints (`credentials`, with `payment_credential_id` even when minting failed), "
        "newest first, cursor paginated (`size` 1 to 100, default 20; `start`); kept 90 days. Provider bodies, "
        "messages and credential values are never included. 404 ALLOWANCE_NOT_FOUND."
    ),
)
async def errors(call: Call):
    """``GET .../errors``: a cursor page of provider errors, newest first."""
    q: ErrorsQuery = call.query
    data, next_position = await call.db(
        service.list_provider_errors, call.caller, _allowance_id(call), size=q.size, after=decode_cursor(call, q.start)
    )
    return cursor_page(call, data, size=q.size, next_position=next_position)


@api.route(
    "PATCH",
    "/agentic/allowances/{allowance_id}",
    permission="agentic:allowance:update",
    body=AllowancePatchIn,
    response=AllowanceOut,
    problems=agentic_form,
    tag=TAG,
    summary="Update an allowance",
    errors=(400, 404, 409, 413, 415, 422),
    request_content_type=MERGE_PATCH,
    description=ERROR_FORM
    + (
        "A merge patch (`application/merge-patch+json`; `application/json` is taken too) of `amount`, "
        "`description` (null clears it) and `expires_at` (in the future, at most a year away); absent fields "
        "are kept, `amount` and `expires_at` cannot be null. The providers are asked first, in a worker, while "
        "the request waits up to `TESSERA_AGENTIC_WAIT_SECONDS`; the allowance changes only when every provider "
        "agreed (`amount_available` follows the new amount). 422 PROVIDER_ALLOWANCE_UPDATE_FAILED leaves the "
        "allowance unchanged (a provider that agreed before another refused keeps the new values). 400 "
        "VALIDATION_ERROR: an amount below amount_reserved + amount_spent, another currency. 400 "
        "ALLOWANCE_CANCELLED / ALLOWANCE_EXPIRED. 409 ALLOWANCE_UPDATE_IN_PROGRESS while an update (or the "
        "rails' setup) runs, and the in-progress code of any other operation in flight "
        "(ALLOWANCE_CREDENTIAL_IN_PROGRESS, ALLOWANCE_VERIFICATION_IN_PROGRESS, ALLOWANCE_DELETE_IN_PROGRESS). "
        "A reservation whose mint lease is stale becomes spent first. 404 ALLOWANCE_NOT_FOUND."
    ),
)
async def update(call: Call):
    """``PATCH /agentic/allowances/{allowance_id}``: 200 with the allowance."""
    body: AllowancePatchIn = call.body
    changes: dict[str, Any] = {}
    nulls = {}
    for name in body.model_fields_set:
        value = getattr(body, name)
        if value is None and name in ("amount", "expires_at"):
            nulls[name] = ["may not be null"]
        elif name == "amount":
            changes[name] = _amount(value)
        else:
            changes[name] = value
    if nulls:
        raise validation_error(nulls)
    allowance_id = _allowance_id(call)
    recorded = await call.db(
        service.start_update, call.caller, allowance_id, changes, settings=call.settings, owner=leases.new_owner()
    )
    await call.wait_for_jobs(recorded.job_ids, timeout=call.settings.agentic_wait_seconds)
    return await call.db(service.finish_update, call.caller, allowance_id, recorded.job_ids)


@api.route(
    "DELETE",
    "/agentic/allowances/{allowance_id}",
    permission="agentic:allowance:delete",
    status=204,
    problems=agentic_form,
    tag=TAG,
    summary="Cancel an allowance",
    errors=(404, 409, 500),
    description=ERROR_FORM
    + (
        "204, no body. Cancels the allowance at every provider (in a worker; the request waits up to "
        "`TESSERA_AGENTIC_WAIT_SECONDS`), recording each provider's cancellation as it happens, then the "
        "allowance is `cancelled` (event `agentic.allowance.updated`; the amounts stay as they are, nothing more "
        "can be minted). 500 PROVIDER_ALLOWANCE_CANCEL_FAILED when a provider refused: repeat the same DELETE, "
        "which resumes with the providers still to do (meanwhile mints, updates and verifications answer "
        "ALLOWANCE_CANCELLED). 409 ALLOWANCE_DELETE_IN_PROGRESS while a cancellation runs (also when the wait "
        "ends first), and the in-progress code of another operation in flight. A cancelled or expired "
        "allowance answers 204 without any provider call. Deleting the payment method cancels its allowances "
        "the same way. 404 ALLOWANCE_NOT_FOUND."
    ),
)
async def delete(call: Call):
    """``DELETE /agentic/allowances/{allowance_id}``: 204."""
    allowance_id = _allowance_id(call)
    recorded = await call.db(
        service.start_cancel, call.caller, allowance_id, settings=call.settings, owner=leases.new_owner()
    )
    if recorded.job_ids:
        await call.wait_for_jobs(recorded.job_ids, timeout=call.settings.agentic_wait_seconds)
        await call.db(service.finish_cancel, call.caller, allowance_id, recorded.job_ids)


@api.route(
    "POST",
    "/agentic/allowances/{allowance_id}/rails/verify",
    permission="agentic:allowance:verify",
    body=VerificationIn,
    response=VerificationOut,
    problems=agentic_form,
    tag=TAG,
    summary="Verify an allowance rail",
    errors=(400, 404, 409, 413, 415, 422),
    description=ERROR_FORM
    + (
        '`{rail, provider, action: "start" | "submit_otp", otp?}` answers `{status: "otp_sent" | '
        '"verified", rail}` (the rail object). `start` has the provider send a code (again: a new code); '
        "`submit_otp` sends `otp` (required) and a right code makes the rail `active` (and the allowance "
        "`active` once no rail awaits verification). The provider is asked in a worker while the request "
        "waits. Errors: 400 VALIDATION_ERROR (body; an invalid pair names `provider`; `otp` missing), 404 "
        "ALLOWANCE_NOT_FOUND, 400 ALLOWANCE_CANCELLED / ALLOWANCE_EXPIRED / PAYMENT_METHOD_DELETED, 400 "
        "RAIL_NOT_FOUND, 400 VERIFICATION_NOT_REQUIRED (an `spt` rail: active from creation), 400 "
        "RAIL_NOT_ACTIVE (a rail whose setup failed), 400 VERIFICATION_STATE_INVALID (out of order: `start` on "
        "a verified rail, a code when none is awaited, after the provider ended a verification: restart with "
        "`start`), 400 INVALID_OTP (with `attempts_remaining`) until the provider's attempt limit, then 422 "
        "PROVIDER_VERIFICATION_FAILED (restart), 422 VERIFICATION_NOT_SUPPORTED (the provider has no "
        "verification: use the spt rail), 409 ALLOWANCE_VERIFICATION_IN_PROGRESS (and the in-progress code of "
        "another operation in flight)."
    ),
)
async def verify(call: Call):
    """``POST .../rails/verify``: 200 ``{status, rail}``."""
    body: VerificationIn = call.body
    check_pair(body.rail, body.provider)
    if body.action == "submit_otp" and body.otp is None:
        raise validation_error({"otp": ["is required for submit_otp"]})
    allowance_id = _allowance_id(call)
    recorded = await call.db(
        service.start_verification,
        call.caller,
        allowance_id,
        rail=body.rail,
        provider=body.provider,
        action=body.action,
        otp=body.otp,
        settings=call.settings,
        owner=leases.new_owner(),
    )
    await call.wait_for_jobs(recorded.job_ids, timeout=call.settings.agentic_wait_seconds)
    return await call.db(
        service.finish_verification,
        call.caller,
        allowance_id,
        rail=body.rail,
        provider=body.provider,
        job_id=recorded.job_ids[0],
    )


# ---- credentials ---------------------------------------------------------------------------------


@api.route(
    "POST",
    "/agentic/allowances/{allowance_id}/credentials",
    permission="agentic:credential:create",
    body=CredentialMintIn,
    status=201,
    response=CredentialOut,
    problems=agentic_form,
    tag=TAG,
    summary="Mint a payment credential",
    errors=(400, 404, 409, 413, 415, 422, 500, 502),
    description=ERROR_FORM
    + (
        "`{rail, provider, format, amount, mpp?: {key_set_url, challenge}}`; `format` one the rail allows "
        "(agentic-token: card, network-token, mpp; spt: identifier, mpp; else 400 VALIDATION_ERROR naming "
        "`format`); `mpp` required for mpp only. 201 with the payment credential `pcr_...` {id, allowance_id, "
        "rail, provider, format, amount, credential, expires_at, created_at}: `credential` is {number, "
        "expiration_month, expiration_year, cvc} (card, network-token), {id} (identifier) or {token} (mpp, a "
        "JWE sealed for the merchant's key) and is returned this once: it is never stored readable.\n\n"
        "Only one mint reserves an allowance at a time (409 ALLOWANCE_CREDENTIAL_IN_PROGRESS). The amount "
        "moves available -> reserved under a five-minute operation lease before the provider is called (in a "
        "worker, with the credential id as its idempotency key); one transaction then moves reserved -> spent "
        "and records the credential, or clears the reservation on a conclusive failure: 422 "
        "PROVIDER_CREDENTIALS_FAILED. An unknown outcome (the provider did not answer in time) moves the amount "
        "to spent and records no credential: 409 CREDENTIAL_OUTCOME_UNKNOWN. A reservation whose worker died "
        "becomes spent once its lease is stale, on the next mint, update, cancellation or verification, or by "
        "a beat sweep. The merchant's key set is fetched from `key_set_url` through the platform's outbound "
        "client (its SSRF rules): an unsafe address is 400 VALIDATION_ERROR, a failed fetch 502 "
        "MPP_KEY_UNAVAILABLE; both clear the amount and make no provider call. If the wait ends before the "
        "provider answered: 409 ALLOWANCE_CREDENTIAL_IN_PROGRESS; the value is then never shown (kept "
        "encrypted for at most 10 minutes, then destroyed by a beat sweep), and a replay with the key answers "
        "409 IDEMPOTENCY_IN_PROGRESS until the worker ends, then the outcome (CREDENTIAL_PAYLOAD_UNAVAILABLE "
        "after a success). Other "
        "errors: 404 ALLOWANCE_NOT_FOUND, 400 ALLOWANCE_CANCELLED, ALLOWANCE_EXPIRED (terminal), "
        "PAYMENT_METHOD_DELETED, RAIL_NOT_FOUND, RAIL_NOT_ACTIVE (complete verification), "
        "ALLOWANCE_AMOUNT_EXCEEDED (above amount_available), VALIDATION_ERROR (another currency).\n\n"
        "Idempotency (`<prefix>-IDEMPOTENCY-KEY`, optional): same key and body after success: 409 "
        "CREDENTIAL_PAYLOAD_UNAVAILABLE with no provider call; another body: 409 IDEMPOTENCY_CONFLICT; while "
        "running: 409 IDEMPOTENCY_IN_PROGRESS; a conclusive failure is replayed with its code and status; an "
        "unknown outcome answers 409 CREDENTIAL_OUTCOME_UNKNOWN on every replay. Event "
        "`agentic.credential.created` `{credential: {id}, allowance: {id, status}}`."
    ),
)
async def mint(call: Call):
    """``POST .../credentials``: 201 with the credential and its value."""
    body: CredentialMintIn = call.body
    check_pair(body.rail, body.provider)
    mpp = body.mpp.model_dump() if body.mpp is not None else None
    problems = credentials.format_errors(body.provider, body.format, mpp)
    if mpp is not None and not problems:
        messages = credentials.key_set_url_errors(
            mpp["key_set_url"], allow_private=call.settings.allow_private_destinations
        )
        if messages:
            problems["mpp.key_set_url"] = messages
    if problems:
        raise validation_error(problems)
    value, currency = _amount(body.amount)
    request = credentials.MintRequest(body.rail, body.provider, body.format, value, currency, mpp)
    wait = call.settings.agentic_wait_seconds + call.settings.agentic_provider_timeout_seconds
    claim = await claim_key(call, idempotency.MINT_CREDENTIAL, leases.new_owner(), wait_seconds=wait)
    if isinstance(claim, idempotency.Replay):
        raise agentic_error("CREDENTIAL_PAYLOAD_UNAVAILABLE")
    recorded = await record_with_key(
        call,
        credentials.mint_unit,
        call.caller,
        _allowance_id(call),
        request,
        settings=call.settings,
        claim=claim,
        unknown_code="CREDENTIAL_OUTCOME_UNKNOWN",
    )
    await call.wait_for_jobs(recorded.job_ids, timeout=wait)
    answer = await call.db(credentials.finish_mint, call.caller, recorded.resource_id, recorded.job_ids[0], claim)
    if isinstance(answer, Problem):
        raise answer
    return 201, answer


@api.route(
    "GET",
    "/agentic/allowances/{allowance_id}/credentials/{credential_id}",
    permission="agentic:credential:get",
    response=CredentialOut,
    problems=agentic_form,
    tag=TAG,
    summary="Get a payment credential",
    errors=(404,),
    description=ERROR_FORM
    + (
        "The payment credential without its value (`credential` is never shown again). 404 "
        "ALLOWANCE_NOT_FOUND, 404 PAYMENT_CREDENTIAL_NOT_FOUND (also for a mint that issued nothing)."
    ),
)
async def get_credential(call: Call):
    """``GET .../credentials/{credential_id}``."""
    return await call.db(credentials.read_credential, call.caller, _allowance_id(call), call.params["credential_id"])
