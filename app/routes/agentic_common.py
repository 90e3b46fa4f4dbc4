"""What the agentic route modules share (``app/routes/agentic.py``, ``app/routes/allowances.py``;
spec 001 sections 7 and 8): the agentic problem form, the idempotency key of keyed operations
(creates and mints) with the settling of its record when the operation fails, the checks and models
both resources use.

Problems under ``/agentic/`` take the agentic form (spec 001 section 7): ``type`` is a stable code of
the error catalogue (``domain/agentic/errors.py``), ``title`` the first message of a validation
failure, ``errors`` every failing field. The form is the ``problems`` attribute of each route
(:func:`agentic_form`, :func:`agents_form`), so the framework applies it to the framing problems
raised before a handler runs (401, 403, 400 invalid body, 413, 415) and to the handler's own.
"""

from __future__ import annotations

import datetime as dt
import logging

from pydantic import BaseModel, ConfigDict, Field

from app.api import Call
from app.pagination import CursorPage
from app.schemas import ResponseModel
from domain.agentic import idempotency, leases
from domain.agentic.errors import agentic_error, to_agentic, validation_error
from domain.agentic.payment_methods import VALID_PAIRS
from domain.agentic.units import OutcomeUnknown
from domain.tokens.idempotency import key_errors
from infra.errors import Problem

log = logging.getLogger("tessera.api.agentic")

#: RFC 9745: the agents resource is deprecated (no shutdown date, so no Sunset header). The
#: reference gives no deprecation date; the platform states January 1, 2026.
AGENTS_DEPRECATED_AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
DEPRECATION = {"Deprecation": f"@{int(AGENTS_DEPRECATED_AT.timestamp())}"}
#: A running idempotency record outlives the bounded wait by this much before a replay treats its
#: holder as dead.
CLAIM_MARGIN_SECONDS = 60.0


# ---- the agentic problem form --------------------------------------------------------------------


def agentic_form(problem: Problem) -> Problem:
    """The agentic form of a problem (:func:`domain.agentic.errors.to_agentic`): the ``problems``
    attribute of every payment-method route, applied to framing problems (401, 403, 400 invalid
    body, 413, 415) and handler problems alike. Idempotent: an agentic problem passes through."""
    return to_agentic(problem)


def agents_form(problem: Problem) -> Problem:
    """:func:`agentic_form` plus the ``Deprecation`` header: the ``problems`` attribute of the
    deprecated agents routes."""
    translated = to_agentic(problem)
    translated.headers = {**translated.headers, **DEPRECATION}
    return translated


def check_pair(rail: str, provider: str) -> None:
    """400 ``VALIDATION_ERROR`` naming ``provider`` unless ``(rail, provider)`` is a valid pair (spec 001
    section 4, Rails and providers)."""
    if (rail, provider) not in VALID_PAIRS:
        valid = ", ".join(p for r, p in VALID_PAIRS if r == rail)
        raise validation_error({"provider": [f"{provider} does not serve the {rail} rail; valid: {valid}."]})


# ---- keyed operations ----------------------------------------------------------------------------


async def record_with_key(
    call: Call, unit, /, *args, claim: idempotency.Claim | None, unknown_code: str = "CREATE_OUTCOME_UNKNOWN", **kwargs
):
    """The recording transaction of a keyed operation (``unit(*args, claim=claim, **kwargs)``, which
    commits on its own: :func:`domain.agentic.units.commit_unit`), with the idempotency
    record settled on failure: a problem is recorded for replay, a lost commit makes the key
    terminal (``unknown_code``), another failure frees the key (500 ``INTERNAL_ERROR``), and so does
    an operation in flight (its 409 asks for the exact request again)."""
    try:
        return await call.blocking(unit, *args, claim=claim, **kwargs)
    except Problem as problem:
        answer = to_agentic(problem)
        if claim is not None:
            # an operation in flight asks for the exact request again, key included: the key stays free
            settle = idempotency.release if answer.type in leases.IN_PROGRESS_CODES.values() else idempotency.fail
            await call.db(settle, claim, *(() if settle is idempotency.release else (answer,)))
        raise answer from None
    except OutcomeUnknown:
        log.exception("the commit of a keyed operation failed; its outcome is unknown")
        if claim is not None:
            await _settle_quietly(call, idempotency.unknown, claim)
        raise agentic_error(unknown_code) from None
    except Exception:
        log.exception("a keyed operation failed before its commit")
        if claim is not None:
            await _settle_quietly(call, idempotency.release, claim)
        raise agentic_error("INTERNAL_ERROR") from None


async def claim_key(
    call: Call, scope: str, owner: str, *, wait_seconds: float | None = None
) -> idempotency.Claim | idempotency.Replay | None:
    """The request's ``<prefix>-IDEMPOTENCY-KEY`` claimed in ``scope`` (None without a key; a Replay of
    an earlier success). Raises 400 ``VALIDATION_ERROR`` for a malformed key and the problems of
    :func:`domain.agentic.idempotency.claim`."""
    header = call.settings.header("IDEMPOTENCY-KEY")
    key = call.request.headers.get(header)
    if key is None:
        return None
    errors = key_errors(key, header)
    if errors:
        raise validation_error(errors)
    return await call.db(
        idempotency.claim,
        tenant_id=call.require_caller().tenant_id,
        scope=scope,
        key=key,
        body_hash=idempotency.request_hash(call.payload),
        owner=owner,
        seconds=(wait_seconds or call.settings.agentic_wait_seconds) + CLAIM_MARGIN_SECONDS,
    )


async def _settle_quietly(call: Call, fn, claim: idempotency.Claim) -> None:
    try:
        await call.db(fn, claim)
    except Exception:  # the record stays running and is settled when it expires
        log.warning("could not settle idempotency key record", exc_info=True)


# ---- models and texts both resources use ---------------------------------------------------------


ERROR_FORM = (
    "Problems carry the agentic form: `type` is a stable code of the error catalogue (branch on it, not on "
    "the status), `title` the first failing field as `<path>: <message>` for VALIDATION_ERROR, `errors` every "
    "failing field path, `detail` remediation guidance. "
)


class QueryModel(BaseModel):
    """A query model: unknown parameters are ignored."""

    model_config = ConfigDict(extra="ignore")


class ErrorsQuery(QueryModel):
    """The query of ``GET .../errors``."""

    size: int = Field(20, ge=1, le=100, description="Items per page, 1 to 100.")
    start: str | None = Field(None, description="The opaque cursor from pagination.next.")


class RailErrorOut(ResponseModel):
    """A rail's error."""

    code: str = Field(description="A code of the error catalogue.")


class ProviderErrorOut(ResponseModel):
    """A provider error object."""

    id: str = Field(description="`prv_` + 32 hex characters.")
    code: str
    title: str
    detail: str
    provider: str
    operation: str = Field(
        description="`enrollment` (provisioning a rail), `deletion` (the delete cascade), "
        "`allowance` (an allowance rail's setup), `allowance_update`, `verification`, "
        "`cancellation`, `credentials` (a mint)."
    )
    rail: str
    provider_code: str | None
    provider_correlation_id: str | None
    payment_method_id: str | None
    allowance_id: str | None
    payment_credential_id: str | None
    occurred_at: dt.datetime


ProviderErrorPage = CursorPage[ProviderErrorOut]
