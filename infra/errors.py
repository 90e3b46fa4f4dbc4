"""Errors that domain code raises and the API answers as RFC 7807 problems (core spec section 7).

Domain functions run in the api and in workers alike, so they raise :class:`Problem` with the HTTP
status the API answers; the error middleware renders it (``app/problems.py``) and a task records it.
"""

from __future__ import annotations

from http import HTTPStatus

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


def validation_problem(errors: dict[str, list[str]], detail: str | None = None) -> Problem:
    """A 400 problem carrying per-field ``errors``."""
    return Problem(400, detail or "The request is invalid; see errors.", title=VALIDATION_TITLE, errors=errors)


def not_found(what: str = "entity") -> Problem:
    """The 404 answered for a missing resource and for another tenant's resource alike."""
    return Problem(404, f"The {what} was not found.")


def forbidden(permission: str) -> Problem:
    """The 403 answered when the caller's key lacks ``permission``."""
    return Problem(403, f"The API key lacks the permission {permission}.")
