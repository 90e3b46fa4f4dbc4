"""When tracing is on, what a process sets up, and what the scrubber lets out (``infra/tracing``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from infra import tracing
from infra.tracing.scrub import REDACTED, ScrubbingExporter, scrub_attributes, scrub_text
from workers.signals import _prefork

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
VISA = "4242424242424242"


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console, none"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_SERVICE_NAME": "tessera-api"}, False),
    ],
)
def test_the_otel_variables_turn_tracing_on(environ, on):
    assert tracing.enabled(environ) is on


def test_the_exporter_named_by_the_endpoint_alone_is_otlp():
    assert tracing.exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "OTLP,console"}) == ["otlp", "console"]


def test_without_otel_variables_nothing_is_configured_nor_imported():
    """The api's factory, the worker's and beat's start-up in a process without ``OTEL_*``: no
    provider, no instrumentation, no SDK tracing module imported, aiohttp's Application untouched."""
    script = textwrap.dedent(
        """
        import sys
        from types import SimpleNamespace

        import aiohttp.web
        original = aiohttp.web.Application

        from app.main import init_app
        import workers.celery_app
        from workers import signals
        from infra import tracing

        init_app()
        signals._trace_worker(sender=SimpleNamespace(pool_cls="threads"))
        signals._trace_pool_process()
        signals._beat_started(sender=None)
        assert tracing.current() is None
        assert aiohttp.web.Application is original
        loaded = sorted(
            name for name in sys.modules
            if name.startswith(("opentelemetry.instrumentation", "opentelemetry.sdk.trace", "opentelemetry.exporter",
                                "infra.tracing."))
        )
        assert loaded == [], loaded
        print("untraced")
        """
    )
    environ = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("untraced")


def test_each_process_role_sets_up_its_own_tracing():
    """With ``OTEL_TRACES_EXPORTER`` set: a prefork worker leaves tracing to its pool processes, which
    each set it up as ``tessera-worker``; a thread-pool worker sets it up itself; the api as ``tessera-api``."""
    script = textwrap.dedent(
        """
        from types import SimpleNamespace

        from infra import tracing
        from workers import signals

        signals._trace_worker(sender=SimpleNamespace(pool_cls="prefork"))
        assert tracing.current() is None
        signals._trace_pool_process()
        assert tracing.current().provider.resource.attributes["service.name"] == "tessera-worker"
        tracing.shutdown()
        signals._trace_worker(sender=SimpleNamespace(pool_cls="threads"))
        assert tracing.current().provider.resource.attributes["service.name"] == "tessera-worker"
        tracing.shutdown()

        from app.main import init_app
        app = init_app()
        assert tracing.current().provider.resource.attributes["service.name"] == "tessera-api"
        assert app.middlewares[0].__module__.startswith("opentelemetry.instrumentation.aiohttp_server")
        print("traced")
        """
    )
    environ = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    environ.update(PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="console")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("traced")


@pytest.mark.parametrize(("pool", "prefork"), [("prefork", True), ("threads", False), ("solo", False)])
def test_only_a_prefork_worker_leaves_tracing_to_its_pool_processes(pool, prefork):
    assert _prefork(pool) is prefork


@pytest.mark.parametrize(
    ("role", "environ", "name"),
    [
        ("api", {}, "tessera-api"),
        ("worker", {}, "tessera-worker"),
        ("beat", {}, "tessera-beat"),
        ("worker", {"OTEL_SERVICE_NAME": "payments-worker"}, "payments-worker"),
        ("api", {"OTEL_RESOURCE_ATTRIBUTES": "service.name=edge,deployment.environment=prod"}, "edge"),
    ],
)
def test_the_service_name_is_the_roles_unless_the_environment_names_it(monkeypatch, role, environ, name):
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    configured = tracing.configure(role, exporter=InMemorySpanExporter())
    try:
        assert configured is not None
        assert tracing.configure(role) is configured  # once per process
        assert configured.provider.resource.attributes["service.name"] == name
    finally:
        tracing.shutdown()
    assert tracing.current() is None


# ---- the scrubber --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        f"card {VISA} declined",
        "card 4242 4242 4242 4242 declined",
        "card 4242-4242-4242-4242 declined",
        "/cards/378282246310005/art",
        "number=5555555555554444&x=1",
        "key_" + "A" * 43,
        "whsec_" + "c2VjcmV0LXNpZ25pbmcta2V5LWJ5dGVz",
        "Authorization: Bearer eyJhbGciOi.eyJzdWIi.sig",
    ],
)
def test_secrets_in_any_text_are_redacted(text):
    scrubbed = scrub_text(text)
    assert REDACTED in scrubbed
    for secret in (VISA, "4242 4242", "378282246310005", "5555555555554444", "A" * 43, "c2VjcmV0", "eyJzdWIi"):
        assert secret not in scrubbed


