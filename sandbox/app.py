"""The sandbox application: assembly, the shared routes (health, admin, card art) and :func:`run`.

The HTTP API is described in ``sandbox/README.md``.
"""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from sandbox import account_updater, agentic, allowances, bank_verification, card_network, wallet_gateway
from sandbox.cards import CardFilter
from sandbox.replies import error_middleware
from sandbox.state import SANDBOX, Sandbox, Settings, sandbox_of

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (account-updater chunks are big)."""

CALLBACK_TIMEOUT_SECONDS = 5.0
"""Total time allowed to one best-effort callback POST."""

_ENVIRONMENT = {
    "slow_seconds": "TESSERA_SANDBOX_SLOW_SECONDS",
    "hang_seconds": "TESSERA_SANDBOX_HANG_SECONDS",
    "pending_seconds": "TESSERA_SANDBOX_PENDING_SECONDS",
}

# A 1x1 PNG in the visa blue: the placeholder behind every card-art URL.
_PLACEHOLDER_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGOQki8EAAEBAKt8CUAGAAAAAElFTkSuQmCC"
)

routes = web.RouteTableDef()


def make_app(
    *, slow_seconds: float = 30.0, hang_seconds: float = 300.0, pending_seconds: float = 2.0
) -> web.Application:
    """A new sandbox application with its own in-memory state.

    ``slow_seconds``: delay of the slow network-token card; ``hang_seconds``: delay of the
    hanging agentic card; ``pending_seconds``: time until a pending enrollment is enabled.
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[SANDBOX] = Sandbox(Settings(slow_seconds, hang_seconds, pending_seconds))
    for part in (card_network, account_updater, agentic, allowances, wallet_gateway, bank_verification):
        part.setup(app)
    app.add_routes(routes)
    app.cleanup_ctx.append(_callback_client)
    app.on_shutdown.append(_stop_background)
    return app


async def _callback_client(app: web.Application) -> AsyncIterator[None]:
    """Open the client session used for callbacks while the app runs."""
    timeout = aiohttp.ClientTimeout(total=CALLBACK_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        app[SANDBOX].http = session
        yield
        app[SANDBOX].http = None


async def _stop_background(app: web.Application) -> None:
    """On shutdown, cancel slow operations so that waiting requests end at once."""
    await app[SANDBOX].background.cancel_all()


@routes.get("/health")
async def health(_request: web.Request) -> web.Response:
    """200 ``{"status": "ok"}``."""
    return web.json_response({"status": "ok"})


@routes.get("/card-art/{owner}/{image}")
async def card_art_image(_request: web.Request) -> web.Response:
    """200 ``image/png``: the placeholder image behind every card-art and display URL."""
    return web.Response(body=_PLACEHOLDER_PNG, content_type="image/png")


@routes.get("/_admin/requests")
async def admin_requests(request: web.Request) -> web.Response:
    """200 ``{requests: [{endpoint, par, pan_last4, count}], total}``, filtered by ``endpoint`` and
    card (``pan_last4``, ``par``, ``pan``)."""
    rows = sandbox_of(request).requests.report(request.query.get("endpoint"), CardFilter.from_query(request.query))
    return web.json_response({"requests": rows, "total": sum(row["count"] for row in rows)})


@routes.post("/_admin/reset")
async def admin_reset(request: web.Request) -> web.Response:
    """204 after cancelling in-flight operations and forgetting all state."""
    await sandbox_of(request).reset()
    return web.Response(status=204)


class PathAccessLogger(AbstractAccessLogger):
    """Access log line ``METHOD /path STATUS seconds``: no query string (admin filters may name cards)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        """Log one answered request at INFO."""
        self.logger.info("%s %s %s %.3fs", request.method, request.path, response.status, time)


def settings_from_environment(environ: Mapping[str, str]) -> dict[str, float]:
    """``make_app`` keyword arguments from the ``TESSERA_SANDBOX_*_SECONDS`` variables that are set.

    Raises ValueError naming the variable when a value is not a non-negative number.
    """
    return {
        name: _seconds(variable, environ[variable]) for name, variable in _ENVIRONMENT.items() if environ.get(variable)
    }


def _seconds(variable: str, value: str) -> float:
    """``value`` of ``variable`` as seconds; ValueError unless a non-negative number."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{variable} must be a non-negative number of seconds")
    return seconds


def run(host: str, port: int, **kwargs: float) -> None:
    """Serve a sandbox on ``host``:``port`` until SIGINT or SIGTERM.

    ``kwargs`` are :func:`make_app`'s settings; one not given is read from its environment
    variable (``TESSERA_SANDBOX_SLOW_SECONDS``, ``TESSERA_SANDBOX_HANG_SECONDS``,
    ``TESSERA_SANDBOX_PENDING_SECONDS``), else :func:`make_app`'s default. Prints one line with
    the address once listening.
    """
    app = make_app(**{**settings_from_environment(os.environ), **kwargs})
    web.run_app(app, host=host, port=port, print=_announce, access_log_class=PathAccessLogger)


def _announce(message: str) -> None:
    """Print aiohttp's start-up banner as one line: ``tessera sandbox: Running on http://...``."""
    first_line = message.splitlines()[0].strip("= ")
    print(f"tessera sandbox: {first_line}", flush=True)
