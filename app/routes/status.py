"""``GET /status`` (no key) and ``GET /openapi.json``."""

from __future__ import annotations

import weakref

from aiohttp import web
from sqlalchemy import text

from app.api import Api, Call, json_response, run_db
from app.context import OPENAPI, ROUTES
from app.openapi import build_openapi
from app.schemas import ResponseModel

api = Api()
REGIONS = ("us", "eu")
_DOCUMENTS: weakref.WeakKeyDictionary[web.Application, dict] = weakref.WeakKeyDictionary()


class RegionStatus(ResponseModel):
    tokens: bool


class StatusOut(ResponseModel):
    us: RegionStatus | None = None
    eu: RegionStatus | None = None


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
    openapi_extra={
        "parameters": [
            {"name": "region", "in": "query", "required": False, "schema": {"type": "string", "enum": list(REGIONS)}}
        ]
    },
)
async def status(call: Call):
    region = call.request.query.get("region")
    if region is not None and region not in REGIONS:
        return json_response({"error": f"Unknown region '{region}'; use us or eu."}, status=400)
    try:
        up = await run_db(call.request.app, _database_up)
    except Exception:  # noqa: BLE001 - any database failure means "unavailable"
        return json_response({"error": "The service is unavailable."}, status=503)
    regions = [region] if region else list(REGIONS)
    return {name: {"tokens": up} for name in regions}


@api.route("GET", "/openapi.json", auth=False, tag="Status", summary="This API's OpenAPI 3.1 description")
async def openapi(call: Call) -> web.Response:
    app = call.request.app
    document = app.get(OPENAPI) or _DOCUMENTS.get(app)
    if document is None:
        # Built on first use; a started application's state must not change, so it is cached beside it.
        document = _DOCUMENTS[app] = build_openapi(call.settings, app[ROUTES])
    return json_response(document)
