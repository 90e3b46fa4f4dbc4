"""The aiohttp application: middlewares, shared clients and the route modules.

Middlewares, outermost first: ``observe_middleware`` (log context, one access line and the request
metrics per request, by route template), ``error_middleware`` (trace id, problems), the rate limit
(only when ``TESSERA_RATE_LIMIT_ENABLED``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

from app.api import CALLER, http_problem
from app.context import (
    DB_EXECUTOR,
    DOCUMENT_LIMITER,
    FILE_EXECUTOR,
    GROUP_COMMIT,
    JOB_WAITS,
    RATE_LIMITER,
    ROUTES,
    SETTINGS,
    TRACE_ID,
)
from app.problems import problem_response
from app.ratelimit import RateLimiter, minute_limiter, rules_for
from app.routes import (
    account_updater,
    agentic,
    allowances,
    applications,
    client_keys,
    documents,
    enrichments,
    network_tokens,
    ops,
    proxies,
    proxy,
    reactors,
    status,
    tenancy,
    tenants,
    token_intents,
    tokens,
    wallets,
    webhooks,
)
from app.routes import logs as log_routes
from config.settings import Settings, get_settings
from infra import http, logs, metrics, tracing
from infra.errors import Problem
from infra.pan import holds_card_number
from infra.redis_clients import async_redis_client
from infra.wait import JobWaits
from storage.crypto import KeyUnavailable
from storage.db import GroupCommit
from storage.types import random_uuid

log = logging.getLogger("tessera.api")
access_log = logging.getLogger("tessera.api.access")

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_TRACED_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def route_modules() -> list:
    """The modules whose ``api`` registries make up the API, in routing order."""
    return [
        status,
        ops,
        tenants,
        tenancy,
        client_keys,
        documents,
        applications,
        tokens,
        token_intents,
        network_tokens,
        enrichments,
        allowances,
        agentic,
        account_updater,
        webhooks,
        reactors,
        log_routes,
        wallets,
        proxy,
        proxies,
    ]


@web.middleware
async def observe_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Bind the request's trace and tenant ids to its log lines; log and count it by route template."""
    started = time.monotonic()
    logs.clear()
    token = logs.bind_lazy(lambda: _request_context(request))
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away before the answer
        raise
    finally:
        elapsed = time.monotonic() - started
        route = _route_template(request)
        metrics.observe_request(request.method, route, status, elapsed)
        quiet = route in _PROBES and status < 400  # health checks and scrapes every few seconds
        access_log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s %s %s",
            request.method,
            route or "(no route)",
            status,
            extra={"method": request.method, "route": route, "status": status, "duration_ms": round(elapsed * 1000, 1)},
        )
        logs.unbind_lazy(token)


#: Routes polled by orchestrators and Prometheus: their successful answers are logged at DEBUG.
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def _request_context(request: web.Request) -> dict:
    caller = request.get(CALLER)
    return {"trace_id": request.get(TRACE_ID), "tenant_id": getattr(caller, "tenant_id", None)}


