"""``GET /status`` (no key), ``GET /openapi.json``, the documentation page ``GET /docs`` and ``GET /``
pointing to it."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field
from sqlalchemy import text
from swagger_ui_bundle import swagger_ui_path

from app.api import Api, Call, json_response, run_db
from app.context import OPENAPI, ROUTES
from app.openapi import build_openapi
from app.schemas import ResponseModel
from infra.errors import not_found

api = Api()
REGIONS = ("us", "eu")
_DOCUMENTS: weakref.WeakKeyDictionary[web.Application, dict] = weakref.WeakKeyDictionary()


class RegionStatus(ResponseModel):
    tokens: bool


class StatusOut(ResponseModel):
    us: RegionStatus | None = None
    eu: RegionStatus | None = None


class StatusQuery(BaseModel):
    """The query of ``GET /status``: ``region`` is checked by the handler, which answers ``{error}``."""

    region: str | None = Field(
        None, description="us or eu; another value answers 400 `{error}`.", json_schema_extra={"enum": list(REGIONS)}
    )


def _database_up(session) -> bool:
    session.exec(text("SELECT 1"))
    return True


@api.route(
    "GET",
    "/status",
    auth=False,
    response=StatusOut,
    tag="Status",
    summary="Service status",
    errors=(400, 503),
    description="No API key. `region` (us or eu) limits the answer to one region; another value answers 400 "
    "`{error}`. One deployment serves every region, so each reports whether this deployment can serve "
    "tokens (its database answers). 503 `{error}` when it cannot.",
    query=StatusQuery,
)
async def status(call: Call):
    region = call.query.region
    if region is not None and region not in REGIONS:
        return json_response({"error": f"Unknown region '{region}'; use us or eu."}, status=400)
    try:
        up = await run_db(call.request.app, _database_up)
    except Exception:  # noqa: BLE001 - any database failure means "unavailable"
        return json_response({"error": "The service is unavailable."}, status=503)
    regions = [region] if region else list(REGIONS)
    return {name: {"tokens": up} for name in regions}


@api.route(
    "GET",
    "/openapi.json",
    auth=False,
    response=dict[str, Any],
    tag="Status",
    summary="This API's OpenAPI 3.1 description",
)
async def openapi(call: Call) -> web.Response:
    app = call.request.app
    document = app.get(OPENAPI) or _DOCUMENTS.get(app)
    if document is None:
        # Built on first use; a started application's state must not change, so it is cached beside it.
        document = _DOCUMENTS[app] = build_openapi(call.settings, app[ROUTES])
    return json_response(document)


# ---- the documentation page ----------------------------------------------------------------------

#: Swagger UI as installed with the package (``swagger-ui-bundle-v2``): no outside network is needed.
SWAGGER_UI = Path(str(swagger_ui_path))
_ASSETS = {
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
_DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Tessera API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/assets/favicon-32x32.png">
</head>
<body>
<div id="ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/assets/init.js"></script>
</body>
</html>
"""
_INIT = """window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui", deepLinking: true,
  defaultModelsExpandDepth: 0, docExpansion: "none"});
"""


@api.route(
    "GET",
    "/",
    auth=False,
    status=302,
    response=str,
    response_content_type="text/html",
    tag="Status",
    summary="Where the documentation is",
    description="No API key. Redirects (302) to the documentation page `GET /docs`; the description itself "
    "is `GET /openapi.json`.",
)
async def root(call: Call) -> web.Response:
    return web.Response(
        status=302,
        headers={"Location": "/docs"},
        text='<a href="/docs">Tessera API documentation: /docs</a>',
        content_type="text/html",
    )


@api.route(
    "GET",
    "/docs",
    auth=False,
    response=str,
    response_content_type="text/html",
    tag="Status",
    summary="This API's documentation page",
    description="No API key. A page rendering `GET /openapi.json` with Swagger UI, served from the installed "
    "package (no outside network).",
)
async def docs(call: Call) -> web.Response:
    return web.Response(text=_DOCS_PAGE, content_type="text/html")


@api.route(
    "GET", "/docs/assets/{name}", auth=False, tag="Status", summary="A file of the documentation page", documented=False
)
async def docs_asset(call: Call) -> web.StreamResponse:
    name = call.params["name"]
    if name == "init.js":
        return web.Response(text=_INIT, content_type="application/javascript")
    if name not in _ASSETS:
        raise not_found("file")
    return web.Response(
        body=(SWAGGER_UI / name).read_bytes(),
        content_type=_ASSETS[name],
        headers={"Cache-Control": "public, max-age=86400"},
    )
