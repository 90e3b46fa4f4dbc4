"""Traces across the api, the worker, the provider call and the webhook delivery (``infra/tracing``).

The test worker runs in this process (threads), so tracing is set up here once, exporting to memory
through the same scrubber a real exporter sits behind, and a second api is served after it (the
server instrumentation gives the applications made from then on its middleware). Every header is
captured (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*=.*``), so the API key and the webhook
signature reach the spans and the scrubber must take them out.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from app.main import init_app
from domain.network_tokens import records
from infra import tracing
from infra.celery import DELIVER_TASK
from infra.http_pool import POOL
from tests.conftest import free_port, serve_in_thread
from tests.helpers import ApiClient
from tests.ops.scan import find_secrets

pytestmark = pytest.mark.api

VISA = "4242424242424242"
CVC = "737"
YEAR = dt.datetime.now(dt.UTC).year + 3
CAPTURED = (
    "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST",
    "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE",
    "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_REQUEST",
    "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_RESPONSE",
)


@dataclass
class TracedApi:
    """A second api served while tracing exports to ``spans``."""

    base_url: str
    spans: InMemorySpanExporter

    def client(self, api_key: str) -> ApiClient:
        return ApiClient(self.base_url, api_key)


@pytest.fixture
def traced(api, monkeypatch) -> Iterator[TracedApi]:
    for name in CAPTURED:
        monkeypatch.setenv(name, ".*")
    spans = InMemorySpanExporter()
    assert tracing.configure("api", exporter=spans) is not None
    POOL.close()  # pooled outbound sessions made before are remade, with the client instrumentation
    port = free_port()
    stop = serve_in_thread(init_app, port)
    try:
        yield TracedApi(f"http://127.0.0.1:{port}", spans)
    finally:
        stop()
        tracing.shutdown()
        POOL.close()


def _wait_for_spans(spans: InMemorySpanExporter, predicate, timeout: float = 20.0) -> list[ReadableSpan]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = list(spans.get_finished_spans())
        if predicate(finished):
            return finished
        time.sleep(0.05)
    names = sorted({span.name for span in spans.get_finished_spans()})
    raise AssertionError(f"the expected spans did not end within {timeout} s; got {names}")


def _url(span: ReadableSpan, *names: str) -> object:
    """The first of the attributes ``names`` the span has (the semantic conventions' old and new names)."""
    attributes = span.attributes or {}
    return next((attributes[name] for name in names if name in attributes), None)


def _scope(span: ReadableSpan) -> str:
    """The instrumentation that made ``span`` (``aiohttp_client``, ``urllib3``, ``celery`` ...)."""
    scope = span.instrumentation_scope.name if span.instrumentation_scope is not None else ""
    return scope.removeprefix("opentelemetry.instrumentation.")


def _one(spans: list[ReadableSpan], trace_id: int, *, kind: SpanKind, name: str | None = None) -> list[ReadableSpan]:
    return [
        span
        for span in spans
        if span.context is not None
        and span.context.trace_id == trace_id
        and span.kind is kind
        and (name is None or span.name == name)
    ]


def test_one_trace_spans_the_request_the_tasks_the_provider_call_and_the_webhook(traced, tenant, receiver):
    client = traced.client(tenant.api_key)
    assert (
        client.post("/webhooks", {"name": "t", "url": receiver.url, "events": ["network-token.created"]}).status == 201
    )
    secret = client.get("/webhooks/signing-key").json["key"]
    traced.spans.clear()

    card = {"number": VISA, "expiration_month": 7, "expiration_year": YEAR, "cvc": CVC}
    created = client.post("/network-tokens", {"data": card})
    assert created.status == 201, created
    receiver.wait_for(lambda hit: hit.json["event"]["data"]["network_token"]["id"] == created.json["id"])
    # values that must never reach a span, even where the instrumentations record URLs and headers
    assert client.get(f"/network-tokens/{VISA}?number={VISA}&cvc={CVC}").status == 404

    def complete(spans: list[ReadableSpan]) -> bool:
        servers = [s for s in spans if s.kind is SpanKind.SERVER and s.name == "POST /network-tokens"]
        if not servers or servers[0].context is None:
            return False
        trace_id = servers[0].context.trace_id
        clients = {_scope(s) for s in _one(spans, trace_id, kind=SpanKind.CLIENT)}
        return bool(
            _one(spans, trace_id, kind=SpanKind.CONSUMER, name=f"run/{records.PROVISION_TASK}")
            and _one(spans, trace_id, kind=SpanKind.CONSUMER, name=f"run/{DELIVER_TASK}")
            and {"urllib3", "aiohttp_client"} <= clients
        )

    spans = _wait_for_spans(traced.spans, complete)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER and s.name == "POST /network-tokens"]
    assert server.context is not None
    trace_id = server.context.trace_id

    # the request queued the provisioning: its message carried the trace to the worker
    assert _one(spans, trace_id, kind=SpanKind.PRODUCER, name=f"apply_async/{records.PROVISION_TASK}")
    (provision,) = _one(spans, trace_id, kind=SpanKind.CONSUMER, name=f"run/{records.PROVISION_TASK}")
    # the provider call (urllib3, to the sandbox card network) is a child of the task's run
    provider_calls = [
        s
        for s in _one(spans, trace_id, kind=SpanKind.CLIENT)
        if s.parent is not None
        and provision.context is not None
        and s.parent.span_id == provision.context.span_id
        and _scope(s) == "urllib3"
    ]
    assert provider_calls, "no provider call span under the provisioning run"
    # the webhook delivery: the task's run and its POST (aiohttp client) in the same trace
    (deliver,) = _one(spans, trace_id, kind=SpanKind.CONSUMER, name=f"run/{DELIVER_TASK}")
    posts = [s for s in _one(spans, trace_id, kind=SpanKind.CLIENT) if _scope(s) == "aiohttp_client"]
    # the receiver's URL without its path: a client span keeps the origin only
    assert posts and all(_url(s, "url.full", "http.url") == receiver.url.removesuffix("/hook") for s in posts)
    assert deliver.context is not None
    assert all(s.parent is not None and s.parent.span_id == deliver.context.span_id for s in posts)
    # database statements of the request, parameterised
    statements = [
        s.attributes["db.statement"]
        for s in _one(spans, trace_id, kind=SpanKind.CLIENT)
        if s.attributes and "db.statement" in s.attributes
    ]
    assert statements

    # the 404 with card data in its path and query: the route template only
    (lookup,) = [s for s in spans if s.kind is SpanKind.SERVER and s.name == "GET /network-tokens/{id}"]
    assert lookup.attributes is not None
    assert _url(lookup, "url.path", "http.target") == "/network-tokens/{id}"
    assert str(_url(lookup, "url.full", "http.url")).endswith("/network-tokens/{id}")
    assert "url.query" not in lookup.attributes

    exported = "\n".join(span.to_json() for span in spans)
    for value in (VISA, tenant.api_key, secret, secret.removeprefix("whsec_")):
        assert value not in exported
    # the CVC as a value of its own (not the same digits inside a random id or a port number)
    server_attributes = json.dumps([dict(s.attributes or {}) for s in spans if s.kind is SpanKind.SERVER])
    assert re.search(rf"(?<![0-9A-Za-z]){CVC}(?![0-9A-Za-z])", server_attributes) is None
    assert find_secrets(exported) == []
    # the captured credential headers were redacted, not left out
    assert server.attributes is not None and server.attributes.get("http.request.header.ts_api_key") == ["[REDACTED]"]
    assert all(
        s.attributes and s.attributes.get("http.request.header.webhook_signature") == ["[REDACTED]"] for s in posts
    )


def test_no_span_is_left_behind_without_a_parent_client(traced, tenant):
    """A client span without a parent (here: the test's own HTTP client) is not exported."""
    traced.client(tenant.api_key).get("/webhooks")
    spans = _wait_for_spans(traced.spans, lambda found: any(s.kind is SpanKind.SERVER for s in found))
    assert all(s.parent is not None for s in spans if s.kind is SpanKind.CLIENT)
