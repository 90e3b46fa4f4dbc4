"""Declaring endpoints once: routing, authentication, permission, validation and OpenAPI together.

A route module declares each endpoint with :meth:`Api.route`::

    @api.route("POST", "/webhooks", permission="webhooks:create", body=WebhookIn,
               status=201, response=WebhookOut, tag="Webhooks", summary="Create a webhook")
    async def create_webhook(call: Call) -> dict: ...

The wrapper authenticates the ``<prefix>-API-KEY`` header (401), checks the permission (403), refuses
NUL in path segments and query values, parses the JSON body with pydantic-core (any JSON media type;
400 for what cannot be stored, 415 for a body that is not JSON), validates the query and the body
with their models (400 with per-field ``errors``), and serialises what the handler returns through
its response model. A route's ``problems`` attribute frames its problems (the agentic form). The
same declarations produce ``GET /openapi.json`` (``app/openapi.py``), rendered at ``GET /docs``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import from_json

from app.context import DB_EXECUTOR, GROUP_COMMIT, JOB_WAITS, SETTINGS, TRACE_ID
from domain.tenancy.auth import authenticate, caller_cache
from domain.tenancy.caller import Caller
from infra.errors import Problem, not_found, validation_errors, validation_problem
from infra.lookup import parse_uuid
from infra.wait import Outcome, read_outcomes, reply_to_waits
from storage.crypto import KeyUnavailable
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
log = logging.getLogger("tessera.api")


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
    #: The request body as parsed JSON, before model validation (for an idempotency hash, or a domain
    #: that takes the raw object after the model validated it).
    payload: Any = None
    #: Headers the handler adds to its (successful) answer.
    headers: dict[str, str] = field(default_factory=dict)

    def require_caller(self) -> Caller:
        """The caller of a route declared with authentication (the default); a route declared with
        ``auth=False`` has none, so asking for it there is a programming error."""
        if self.caller is None:
            raise RuntimeError(f"{self.request.method} {self.request.path} has no authenticated caller")
        return self.caller

    @property
    def params(self):
        """The path parameters."""
        return self.request.match_info

    def uuid_param(self, name: str = "id", *, what: str = "entity") -> uuid.UUID:
        """The path parameter ``name`` as a UUID; a malformed one answers 404 like a missing ``what``."""
        parsed = parse_uuid(self.request.match_info[name])
        if parsed is None:
            raise not_found(what)
        return parsed

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

    async def blocking(self, fn: Callable[..., Any], /, *args, **kwargs) -> Any:
        """Run ``fn(*args, **kwargs)``, which manages its own transactions, on the database thread pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self.request.app[DB_EXECUTOR], functools.partial(fn, *args, **kwargs)
        )


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
    #: A model class or any type form pydantic validates (a union of models ...); None: no body.
    body: Any
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
    request_content_type: str | tuple[str, ...] = "application/json"
    response_content_type: str = "application/json"
    openapi_extra: dict = field(default_factory=dict)
    body_optional: bool = False
    problems: Callable[[Problem], Problem] | None = None
    examples: dict[str, Any] = field(default_factory=dict)
    documented: bool = True
    #: What validates the body (anything with ``validate_python``); None: ``TypeAdapter(body)``.
    body_adapter: Any = None
    #: What checks and serialises the answer (``validate_python`` and ``dump_json``, as a
    #: ``TypeAdapter``); None: ``TypeAdapter(response)``.
    answer_adapter: Any = None

    def __post_init__(self) -> None:
        self.path_params: tuple[str, ...] = tuple(_PATH_PARAM.findall(self.path))
        kinds = self.request_content_type
        self.request_content_types: tuple[str, ...] = (kinds,) if isinstance(kinds, str) else kinds
        # adapters are built once, here, never per request
        if self.body_adapter is None and self.body is not None:
            self.body_adapter = TypeAdapter(self.body)
        json_answer = self.response is not None and self.status != 204 and self.response_content_type.endswith("json")
        self.response_adapter = (self.answer_adapter or TypeAdapter(self.response)) if json_answer else None


