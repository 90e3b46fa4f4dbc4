"""The agentic error catalogue and problem format (spec 001 section 7).

Agentic problems are RFC 7807 problems whose ``type`` is a stable code (integrations branch on it),
``title`` the first message for validation failures, ``detail`` remediation guidance and
``errors`` a map from field path to messages listing every failing field. Provider failures may
carry ``debug.provider_correlation``.

:func:`agentic_error` builds one from a catalogue code; :func:`to_agentic` turns a core problem
(``type`` ``about:blank``: framing errors raised before validation, core validation problems) into
this form, so the shared error middleware can hand every problem under ``/agentic/`` to it.
"""

from __future__ import annotations

import uuid
from http import HTTPStatus

from infra.errors import Problem

#: code -> (HTTP status, title, remediation detail)
CATALOGUE: dict[str, tuple[int, str, str]] = {
    # framing (raised before the body is validated)
    "UNAUTHORIZED": (401, "Unauthorized", "Send a valid API key."),
    "FORBIDDEN": (403, "Forbidden", "The API key lacks the permission this call needs."),
    "NOT_FOUND": (404, "Not found", "No resource exists at this path."),
    "INVALID_BODY": (400, "Invalid body", "Send a JSON object as the body."),
    "BODY_TOO_LARGE": (413, "Body too large", "Send a smaller body."),
    "UNSUPPORTED_MEDIA_TYPE": (415, "Unsupported media type", "Send the body as application/json."),
    "METHOD_NOT_ALLOWED": (405, "Method not allowed", "See the Allow header."),
    "RATE_LIMITED": (429, "Too many requests", "Slow down; see Retry-After."),
    # invalid requests
    "VALIDATION_ERROR": (400, "Validation error", "Correct the fields listed in errors."),
    "INVALID_TOKEN": (400, "Invalid token", "Send the id of a card token of this tenant."),
    "UNSUPPORTED_PROVIDER": (
        400,
        "Unsupported provider",
        "No supported provider takes this card's network, or the rail is not configured.",
    ),
    "RAIL_NOT_FOUND": (400, "Rail not found", "Read rail and provider off the payment method's rails."),
    "RAIL_NOT_ACTIVE": (400, "Rail not active", "Complete verification."),
    "NO_ACTIVE_RAILS": (400, "No active rails", "The payment method has no enabled rail."),
    "PAYMENT_METHOD_DELETED": (400, "Payment method deleted", "Register a new payment method."),
    "ALLOWANCE_CANCELLED": (400, "Allowance cancelled", "Create a new allowance."),
    "ALLOWANCE_EXPIRED": (400, "Allowance expired", "Create a new allowance."),
    "ALLOWANCE_AMOUNT_EXCEEDED": (400, "Allowance amount exceeded", "Mint at most amount_available."),
    "VERIFICATION_STATE_INVALID": (400, "Verification state invalid", "Restart verification from start."),
    "VERIFICATION_NOT_REQUIRED": (400, "Verification not required", "This rail has no verification."),
    "INVALID_OTP": (400, "Invalid code", "The code is invalid or expired."),
    "PAYMENT_METHOD_NOT_FOUND": (404, "Payment method not found", "No payment method with this id in the tenant."),
    "AGENT_NOT_FOUND": (404, "Agent not found", "No agent with this id in the tenant."),
    "ALLOWANCE_NOT_FOUND": (404, "Allowance not found", "No allowance with this id in the tenant."),
    "PAYMENT_CREDENTIAL_NOT_FOUND": (404, "Payment credential not found", "No payment credential with this id."),
    # conclusive failures
    "CARD_REJECTED": (422, "Card rejected", "The provider rejected the card; use another card."),
    "PROVIDER_ENROLLMENT_FAILED": (422, "Provider enrollment failed", "Retry the rail."),
    "RAIL_ENROLLMENT_INVALID": (
        422,
        "Rail enrollment invalid",
        "Retry the rail; if it fails again, register a new payment method.",
    ),
    "RAIL_ALREADY_ENROLLED": (409, "Rail already enrolled", "Use the existing payment method or retry the rail."),
    "PROVIDER_ALLOWANCE_FAILED": (422, "Provider allowance failed", "Retry the allowance rail."),
    "PROVIDER_ALLOWANCE_UPDATE_FAILED": (422, "Provider allowance update failed", "Correct the values."),
    "PROVIDER_CREDENTIALS_FAILED": (422, "Provider credentials failed", "Use a new idempotency key to try again."),
    "PROVIDER_VERIFICATION_FAILED": (422, "Provider verification failed", "Restart verification."),
    "VERIFICATION_NOT_SUPPORTED": (422, "Verification not supported", "Use a rail without verification, like spt."),
    "PROVIDER_NOT_CONFIGURED": (
        422,
        "Provider not configured",
        "Onboarding with this provider is incomplete; contact support.",
    ),
    "MPP_KEY_UNAVAILABLE": (502, "Merchant key unavailable", "Make a new attempt with a new idempotency key."),
    "UNSUPPORTED_RAIL": (500, "Unsupported rail", "Contact support with the trace id."),
    "INTERNAL_ERROR": (
        500,
        "Internal error",
        "Repeat once with the same idempotency key, then contact support with the trace id.",
    ),
    "PROVIDER_ALLOWANCE_CANCEL_FAILED": (
        500,
        "Provider cancellation failed",
        "Repeat the same DELETE to resume the cascade.",
    ),
    "SERVICE_UNAVAILABLE": (503, "Service unavailable", "Try again shortly."),
    # operations in progress and other conflicts
    "IDEMPOTENCY_IN_PROGRESS": (
        409,
        "Request in progress",
        "Wait briefly and repeat the exact request with the same idempotency key.",
    ),
    "IDEMPOTENCY_CONFLICT": (
        409,
        "Idempotency key reused",
        "The key was used with a different body; use a new key for a new request.",
    ),
    "CREATE_OUTCOME_UNKNOWN": (
        409,
        "Create outcome unknown",
        "A payment method may have been created. Filter by consumer_id (or paginate and match consumer and "
        "source); create again only with a new key if none exists. This key is terminal.",
    ),
    "PAYMENT_METHOD_OPERATION_IN_PROGRESS": (
        409,
        "Operation in progress",
        "Wait briefly and repeat the exact request.",
    ),
    "PAYMENT_METHOD_DELETE_IN_PROGRESS": (409, "Delete in progress", "Wait briefly and repeat the exact request."),
    "ALLOWANCE_VERIFICATION_IN_PROGRESS": (
        409,
        "Verification in progress",
        "Wait briefly and repeat the exact request.",
    ),
    "ALLOWANCE_UPDATE_IN_PROGRESS": (409, "Update in progress", "Wait briefly and repeat the exact request."),
    "ALLOWANCE_DELETE_IN_PROGRESS": (409, "Cancellation in progress", "Wait briefly and repeat the exact request."),
    "ALLOWANCE_CREDENTIAL_IN_PROGRESS": (
        409,
        "Credential mint in progress",
        "Only one mint can reserve an allowance at a time; wait briefly and repeat the exact request.",
    ),
    "CREDENTIAL_PAYLOAD_UNAVAILABLE": (
        409,
        "Credential payload unavailable",
        "The credential was minted and returned once; it cannot be returned again. Read it with GET (without "
        "its value) or mint a new one with a new key.",
    ),
    "CREDENTIAL_OUTCOME_UNKNOWN": (
        409,
        "Credential outcome unknown",
        "The provider may have issued a credential whose value cannot be returned; the amount moved to "
        "amount_spent. This key is terminal; do not retry this operation.",
    ),
    "PAYMENT_METHOD_DELETE_INCOMPLETE": (
        409,
        "Delete incomplete",
        "A delete stopped during its cascade; repeat DELETE to finish it.",
    ),
}

