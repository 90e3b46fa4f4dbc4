"""The tracer provider, its exporters and the instrumentations of one process: imported only when
tracing is on (:func:`infra.tracing.configure`)."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.instrumentation.sqlalchemy.engine import EngineTracer
from opentelemetry.instrumentation.sqlalchemy.version import __version__ as sqlalchemy_instrumentation_version
from opentelemetry.instrumentation.urllib3 import URLLib3Instrumentor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from infra.tracing.scrub import ScrubbingExporter

log = logging.getLogger("tessera.tracing")

#: Health checks and scrapes every few seconds are not traced (unless the operator lists the
#: excluded URLs himself with ``OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS`` or ``OTEL_PYTHON_EXCLUDED_URLS``).
PROBES = "^/healthz$,^/readyz$,^/metrics$"


@dataclass
class Tracing:
    """A process's tracing: its provider, and how to undo each instrumentation it turned on."""

    provider: TracerProvider
    undo: list[Callable[[], None]] = field(default_factory=list)

    def flush(self) -> None:
        """Export every span still buffered (waits at most the exporter's timeout)."""
        self.provider.force_flush()

    def stop(self) -> None:
        """Remove the instrumentations, then flush and stop the provider."""
        for undo in reversed(self.undo):
            undo()
        self.provider.shutdown()


class EveryEngine:
    """SQLAlchemy's instrumentation (its ``EngineTracer``: a client span per statement, with the
    parameterised ``db.statement``) on every engine of the process, attached when an engine first
    connects after tracing started. (``SQLAlchemyInstrumentor`` traces the engines made through the
    ``create_engine`` it wraps; ``storage.db`` imported ``create_engine`` before tracing could wrap it.)"""

    def __init__(self, provider: TracerProvider) -> None:
        name = "opentelemetry.instrumentation.sqlalchemy"
        self._tracer = trace.get_tracer(name, sqlalchemy_instrumentation_version, provider)
        self._usage = metrics.get_meter(name, sqlalchemy_instrumentation_version).create_up_down_counter(
            "db.client.connections.usage", unit="connections"
        )
        self._traced: weakref.WeakSet[Engine] = weakref.WeakSet()

    def instrument(self) -> None:
        """Trace every engine from its next connection on."""
        event.listen(Engine, "engine_connect", self._attach)

    def uninstrument(self) -> None:
        """Stop tracing the engines."""
        event.remove(Engine, "engine_connect", self._attach)
        EngineTracer.remove_all_event_listeners()
        self._traced = weakref.WeakSet()

    def _attach(self, connection: Connection) -> None:
        engine = connection.engine
        if engine not in self._traced:
            self._traced.add(engine)
            EngineTracer(self._tracer, engine, self._usage)


def start(service_name: str, *, exporters: Sequence[str] = (), exporter: SpanExporter | None = None) -> Tracing:
    """A provider for ``service_name`` (unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES``
    names the service) exporting through :class:`ScrubbingExporter`, and every instrumentation on it.

    ``exporter`` given (tests): spans go to it as each ends, and the provider is not made the global
    one. Otherwise the ``exporters`` named (what :func:`infra.tracing.exporter_names` reads from
    ``OTEL_TRACES_EXPORTER``; ``otlp``: http/protobuf, configured by ``OTEL_EXPORTER_OTLP_*``; ``console``:
    stdout) behind a batch processor (``OTEL_BSP_*``), and the
    provider becomes the global one."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)  # the sampler of OTEL_TRACES_SAMPLER
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(ScrubbingExporter(exporter)))
    else:
        for processor in _processors(exporters):
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
    return Tracing(provider, _instrument(provider))


def _processors(names: Sequence[str]) -> list[SpanProcessor]:
    processors: list[SpanProcessor] = []
    for name in names:
        made = _exporter(name)
        if made is not None:
            processors.append(BatchSpanProcessor(ScrubbingExporter(made)))
    return processors


def _exporter(name: str) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        log.warning("OTEL_TRACES_EXPORTER names %r: only otlp and console are installed; ignored", name)
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol.strip().lower() != "http/protobuf":
        log.warning("OTLP protocol %r is not installed: traces are sent as http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _instrument(provider: TracerProvider) -> list[Callable[[], None]]:
    """Turn on each instrumentation with ``provider``; returns how to undo those this call turned on."""
    undo: list[Callable[[], None]] = []
    for instrumentor in (
        AioHttpServerInstrumentor(),  # applications made from now on (init_app) get its middleware, outermost
        AioHttpClientInstrumentor(),  # webhook deliveries and the outbound proxy (infra.http)
        URLLib3Instrumentor(),  # provider calls (providers.HttpClient)
        CeleryInstrumentor(),  # publish and run spans; the context rides in the message headers
        RedisInstrumentor(),  # commands with their arguments replaced by "?"
    ):
        if instrumentor.is_instrumented_by_opentelemetry:
            continue
        with _server_defaults():
            instrumentor.instrument(tracer_provider=provider)
        if instrumentor.is_instrumented_by_opentelemetry:
            undo.append(instrumentor.uninstrument)
        else:
            log.warning("%s could not be turned on", type(instrumentor).__name__)
    engines = EveryEngine(provider)  # statements, parameterised: values are never recorded
    engines.instrument()
    undo.append(engines.uninstrument)
    return undo


@contextlib.contextmanager
def _server_defaults() -> Iterator[None]:
    """While an instrumentation is turned on: the probes are the excluded URLs unless the operator
    names some (the server instrumentation reads them then), and aiohttp's warning about the
    instrumentation's subclass of ``web.Application`` is not shown."""
    named = os.environ.get("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS")
    if not named:
        os.environ["OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS"] = PROBES
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Inheritance class .* from web.Application", DeprecationWarning)
            yield
    finally:
        if not named:
            os.environ.pop("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS", None)