def _route_template(request: web.Request) -> str | None:
    """The matched resource's canonical path (``/tokens/{id}``), never the raw path; None when no
    route matched."""
    route = getattr(request.match_info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else None


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A thread pool whose work runs in the submitting context (the request's log context)."""

    def submit(self, fn, /, *args, **kwargs):
        """Schedule ``fn(*args, **kwargs)`` in a copy of the caller's context variables."""
        return super().submit(contextvars.copy_context().run, fn, *args, **kwargs)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Give every answer a trace id and turn every error into an RFC 7807 problem."""
    settings: Settings = request.app[SETTINGS]
    trace_header = settings.header("TRACE-ID")
    try:
        request[TRACE_ID] = _trace_id(request, trace_header)
        response = await handler(request)
    except Problem as problem:
        response = problem_response(problem, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = problem_response(http_problem(exc), request.path)
    except (OperationalError, InterfaceError, DisconnectionError):
        # the database is down or restarting: the request changed nothing; a retry shortly succeeds
        log.exception("database unavailable", extra={"path": request.path, "method": request.method})
        response = problem_response(
            Problem(503, "The database is unavailable; retry shortly.", headers={"Retry-After": "2"}), request.path
        )
    except KeyUnavailable:
        # the key service (AWS KMS) is down: nothing was sealed or changed; a retry shortly succeeds
        log.exception("key service unavailable", extra={"path": request.path, "method": request.method})
        response = problem_response(
            Problem(503, "The key service is unavailable; retry shortly.", headers={"Retry-After": "5"}), request.path
        )
    except Exception:
        log.exception("unhandled error", extra={"path": request.path, "method": request.method})
        response = problem_response(Problem(500, "An unexpected error occurred."), request.path)
    response.headers[trace_header] = request.get(TRACE_ID) or str(random_uuid())
    return response


def _trace_id(request: web.Request, header: str) -> str:
    supplied = request.headers.get(header) if request.method in _TRACED_METHODS else None
    if supplied is None:
        return str(random_uuid())
    if not _TRACE_ID.match(supplied) or holds_card_number(supplied):  # it is logged: never a card number
        request[TRACE_ID] = str(random_uuid())
        raise Problem(400, f"{header} must be a uuid (at most 64 letters, digits, '-', '_', '.', ':').")
    return supplied


@web.middleware
async def rate_limit_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Answer 429 when the client IP exceeds a rate limit rule (see ``app/ratelimit.py``)."""
    limiter = request.app.get(RATE_LIMITER)
    if limiter is not None:
        wait = await limiter.hit(
            request.remote or "unknown", rules_for(request.app[SETTINGS], request.method, request.path)
        )
        if wait:
            raise Problem(429, "Too many requests; slow down.", headers={"Retry-After": str(wait)})
    return await handler(request)


async def _resources(app: web.Application):
    """The application's shared resources, made and closed here only: the database and file thread
    pools, the group commit, the rate limiters and the Redis client they share, the job-outcome
    subscription."""
    settings = app[SETTINGS]
    app[DB_EXECUTOR] = ContextThreadPoolExecutor(settings.api_db_threads, thread_name_prefix="db")
    # sized like the event loop's default pool (min(32, CPUs + 4)), which the file work used before
    app[FILE_EXECUTOR] = ContextThreadPoolExecutor(thread_name_prefix="files")
    app[GROUP_COMMIT] = GroupCommit(app[DB_EXECUTOR], window=settings.group_commit_ms / 1000)
    redis_client = async_redis_client(settings) if settings.redis_url else None
    if settings.rate_limit_enabled:
        app[RATE_LIMITER] = RateLimiter(settings, redis_client)
    app[DOCUMENT_LIMITER] = minute_limiter(settings, redis_client)
    app[JOB_WAITS] = JobWaits(
        settings.redis_url,
        prefix=settings.redis_key_prefix,
        poll_seconds=settings.job_wait_poll_seconds,
        settings=settings,
    )
    await app[JOB_WAITS].start()
    yield
    await http.close_sessions()  # the outbound sessions of this loop (the proxy's)
    await app[JOB_WAITS].close()
    if redis_client is not None:
        await redis_client.aclose()
    app[FILE_EXECUTOR].shutdown(wait=True)
    app[DB_EXECUTOR].shutdown(wait=True)


def init_app(settings: Settings | None = None) -> web.Application:
    """Build the API application for ``settings`` (default: the process settings)."""
    settings = settings or get_settings()
    tracing.configure("api")  # off unless OTEL_* ask; when on, the app made next gets the server spans' middleware
    # without rate limits the limiter's middleware is left out: one layer less on every request
    limits = [rate_limit_middleware] if settings.rate_limit_enabled else []
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[observe_middleware, error_middleware, *limits],
    )
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_resources)
    app[ROUTES] = [route for module in route_modules() for route in module.api.routes]
    for module in route_modules():
        module.api.install(app)
    return app
