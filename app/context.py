"""Typed keys of the aiohttp application's shared state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web

from storage.db import GroupCommit

if TYPE_CHECKING:
    from app.ratelimit import RateLimiter
    from config.settings import Settings
    from infra.wait import JobWaits

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
DB_EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("db_executor", ThreadPoolExecutor)
#: Shared transactions of the token hot path (``storage.db.GroupCommit``; ``TESSERA_GROUP_COMMIT_MS``).
GROUP_COMMIT: web.AppKey[GroupCommit] = web.AppKey("group_commit", GroupCommit)
#: The per-client-IP limiter (``app/ratelimit.py``); absent when ``TESSERA_RATE_LIMIT_ENABLED`` is false.
RATE_LIMITER: web.AppKey[RateLimiter] = web.AppKey("rate_limiter")
#: The Documents API's per-application limiter (one-minute windows; spec section 8).
DOCUMENT_LIMITER: web.AppKey[RateLimiter] = web.AppKey("document_limiter")
#: The pool of blocking file work (S3 and sealing of documents), apart from the database pool so a
#: large upload does not hold database threads.
FILE_EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("file_executor", ThreadPoolExecutor)
#: The process's job-outcome subscription (``infra/wait.py``).
JOB_WAITS: web.AppKey[JobWaits] = web.AppKey("job_waits")
OPENAPI: web.AppKey[dict] = web.AppKey("openapi", dict)
#: Every declared route of the application (``app/api.py``), in routing order.
ROUTES: web.AppKey[list] = web.AppKey("routes", list)

#: The request's trace id (``<prefix>-TRACE-ID``), set first thing by the error middleware.
TRACE_ID: web.RequestKey[str] = web.RequestKey("trace_id", str)