_PATH_PARAM = re.compile(r"{(\w+)}")


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
        body: Any = None,
        query: type[BaseModel] | None = None,
        response: Any = None,
        status: int = 200,
        description: str = "",
        auth: bool = True,
        errors: tuple[int, ...] = (),
        deprecated: bool = False,
        extra_headers: dict[str, str] | None = None,
        request_content_type: str | tuple[str, ...] = "application/json",
        response_content_type: str = "application/json",
        openapi_extra: dict | None = None,
        body_optional: bool = False,
        problems: Callable[[Problem], Problem] | None = None,
        examples: dict[str, Any] | None = None,
        documented: bool = True,
        body_adapter: Any = None,
        answer_adapter: Any = None,
    ) -> Callable:
        """Declare an endpoint; returns a decorator taking ``async def handler(call: Call)``.

        ``body`` and ``query`` are pydantic models (``body`` may be any type pydantic validates, such
        as an ``Annotated`` JSON value with its schema); the framework validates both before the
        handler runs (400 with per-field ``errors``). ``response`` is the type every answer is
        validated and serialised through (pydantic-core, fields the handler left out stay out), so
        the served shape is the documented one; a handler result that does not fit is a server bug
        (500, logged). The handler returns a value (answered with ``status``), ``None`` (answered
        204 when ``status`` is 204), a ``(status, value)`` pair, or an aiohttp response.
        ``body_optional``: a request without a body is validated as ``{}`` (every field optional).
        ``problems``: how this route's problems are framed (for example the agentic form, spec 001
        section 7); applied to every problem raised for the route, framing ones included.
        ``examples``: ``{"request": ..., "response": ...}`` for the OpenAPI description.
        ``documented``: False for a catch-all that only frames problems (left out of the description).
        ``body_adapter``: what validates the body instead of ``TypeAdapter(body)`` (an object with
        ``validate_python``), ``body`` still describing it in the OpenAPI description.
        ``answer_adapter``: what checks and serialises the answer instead of ``TypeAdapter(response)``
        (such as :class:`JsonAnswer`), ``response`` still describing it.
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
                    problems=problems,
                    examples=examples or {},
                    documented=documented,
                    body_adapter=body_adapter,
                    answer_adapter=answer_adapter,
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
    if route.problems is None:
        return await _pipeline(route, request)
    try:
        return await _pipeline(route, request)
    except Problem as problem:
        raise route.problems(problem) from None
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        raise route.problems(http_problem(exc)) from None
    except KeyUnavailable:
        raise route.problems(Problem(503, "The key service is unavailable; retry shortly.")) from None
    except Exception:
        log.exception("unhandled error", extra={"path": request.path, "method": request.method})
        raise route.problems(Problem(500, "An unexpected error occurred.")) from None


def http_problem(exc: web.HTTPException) -> Problem:
    """The problem for an aiohttp HTTP error (404 no route, 405, 413 body too large ...)."""
    headers = {}
    if isinstance(exc, web.HTTPMethodNotAllowed):
        headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
    detail = {
        404: "No resource exists at this path.",
        405: "This method is not allowed on this path.",
        413: "The request body is too large.",
    }.get(exc.status, exc.text if exc.text and not exc.text.startswith(str(exc.status)) else None)
    return Problem(exc.status, detail, headers=headers)


async def _pipeline(route: Route, request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    trace_id = request[TRACE_ID]
    caller = await _authenticate(request, settings, trace_id) if route.auth else None
    if caller is not None and route.permission is not None:
        _check_permission(caller, route.permission)
    if route.path_params and any("\x00" in request.match_info[name] for name in route.path_params):
        raise validation_problem(
            {
                name: ["Must not contain NUL characters."]
                for name in route.path_params
                if "\x00" in request.match_info[name]
            }
        )
    if "%00" in request.rel_url.raw_query_string:
        raise validation_problem(
            {
                key: ["Must not contain NUL characters."]
                for key, value in request.query.items()
                if "\x00" in value or "\x00" in key
            }
        )
    query = _parse_query(route.query, request) if route.query else None
    payload, body = await _parse_body(route, request) if route.body is not None else (None, None)
    call = Call(request, caller, body, query, trace_id, payload=payload)
    waits = request.app.get(JOB_WAITS)
    reply_to_waits(waits.reply_address if waits is not None else None)  # the jobs it records answer here
    result = await route.handler(call)
    response = _to_response(route, result)
    for name, value in route.extra_headers.items():
        response.headers[name] = value
    for name, value in call.headers.items():
        response.headers[name] = value
    return response


async def authenticate_request(request: web.Request, settings, trace_id: str) -> Caller:
    """The caller of the ``<prefix>-API-KEY`` header, for a route declared with ``auth=False`` that
    authenticates only some of its requests (401 problems as for every route)."""
    return await _authenticate(request, settings, trace_id)


async def _authenticate(request: web.Request, settings, trace_id: str) -> Caller:
    key = request.headers.get(settings.header("API-KEY"))
    if key and not (key.isascii() and key.isprintable()):  # not UTF-8 (surrogate-escaped) or control bytes
        raise Problem(401, f"The {settings.header('API-KEY')} header does not hold a valid API key.")
    if not key:
        if "X-API-KEY" in request.headers and settings.header_prefix != "X":
            raise Problem(
                401,
                f"The X-API-KEY header was shut down on March 9, 2022; send {settings.header('API-KEY')}.",
            )
        raise Problem(401, f"The {settings.header('API-KEY')} header is missing.")
    caller = await caller_cache.get_or_load(
        key,
        trace_id=trace_id,
        ttl=settings.auth_cache_seconds,
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
        raise validation_problem(validation_errors(exc)) from None
    if extras:
        object.__setattr__(parsed, "__query_extra__", extras)
    return parsed


def _declared(model: type[BaseModel], key: str) -> bool:
    return any((info.alias or name) == key for name, info in model.model_fields.items())


def query_extras(query: BaseModel) -> dict[str, str]:
    """Query parameters the model did not declare (for ``metadata.<key>`` style filters)."""
    return getattr(query, "__query_extra__", {})


#: pydantic-core's JSON parser refuses nesting deeper than this (400).
MAX_JSON_DEPTH = 200
#: A literal that may overflow a double: an exponent of three digits, or 309 digits in a row (looked
#: for only in a body that long: one pattern of both tries the 309 digits at every digit of the body).
_HUGE_EXPONENT = re.compile(rb"[eE]\+?\d{3}")
_HUGE_DIGITS = re.compile(rb"\d{309}")
_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]+\+)?json$")


def json_media_type(content_type: str) -> bool:
    """True for ``application/json`` and every ``application/*+json`` media type (RFC 6839)."""
    return bool(_JSON_TYPE.match(content_type))


def _accepts(route_type: str, content_type: str) -> bool:
    if route_type == "application/json":
        return json_media_type(content_type)
    return content_type == route_type


async def read_json(request: web.Request, *, content_types: tuple[str, ...] = ("application/json",)) -> Any:
    """Read and parse a JSON body: 415 for another content type, 400 for malformed or empty JSON.

    ``application/json`` in ``content_types`` admits every JSON media type (``application/*+json``).
    Errors: see :func:`parse_json`.
    """
    if not any(_accepts(allowed, request.content_type) for allowed in content_types):
        raise Problem(415, f"Send the body as {' or '.join(content_types)}.")
    if request.content_type == FORM:
        return await read_form(request)
    return parse_json(await request.read())


#: An HTML form's body, admitted where a route lists it among its request content types.
FORM = "application/x-www-form-urlencoded"


async def read_form(request: web.Request) -> dict[str, str]:
    """An HTML form's fields as a JSON object of strings, for the route's body model to validate.

    A field left empty is absent (a browser sends every field of the form); a field sent twice keeps
    its last value; NUL in a name or value is a 400 naming the field (PostgreSQL text cannot hold it).
    """
    form = await request.post()
    payload = {name: value for name, value in form.items() if isinstance(value, str) and value != ""}
    nul = {
        name: ["Must not contain NUL characters."]
        for name, value in payload.items()
        if "\x00" in name or "\x00" in value
    }
    if nul:
        raise validation_problem(nul)
    return payload


def parse_json(raw: bytes) -> Any:
    """Parse a request body with pydantic-core's JSON parser; 400 problems for what cannot be stored.

    Refused (400): an empty body, malformed JSON, an escaped lone UTF-16 surrogate (``"\\ud800"``:
    no UTF-8 text can hold it), nesting deeper than :data:`MAX_JSON_DEPTH`, an integer literal of
    more than 4,300 digits (the parser's and Python's limit), a number too large for a double
    (stored JSON has no Infinity), and NUL in any string or key (PostgreSQL text cannot hold NUL).
    """
    if not raw.strip():
        raise Problem(400, "The request body is empty.", title="Invalid body")
    try:
        payload = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise Problem(400, f"The request body is not valid JSON: {exc}", title="Invalid body") from None
    errors: dict[str, list[str]] = {}
    if b"\\u0000" in raw:
        for path in _paths(payload, "", lambda v: isinstance(v, str) and "\x00" in v, keys=True):
            errors.setdefault(path or "body", []).append("Must not contain NUL characters.")
    if _HUGE_EXPONENT.search(raw) or (len(raw) >= 309 and _HUGE_DIGITS.search(raw)):
        for path in _paths(payload, "", lambda v: isinstance(v, float) and not math.isfinite(v)):
            errors.setdefault(path or "body", []).append("This number is too large.")
    if errors:
        raise validation_problem(errors)
    return payload


def _paths(value: Any, path: str, bad: Callable[[Any], bool], *, keys: bool = False) -> list[str]:
    """The paths of the values (and, with ``keys``, the object keys) in a JSON value that are ``bad``."""
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _paths(item, f"{path}[{i}]", bad, keys=keys)]
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            found += [child] if keys and bad(key) else _paths(item, child, bad, keys=keys)
        return found
    return [path] if bad(value) else []


async def _parse_body(route: Route, request: web.Request) -> tuple[Any, Any]:
    """``(parsed JSON, validated body)``."""
    if route.body_optional and not request.body_exists:
        payload: Any = {}
    else:
        payload = await read_json(request, content_types=route.request_content_types)
    try:
        return payload, route.body_adapter.validate_python(payload)
    except ValidationError as exc:
        raise validation_problem(validation_errors(exc)) from None


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


class JsonAnswer:
    """The answer adapter of a route whose answer is a JSON value the domain builds in the documented
    shape (``POST /tokenize`` mirrors its request: any structure, token objects inside).

    Validating such an answer against its documented union (every JSON value fits it) and dumping
    the model costs about nine times what orjson takes to write it; this writes it with orjson
    directly, as pydantic would: keys in the order the domain gives them, UUIDs as strings, UTC
    datetimes ending in ``Z``. What orjson refuses (an integer beyond 64 bits, a key that is not a
    string, nesting deeper than it writes) goes through ``TypeAdapter(documented)`` as before.
    """

    _OPTIONS = orjson.OPT_UTC_Z

    def __init__(self, documented: Any) -> None:
        self._adapter = TypeAdapter(documented)

    def validate_python(self, value: Any) -> Any:
        """``value`` itself: the domain built it (see the class)."""
        return value

    def dump_json(self, value: Any, **options: Any) -> bytes:
        """The JSON of ``value``: orjson, else the documented type's adapter with ``options``
        (``exclude_unset``, ``by_alias``); raises ``ValidationError`` when that one refuses it."""
        try:
            return orjson.dumps(value, option=self._OPTIONS)
        except TypeError:
            return self._adapter.dump_json(self._adapter.validate_python(value), **options)


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
    adapter = route.response_adapter
    if adapter is None:
        return json_response(result, status)
    try:
        body = adapter.dump_json(adapter.validate_python(result), exclude_unset=True, by_alias=True)
    except ValidationError as exc:
        log.error(
            "the answer of %s %s does not fit its response model: %s", route.method, route.path, validation_errors(exc)
        )
        raise Problem(500, "An unexpected error occurred.") from None
    return web.Response(status=status, body=body, content_type=route.response_content_type)
