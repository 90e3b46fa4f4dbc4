"""Declaring endpoints once: routing, authentication, permission, validation and OpenAPI together.

A route module declares each endpoint with :meth:`Api.route`::

    @api.route("POST", "/webhooks", permission="webhooks:create", body=WebhookIn,
               status=201, response=WebhookOut, tag="Webhooks", summary="Create a webhook")
    async def create_webhook(call: Call) -> dict: ...

The wrapper authenticates the ``<prefix>-API-KEY`` header (401), checks the permission (403), parses
and validates the query and the JSON body with pydantic (400 with per-field ``errors``; 415 for a
body that is not JSON), and serialises what the handler returns. The same declarations produce
``GET /openapi.json`` (``app/openapi.py``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from app.context import DB_EXECUTOR, GROUP_COMMIT, JOB_WAITS, SETTINGS, TRACE_ID
from domain.tenancy.auth import authenticate, caller_cache
from domain.tenancy.caller import Caller
from infra.errors import Problem, not_found, validation_problem
from infra.wait import Outcome, read_outcomes
from storage.db import session_scope


@dataclass(frozen=True)
class AnyOf:
    """A permission requirement met by holding any one of ``names``."""

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)

    def describe(self) -> str:
        return " or ".join(self.names)


@dataclass(frozen=True)
class AllOf:
    """A permission requirement met by holding every one of ``names``."""

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)

    def describe(self) -> str:
        return " and ".join(self.names)


Permission = str | AnyOf | AllOf | None
CALLER: web.RequestKey[Caller] = web.RequestKey("caller", Caller)
RAW_JSON = object()  # body=RAW_JSON: any JSON value, validated by the handler


@dataclass
class Call:
    """One request as a handler sees it: the caller, the validated body and query, helpers."""

    request: web.Request
    caller: Caller | None
    body: Any
    query: Any
    trace_id: str
    #: ``time.monotonic()`` when the handler was called.
    started: float = field(default_factory=time.monotonic)

    @property
    def params(self):
        """The path parameters."""
        return self.request.match_info

    def uuid_param(self, name: str = "id", *, what: str = "entity") -> uuid.UUID:
        """The path parameter ``name`` as a UUID; a malformed one answers 404 like a missing ``what``."""
        try:
            return uuid.UUID(self.request.match_info[name])
        except ValueError:
            raise not_found(what) from None

    @property
    def settings(self):
        """The process settings."""
        return self.request.app[SETTINGS]

    async def db(self, fn: Callable[..., Any], /, *args, **kwargs) -> Any:
        """Run ``fn(session, *args, **kwargs)`` in one transaction on the database thread pool."""
        return await run_db(self.request.app, fn, *args, **kwargs)

    async def db_grouped(self, fn: Callable[..., Any], /, *args, **kwargs) -> Any:
        """:meth:`db` for the hot path: the transaction may be shared with the units of work of other
        requests arriving within ``TESSERA_GROUP_COMMIT_MS`` (``storage.db.GroupCommit``)."""
        return await self.request.app[GROUP_COMMIT].run(fn, *args, **kwargs)

    async def wait_for_jobs(self, job_ids: Iterable[uuid.UUID], *, timeout: float) -> dict[uuid.UUID, Outcome]:
        """Wait up to ``timeout`` seconds until every job of ``job_ids`` (recorded by this request)
        settles, woken by the outcome messages of the process's subscription (``infra/wait.py``);
        the last outcome known of each."""

        async def read(ids: list[uuid.UUID]) -> dict[uuid.UUID, Outcome]:
            return await self.db(read_outcomes, ids)

        return await self.request.app[JOB_WAITS].wait(job_ids, read, timeout=timeout, since=self.started)


async def run_db(app: web.Application, fn: Callable[..., Any], /, *args, **kwargs) -> Any:
    """Run a blocking unit of work ``fn(session, ...)`` off the event loop, in one transaction."""

    def unit() -> Any:
        with session_scope() as session:
            return fn(session, *args, **kwargs)

    return await asyncio.get_running_loop().run_in_executor(app[DB_EXECUTOR], unit)


@dataclass
class Route:
    """One declared endpoint (see :meth:`Api.route`)."""

    method: str
    path: str
    handler: Callable[[Call], Awaitable[Any]]
    permission: Permission
    body: type[BaseModel] | object | None
    query: type[BaseModel] | None
    response: Any
    status: int
    summary: str
    tag: str
    description: str = ""
    auth: bool = True
    errors: tuple[int, ...] = ()
    deprecated: bool = False
    extra_headers: dict[str, str] = field(default_factory=dict)
    request_content_type: str = "application/json"
    response_content_type: str = "application/json"
    openapi_extra: dict = field(default_factory=dict)
    body_optional: bool = False


class Api:
    """The registry of endpoints of one aiohttp application."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    def route(
        self,
        method: str,
        path: str,
        *,
        summary: str,
        tag: str,
        permission: Permission = None,
        body: type[BaseModel] | object | None = None,
        query: type[BaseModel] | None = None,
        response: Any = None,
        status: int = 200,
        description: str = "",
        auth: bool = True,
        errors: tuple[int, ...] = (),
        deprecated: bool = False,
        extra_headers: dict[str, str] | None = None,
        request_content_type: str = "application/json",
        response_content_type: str = "application/json",
        openapi_extra: dict | None = None,
        body_optional: bool = False,
    ) -> Callable:
        """Declare an endpoint; returns a decorator taking ``async def handler(call: Call)``.

        The handler returns a JSON-able value (answered with ``status``), ``None`` (answered 204
        when ``status`` is 204), a ``(status, value)`` pair, or an aiohttp response.
        ``body_optional``: a request without a body is validated as ``{}`` (every field optional).
        """

        def decorate(handler: Callable[[Call], Awaitable[Any]]) -> Callable:
            self.routes.append(
                Route(
                    method=method,
                    path=path,
                    handler=handler,
                    permission=permission,
                    body=body,
                    query=query,
                    response=response,
                    status=status,
                    summary=summary,
                    tag=tag,
                    description=description,
                    auth=auth,
                    errors=errors,
                    deprecated=deprecated,
                    extra_headers=extra_headers or {},
                    request_content_type=request_content_type,
                    response_content_type=response_content_type,
                    openapi_extra=openapi_extra or {},
                    body_optional=body_optional,
                )
            )
            return handler

        return decorate

    def install(self, app: web.Application) -> None:
        """Add every declared route to ``app``'s router."""
        for route in self.routes:
            app.router.add_route(route.method, route.path, functools.partial(_dispatch, route))