@pytest.mark.parametrize(
    "text",
    [
        "4242424242424241",  # fails the Luhn check
        "job 0b9c1d2e-4242-4242-8242-424242424242 done",
        "12345678901234567890123",  # longer than a card number
        "trace 2dc88655f62ff534d7619c7b05c78fb6",
        "took 1234 ms",
    ],
)
def test_ids_and_numbers_that_are_not_card_numbers_stay(text):
    assert scrub_text(text) == text


def test_statement_parameters_are_dropped():
    error = (
        "(psycopg2.errors.UniqueViolation) duplicate\n"
        "[SQL: INSERT INTO t (x) VALUES (%(x)s)]\n"
        "[parameters: {'x': 'abc'}]"
    )
    assert "abc" not in scrub_text(error)
    assert "[SQL: INSERT INTO t (x) VALUES (%(x)s)]" in scrub_text(error)
    attributes = {
        "db.statement": "SELECT t.id FROM t WHERE t.x = %(x_1)s",
        "db.statement.parameters": "{'x_1': 'abc'}",
        "db.query.parameter.x_1": "abc",
    }
    assert scrub_attributes(attributes, kind=SpanKind.CLIENT) == {"db.statement": attributes["db.statement"]}


def test_a_server_spans_urls_become_its_route_template():
    attributes = {
        "http.route": "/tokens/{id}",
        "http.target": f"/tokens/{VISA}?cvc=123",
        "url.path": f"/tokens/{VISA}",
        "url.query": "cvc=123",
        "http.url": f"http://user:pw@api.example:8443/tokens/{VISA}?cvc=123",
        "url.full": f"https://api.example/tokens/{VISA}?cvc=123",
        "http.request.header.ts_api_key": ["key_secret"],
        "http.request.header.authorization": ["Basic dXNlcjpwdw=="],
        "http.request.header.cookie": ["session=abc"],
        "http.request.header.x_card_cvc": ["123"],
        "http.request.header.content_type": ["application/json"],
        "http.status_code": 404,
    }
    assert scrub_attributes(attributes, kind=SpanKind.SERVER) == {
        "http.route": "/tokens/{id}",
        "http.target": "/tokens/{id}",
        "url.path": "/tokens/{id}",
        "http.url": "http://api.example:8443/tokens/{id}",
        "url.full": "https://api.example/tokens/{id}",
        "http.request.header.ts_api_key": [REDACTED],
        "http.request.header.authorization": [REDACTED],
        "http.request.header.cookie": [REDACTED],
        "http.request.header.x_card_cvc": [REDACTED],
        "http.request.header.content_type": ["application/json"],
        "http.status_code": 404,
    }
    # without a matched route nothing of the path is kept
    assert scrub_attributes({"http.target": f"/x/{VISA}"}, kind=SpanKind.SERVER) == {}


def test_a_client_spans_url_keeps_its_origin_only():
    attributes = {
        "http.url": "https://hooks.example.com/services/T000/B000/XXXXSECRET?token=abc",
        "url.full": "http://127.0.0.1:9000/v1/tokens",
        "http.request.header.webhook_signature": ["v1,abc="],
        "http.request.header.webhook_id": ["msg_1"],
        "http.route": "/ignored/{for}/clients",
    }
    assert scrub_attributes(attributes, kind=SpanKind.CLIENT) == {
        "http.url": "https://hooks.example.com",
        "url.full": "http://127.0.0.1:9000",
        "http.request.header.webhook_signature": [REDACTED],
        "http.request.header.webhook_id": ["msg_1"],
        "http.route": "/ignored/{for}/clients",
    }


def test_card_numbers_as_integers_or_in_lists_are_redacted():
    scrubbed = scrub_attributes({"a": int(VISA), "b": [f"x {VISA}", "y"], "c": 4242, "d": True})
    assert scrubbed == {"a": REDACTED, "b": [f"x {REDACTED}", "y"], "c": 4242, "d": True}


def test_spans_events_and_statuses_are_scrubbed_and_orphan_client_spans_dropped():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ScrubbingExporter(memory)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(f"work {VISA}", kind=SpanKind.CONSUMER) as span:
        try:
            raise ValueError(f"card {VISA} refused; key_{'B' * 43}")
        except ValueError as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, f"card {VISA}")
        span.add_event("looked up", {"number": VISA})
        with tracer.start_as_current_span("SELECT", kind=SpanKind.CLIENT):
            pass
    with tracer.start_as_current_span("heartbeat", kind=SpanKind.CLIENT):
        pass  # no parent: not exported
    provider.shutdown()

    spans = memory.get_finished_spans()
    assert sorted(span.name for span in spans) == ["SELECT", f"work {REDACTED}"]
    exported = "\n".join(span.to_json() for span in spans)
    assert VISA not in exported and "B" * 43 not in exported
    (work,) = [span for span in spans if span.kind is SpanKind.CONSUMER]
    assert work.status.description == f"card {REDACTED}"
    assert {event.name for event in work.events} == {"exception", "looked up"}
