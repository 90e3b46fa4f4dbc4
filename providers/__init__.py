"""External providers (card networks, agentic providers): one adapter interface per kind of provider.

Test tenants reach the sandbox (``TESSERA_SANDBOX_URL``); production tenants reach the live provider
configured in the settings, or get a 422 problem saying that the provider is not configured.
:class:`HttpClient` is the transport every adapter uses: JSON over HTTP with timeouts, an
idempotency key on every call, and failures classified as :class:`infra.jobs.TransientError` (retry)
or :class:`infra.jobs.PermanentError` (record and stop).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import orjson
import urllib3

from infra.errors import Problem
from infra.jobs import PermanentError, TransientError
from infra.metrics import observe_provider_call

_POOL = urllib3.PoolManager(num_pools=16, maxsize=16, retries=False)


@dataclass(frozen=True)
class ProviderAnswer:
    """A provider's answer: HTTP status, parsed JSON body, and how long the call took (ms)."""

    status: int
    body: Any
    duration_ms: int


class HttpClient:
    """JSON over HTTP to one provider base URL, with connect/read timeouts in seconds."""

    def __init__(self, base_url: str, *, name: str, connect_timeout: float = 5.0, read_timeout: float = 45.0):
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)

    def call(self, method: str, path: str, body: Any = None, *, idempotency_key: str | None = None) -> ProviderAnswer:
        """Send one request; 2xx and 4xx answers are returned, the rest raise.

        Raises TransientError for connection failures, timeouts, 408, 429 and 5xx answers (with the
        Retry-After delay when given). 4xx answers are returned for the adapter to classify.
        """
        headers = {"content-type": "application/json", "accept": "application/json"}
        if idempotency_key:
            headers["idempotency-key"] = idempotency_key
        started = time.monotonic()
        try:
            answer = _POOL.request(
                method,
                self.base_url + path,
                body=_encode(body) if body is not None else None,
                headers=headers,
                timeout=self._timeout,
                redirect=False,
            )
        except urllib3.exceptions.TimeoutError as exc:
            self._observe("timeout", started)
            raise TransientError(f"{self.name} did not answer in time") from exc
        except urllib3.exceptions.HTTPError as exc:
            self._observe("unreachable", started)
            raise TransientError(f"{self.name} could not be reached") from exc
        duration_ms = self._observe(_outcome_of(answer.status), started)
        try:
            parsed = orjson.loads(answer.data) if answer.data else None
        except ValueError:
            parsed = None
        if answer.status in (408, 429) or answer.status >= 500:
            retry_after = answer.headers.get("retry-after")
            raise TransientError(
                f"{self.name} answered {answer.status}",
                retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
            )
        return ProviderAnswer(answer.status, parsed, duration_ms)

    def _observe(self, outcome: str, started: float) -> int:
        """Record the call's latency by provider and outcome (Prometheus); returns it in ms."""
        seconds = time.monotonic() - started
        observe_provider_call(self.name, outcome, seconds)
        return int(seconds * 1000)


def _encode(body: Any) -> bytes:
    """A request body as JSON (orjson: an account updater chunk's call carries thousands of rows); the
    standard library for what orjson refuses (keys that are not strings, integers beyond 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


def _outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 429:
        return "throttled"
    if status == 408 or status >= 500:
        return "server_error"
    return "client_error"


class ProviderNotConfigured(Problem, PermanentError):
    """The one way an adapter says that its provider has no configuration for a tenant: raised where
    the adapter would be made. It is the 422 problem ``Provider not configured`` for a request, and
    the permanent error ``PROVIDER_NOT_CONFIGURED`` (status 422) for a job.

    ``detail`` defaults to ``The <provider> provider is not configured for production tenants on this
    deployment.``"""

    def __init__(self, provider: str, detail: str | None = None):
        detail = detail or f"The {provider} provider is not configured for production tenants on this deployment."
        Exception.__init__(self, detail)  # both bases' attributes are set here: their __init__s do not chain
        self.provider = provider
        self.status = 422
        self.title = "Provider not configured"
        self.detail = detail
        self.type = "about:blank"
        self.errors = None
        self.headers = {}
        self.extra = {}
        self.code = "PROVIDER_NOT_CONFIGURED"
        self.details = {}


def permanent_from_answer(answer: ProviderAnswer, *, default_code: str) -> PermanentError:
    """A PermanentError from a 4xx provider answer (its ``code`` and ``message`` when it sent them)."""
    body = answer.body if isinstance(answer.body, dict) else {}
    return PermanentError(
        str(body.get("code") or default_code), str(body.get("message") or f"provider answered {answer.status}")
    )