#: core problem status -> framing code (core problems carry ``type`` ``about:blank``)
_STATUS_CODES = {
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "BODY_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    429: "RATE_LIMITED",
    500: "INTERNAL_ERROR",
    503: "SERVICE_UNAVAILABLE",
}
_INVALID_BODY_TITLE = "Invalid body"


def agentic_error(
    code: str,
    detail: str | None = None,
    *,
    errors: dict[str, list[str]] | None = None,
    title: str | None = None,
    extra: dict | None = None,
    headers: dict[str, str] | None = None,
) -> Problem:
    """The problem for catalogue ``code``: its status and title, ``detail`` (default: the
    catalogue's remediation). Raises KeyError for a code not in :data:`CATALOGUE`."""
    status, default_title, remediation = CATALOGUE[code]
    return Problem(
        status,
        detail or remediation,
        title=title or default_title,
        type=code,
        errors=errors,
        extra=extra,
        headers=headers,
    )


def first_message(errors: dict[str, list[str]]) -> str:
    """``"<path>: <message>"`` of the first failing field (the validation problem's title)."""
    for path, messages in errors.items():
        if messages:
            return f"{path}: {messages[0]}"
    return CATALOGUE["VALIDATION_ERROR"][1]


def validation_error(errors: dict[str, list[str]], detail: str | None = None) -> Problem:
    """400 ``VALIDATION_ERROR`` listing every failing field; titled with the first message."""
    return agentic_error(
        "VALIDATION_ERROR",
        detail or "The request is invalid; errors lists every failing field.",
        errors=errors,
        title=first_message(errors),
    )