# ---- the per-request pipeline --------------------------------------------------------------------


async def _dispatch(route: Route, request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    trace_id = request[TRACE_ID]
    caller = await _authenticate(request, settings, trace_id) if route.auth else None
    if caller is not None and route.permission is not None:
        _check_permission(caller, route.permission)
    query = _parse_query(route.query, request) if route.query else None
    body = await _parse_body(route, request) if route.body is not None else None
    result = await route.handler(Call(request, caller, body, query, trace_id))
    response = _to_response(route, result)
    for name, value in route.extra_headers.items():
        response.headers[name] = value
    return response


async def _authenticate(request: web.Request, settings, trace_id: str) -> Caller:
    key = request.headers.get(settings.header("API-KEY"))
    if not key:
        if "X-API-KEY" in request.headers and settings.header_prefix != "X":
            raise Problem(
                401,
                f"The X-API-KEY header was shut down on March 9, 2022; send {settings.header('API-KEY')}.",
            )
        raise Problem(401, f"The {settings.header('API-KEY')} header is missing.")
    caller = await caller_cache.get_or_load(
        key, trace_id=trace_id, ttl=settings.auth_cache_seconds,
        load=lambda: run_db(request.app, authenticate, key, trace_id=trace_id),
    )
    if caller is None:
        raise Problem(401, f"The {settings.header('API-KEY')} header does not hold a valid API key.")
    request[CALLER] = caller
    return caller


def _check_permission(caller: Caller, permission: Permission) -> None:
    if isinstance(permission, str):
        caller.require(permission)
    elif isinstance(permission, AnyOf):
        caller.require_any(*permission.names)
    elif isinstance(permission, AllOf):
        caller.require(*permission.names)


def _parse_query(model: type[BaseModel], request: web.Request) -> BaseModel:
    raw: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        values = request.query.getall(key, [])
        if not values:
            continue
        origin = getattr(info.annotation, "__origin__", None)
        raw[key] = values if origin is list or "list[" in str(info.annotation) else values[-1]
    for key in request.query:
        if key not in raw and not _declared(model, key):
            raw.setdefault("__extra__", {})[key] = request.query[key]
    extras = raw.pop("__extra__", None)
    try:
        parsed = model.model_validate(raw)
    except ValidationError as exc:
        raise validation_problem(pydantic_errors(exc)) from None
    if extras:
        object.__setattr__(parsed, "__query_extra__", extras)
    return parsed


def _declared(model: type[BaseModel], key: str) -> bool:
    return any((info.alias or name) == key for name, info in model.model_fields.items())


def query_extras(query: BaseModel) -> dict[str, str]:
    """Query parameters the model did not declare (for ``metadata.<key>`` style filters)."""
    return getattr(query, "__query_extra__", {})


async def read_json(request: web.Request, *, content_types: tuple[str, ...] = ("application/json",)) -> Any:
    """Read and parse a JSON body: 415 for another content type, 400 for malformed or empty JSON."""
    if request.content_type not in content_types:
        raise Problem(415, f"Send the body as {' or '.join(content_types)}.")
    raw = await request.read()
    if not raw.strip():
        raise Problem(400, "The request body is empty.", title="Invalid body")
    try:
        payload = loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Problem(400, f"The request body is not valid JSON: {exc}", title="Invalid body") from None
    if b"\\u0000" in raw:  # PostgreSQL text cannot hold NUL, and no field of this API needs one
        errors = {path or "body": ["Must not contain NUL characters."] for path in _nul_paths(payload, "")}
        if errors:
            raise validation_problem(errors)
    return payload


def loads(raw: bytes) -> Any:
    """Parse a JSON body: orjson when it reads the body exactly as the standard library would (no
    integer of 19 digits or more, which orjson turns into a float; nothing it refuses, such as NaN or
    a lone surrogate), else :func:`json.loads`, whose errors (JSONDecodeError, UnicodeDecodeError)
    are raised."""
    if not _LONG_NUMBER.search(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


_LONG_NUMBER = re.compile(rb"\d{19}")


def _nul_paths(value: Any, path: str) -> list[str]:
    """The paths of the strings (values or keys) in a JSON value that contain a NUL character."""
    if isinstance(value, str):
        return [path] if "\x00" in value else []
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _nul_paths(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            found += [child] if "\x00" in key else _nul_paths(item, child)
        return found
    return []


async def _parse_body(route: Route, request: web.Request) -> Any:
    if route.body_optional and not request.body_exists:
        payload: Any = {}
    else:
        payload = await read_json(request, content_types=(route.request_content_type,))
    if route.body is RAW_JSON:
        return payload
    try:
        return route.body.model_validate(payload)  # type: ignore[union-attr]
    except ValidationError as exc:
        raise validation_problem(pydantic_errors(exc)) from None


def pydantic_errors(exc: ValidationError, prefix: str = "") -> dict[str, list[str]]:
    """Turn a pydantic ValidationError into the problem's ``errors`` map (field path -> messages)."""
    errors: dict[str, list[str]] = {}
    for error in exc.errors(include_url=False):
        path = prefix
        for part in error["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            else:
                path = f"{path}.{part}" if path else str(part)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "This property is not allowed."
        errors.setdefault(path or "body", []).append(message)
    return errors


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response (datetimes, UUIDs and models serialised)."""
    return web.Response(status=status, body=_dump_bytes(value), content_type="application/json", headers=headers)


def dumps(value: Any) -> str:
    """Serialise a handler's result to JSON."""
    return _dump_bytes(value).decode()


def _dump_bytes(value: Any) -> bytes:
    """orjson, passing datetimes and dataclasses to :func:`_default` as the standard library does;
    the standard library for what orjson refuses (integers beyond 64 bits, NaN...)."""
    try:
        return orjson.dumps(value, default=_default, option=_ORJSON_OPTIONS)
    except TypeError:
        return json.dumps(value, default=_default, separators=(",", ":")).encode()


_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=False)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _to_response(route: Route, result: Any) -> web.StreamResponse:
    if isinstance(result, web.StreamResponse):
        return result
    status = route.status
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], int):
        status, result = result
    if result is None and status == 204:
        return web.Response(status=204)
    return json_response(result, status)
