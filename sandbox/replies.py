"""Answers of the simulated providers: replies, refusals, the JSON error middleware, body parsing.

Every error the sandbox gives is JSON ``{"code": str, "message": str, ...details}``; validation
failures add ``errors``, a map from field path to a list of messages. Messages describe the rule
that failed and never echo a card number.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

REPLAYED_HEADER = "Idempotent-Replayed"
"""Response header set to ``true`` when the answer comes from the idempotency store."""


@dataclass(frozen=True)
class Reply:
    """A provider answer: an HTTP ``status`` and a JSON object ``body`` (None: empty body)."""

    status: int
    body: dict[str, Any] | None = None

    def response(self, *, replayed: bool = False) -> web.Response:
        """Render as an aiohttp response; ``replayed`` adds ``Idempotent-Replayed: true``."""
        headers = {REPLAYED_HEADER: "true"} if replayed else None
        if self.body is None:
            return web.Response(status=self.status, headers=headers)
        return web.json_response(self.body, status=self.status, headers=headers)


class SandboxError(Exception):
    """A refusal raised anywhere in a handler or a provider operation.

    It is answered as ``status`` with the body ``{"code": code, "message": message, **details}``
    (the error middleware renders it; the idempotency store keeps it as the operation's reply).
    """

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reply = Reply(status, {"code": code, "message": message, **details})


def invalid_request(errors: dict[str, str]) -> SandboxError:
    """A 400 ``invalid_request`` refusal; ``errors`` maps a field path to one message."""
    return SandboxError(
        400,
        "invalid_request",
        "the request is invalid",
        errors={path: [message] for path, message in errors.items()},
    )


def require_valid(errors: dict[str, str]) -> None:
    """Raise :func:`invalid_request` when ``errors`` (field path -> message) is not empty."""
    if errors:
        raise invalid_request(errors)


_TYPE_NAMES: dict[type, str] = {dict: "an object", str: "a string", list: "an array"}


def optional_type_errors(fields: dict[str, tuple[object, type]]) -> dict[str, str]:
    """Field path -> message for each ``path: (value, type)`` whose value is neither None nor a ``type``.

    ``type`` is one of ``dict``, ``str`` or ``list``.
    """
    return {
        path: f"must be {_TYPE_NAMES[kind]}"
        for path, (value, kind) in fields.items()
        if value is not None and not isinstance(value, kind)
    }


def not_found(what: str) -> SandboxError:
    """A 404 ``not_found`` refusal naming ``what`` (for example ``network token``)."""
    return SandboxError(404, "not_found", f"{what} not found")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer :class:`SandboxError` and aiohttp's HTTP errors (404, 405, 413 ...) as JSON."""
    try:
        return await handler(request)
    except SandboxError as error:
        return error.reply.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = error.reason.lower().replace(" ", "_")
        return Reply(error.status, {"code": code, "message": error.reason}).response()


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body parsed as a JSON object.

    Raises :class:`SandboxError` 400 ``invalid_request`` (on the path ``body``) when the body is
    empty, not UTF-8 JSON, or a JSON value other than an object.
    """
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise invalid_request({"body": "must be a JSON object"})
    return body