def is_agentic(problem: Problem) -> bool:
    """True when ``problem`` already carries a catalogue code as its ``type``."""
    return problem.type in CATALOGUE


def to_agentic(problem: Problem) -> Problem:
    """The agentic form of ``problem`` (unchanged when it already is one).

    Core problems map by status: 400 with ``errors`` -> ``VALIDATION_ERROR`` (titled with the first
    message); 400 for an unparseable or empty body -> ``INVALID_BODY``; other 400 ->
    ``VALIDATION_ERROR``; 401 ``UNAUTHORIZED``, 403 ``FORBIDDEN``, 404 ``NOT_FOUND``, 405
    ``METHOD_NOT_ALLOWED``, 413 ``BODY_TOO_LARGE``, 415 ``UNSUPPORTED_MEDIA_TYPE``, 429
    ``RATE_LIMITED``, 500 ``INTERNAL_ERROR``, 503 ``SERVICE_UNAVAILABLE``. ``detail``, ``errors``,
    ``headers`` and extra members are kept.
    """
    if is_agentic(problem):
        return problem
    code: str | None
    title: str | None
    if problem.status == 400:
        if problem.errors:
            code, title = "VALIDATION_ERROR", first_message(problem.errors)
        elif problem.title == _INVALID_BODY_TITLE:
            code, title = "INVALID_BODY", None
        else:
            code, title = "VALIDATION_ERROR", problem.detail
    else:
        code, title = _STATUS_CODES.get(problem.status), None
    if code is None:
        code = HTTPStatus(problem.status).name if problem.status in HTTPStatus._value2member_map_ else "ERROR"
        return Problem(
            problem.status,
            problem.detail,
            title=problem.title,
            type=code,
            errors=problem.errors,
            headers=problem.headers,
            extra=problem.extra,
        )
    _status, default_title, remediation = CATALOGUE[code]
    return Problem(
        problem.status,
        problem.detail or remediation,
        title=title or default_title,
        type=code,
        errors=problem.errors,
        headers=problem.headers,
        extra=problem.extra,
    )


#: The attribute naming, on a provider call's exception, the rail whose call raised it.
FAILED_RAIL = "rail_id"


def name_failed_rail(error: Exception, rail_id: uuid.UUID) -> None:
    """Name on ``error`` (a provider call's PermanentError or TransientError) the rail whose call
    raised it, so that the job's failure step records the provider error on that rail."""
    setattr(error, FAILED_RAIL, rail_id)


def failed_rail(error: Exception) -> uuid.UUID | None:
    """The rail :func:`name_failed_rail` named on ``error``, or None."""
    return getattr(error, FAILED_RAIL, None)
