"""Errors that domain code raises and the API answers as RFC 7807 problems (core spec section 7).

Domain functions run in the api and in workers alike, so they raise :class:`Problem` with the HTTP
status the API answers; the error middleware renders it (``app/problems.py``) and a task records it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

VALIDATION_TITLE = "One or more validation errors occurred."


class Problem(Exception):
    """An error answered as ``application/problem+json``.

    ``errors`` maps a property path (``data.number``, ``events[0]``) to a list of messages;
    ``extra`` adds members to the problem object; ``headers`` are sent with the answer.
    """

    def __init__(
        self,
        status: int,
        detail: str | None = None,
        *,
        title: str | None = None,
        type: str = "about:blank",
        errors: dict[str, list[str]] | None = None,
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ):
        super().__init__(detail or title or HTTPStatus(status).phrase)
        self.status = status
        self.title = title or HTTPStatus(status).phrase
        self.detail = detail
        self.type = type
        self.errors = errors
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self, instance: str | None = None) -> dict:
        """The problem object: type, title, status, detail, instance, errors (when set)."""
        payload: dict = {"type": self.type, "title": self.title, "status": self.status}
        if self.detail:
            payload["detail"] = self.detail
        if instance:
            payload["instance"] = instance
        if self.errors:
            payload["errors"] = self.errors
        payload.update(self.extra)
        return payload


def validation_errors(
    exc: ValidationError,
    *,
    prefix: str = "",
    union_tags: Collection[str] = (),
    suffixes: Mapping[str, str] | None = None,
) -> dict[str, list[str]]:
    """A pydantic ValidationError as the problem's ``errors`` map (property path -> messages, in the
    platform's voice: ``is required``, ``must be a string`` ...): the one converter of validation
    errors, for :func:`validation_problem`.

    ``prefix`` starts every path (``request``); ``union_tags`` are the tags of discriminated unions,
    which pydantic puts in a location after the union's property or item and which are no property
    themselves (``request_transforms[0].expression``, not ``request_transforms[0].mask.expression``).
    ``suffixes`` maps an error type to what its path ends with (a model validator's error that
    belongs to one property of the object: ``{"runtime_image": ".image"}``)."""
    errors: dict[str, list[str]] = {}
    for error in exc.errors(include_url=False):
        path = prefix
        skipped = False
        for index, part in enumerate(error["loc"]):
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in union_tags and index > 0 and not skipped:
                skipped = True  # the union's tag, not a property
                continue
            else:
                path = f"{path}.{part}" if path else str(part)
            skipped = False
        path += (suffixes or {}).get(error["type"], "")
        errors.setdefault(path or "body", []).append(_message(error))
    return errors


#: pydantic error type -> the message in the domain's voice (``is required``, ``must be a string`` ...),
#: formatted with the error's context; types not listed keep pydantic's message.
_MESSAGES = {
    "missing": "is required",
    "extra_forbidden": "This property is not allowed.",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "list_type": "must be an array",
    "uuid_type": "must be a uuid",
    "uuid_parsing": "must be a uuid",
    "datetime_type": "must be an ISO 8601 date-time",
    "datetime_parsing": "must be an ISO 8601 date-time",
    "datetime_from_date_parsing": "must be an ISO 8601 date-time",
    "string_too_short": "must be at least {min_length} characters",
    "string_too_long": "must be at most {max_length} characters",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
    "value_error": "{error}",
}


def _message(error: Any) -> str:
    """One validation message in the platform's voice (the same phrasing as the domain's checks)."""
    template = _MESSAGES.get(error["type"])
    if error["type"] in ("string_too_short", "too_short") and (error.get("ctx") or {}).get("min_length") == 1:
        return "must not be empty"
    if template is None:
        return error["msg"]
    try:
        return template.format(**(error.get("ctx") or {}))
    except (KeyError, IndexError):
        return error["msg"]


def validation_problem(errors: dict[str, list[str]], detail: str | None = None) -> Problem:
    """A 400 problem carrying per-field ``errors``."""
    return Problem(400, detail or "The request is invalid; see errors.", title=VALIDATION_TITLE, errors=errors)


def not_found(what: str = "entity") -> Problem:
    """The 404 answered for a missing resource and for another tenant's resource alike."""
    return Problem(404, f"The {what} was not found.")


def forbidden(permission: str) -> Problem:
    """The 403 answered when the caller's key lacks ``permission``."""
    return Problem(403, f"The API key lacks the permission {permission}.")
