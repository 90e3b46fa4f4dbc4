"""Operations endpoints, no API key: ``GET /healthz``, ``GET /readyz`` and ``GET /metrics``.

``/healthz`` answers while the process serves requests. ``/readyz`` answers 200 when the database,
the broker and S3 answer within :data:`CHECK_TIMEOUT_SECONDS`, else 503 naming the ones that did
not; it also shows the live workers and beat (from their heartbeats), which do not change its status:
the api records work whether or not a worker runs now. ``/metrics`` is the Prometheus text format
(``infra/metrics.py``).
"""

from __future__ import annotations

import asyncio
import functools
import time

from aiohttp import web

from app.api import Api, Call, json_response
from app.schemas import ResponseModel
from infra import metrics as registry
from infra import ops

api = Api()
CHECK_TIMEOUT_SECONDS = 3.0


class OpsHealthOut(ResponseModel):
    status: str


class OpsCheckOut(ResponseModel):
    ok: bool
    ms: int
    error: str | None = None


class OpsReadyOut(ResponseModel):
    status: str
    checks: dict[str, OpsCheckOut]
    failed: list[str]
    workers: list[dict] | None = None
    beat: dict | None = None


@api.route(
    "GET",
    "/healthz",
    auth=False,
    response=OpsHealthOut,
    tag="Operations",
    summary="Liveness: the process answers",
    description='No API key. 200 `{"status": "ok"}` whenever the api process serves requests.',
)
async def healthz(call: Call):
    return {"status": "ok"}


async def _check(name: str, fn) -> tuple[str, dict]:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    result: dict[str, bool | str | int]
    try:
        await asyncio.wait_for(loop.run_in_executor(None, fn), CHECK_TIMEOUT_SECONDS)
        result = {"ok": True}
    except TimeoutError:
        result = {"ok": False, "error": f"no answer within {CHECK_TIMEOUT_SECONDS:g} s"}
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        result = {"ok": False, "error": type(exc).__name__}
    result["ms"] = int((time.monotonic() - started) * 1000)
    return name, result


def _liveness(settings) -> tuple[list[dict], dict]:
    now = time.time()
    beats = ops.heartbeats(settings)
    workers = [
        {"name": b.name.split(":", 1)[1], "heartbeat_age_seconds": round(b.age(now), 3)}
        for b in sorted(beats.values(), key=lambda b: b.name)
        if b.kind == "worker" and b.alive(now)
    ]
    beat = beats.get("beat")
    return workers, {"heartbeat_age_seconds": round(beat.age(now), 3) if beat else None}


@api.route(
    "GET",
    "/readyz",
    auth=False,
    response=OpsReadyOut,
    tag="Operations",
    summary="Readiness: database, keys, broker and S3 answer",
    errors=(503,),
    description="No API key. 200 when the database, the broker and S3 answer and this process's master key "
    "(or KMS key) opens the database's key check; 503 with `failed` naming the "
    "dependencies that did not. `workers` (live workers by heartbeat) and `beat` (age of its last heartbeat) "
    "are shown for operators and do not change the status.",
)
async def readyz(call: Call):
    settings = call.settings
    checks = dict(
        await asyncio.gather(
            _check("database", ops.check_database),
            _check("keys", ops.check_keys),
            _check("broker", functools.partial(ops.check_broker, settings)),
            _check("s3", functools.partial(ops.check_s3, settings)),
        )
    )
    failed = [name for name, result in checks.items() if not result["ok"]]
    try:
        loop = asyncio.get_running_loop()
        workers, beat = await asyncio.wait_for(loop.run_in_executor(None, _liveness, settings), CHECK_TIMEOUT_SECONDS)
    except Exception:  # noqa: BLE001 - liveness is informative only
        workers, beat = None, None
    body = {
        "status": "unavailable" if failed else "ready",
        "checks": checks,
        "failed": failed,
        "workers": workers,
        "beat": beat,
    }
    return json_response(body, status=503 if failed else 200)


@api.route(
    "GET",
    "/metrics",
    auth=False,
    response=str,
    tag="Operations",
    summary="Prometheus metrics",
    response_content_type="text/plain",
    description="No API key. The Prometheus text exposition format: HTTP requests by route template and "
    "status, tasks by name and outcome, queue depth and oldest waiting work per queue, the outbox backlog, "
    "webhook deliveries by outcome, provider call latency, workers and beat.",
)
async def metrics(call: Call) -> web.Response:
    loop = asyncio.get_running_loop()
    body, content_type = await loop.run_in_executor(None, registry.render, call.settings)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response
