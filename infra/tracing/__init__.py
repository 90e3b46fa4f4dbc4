"""OpenTelemetry traces across the api, the workers and beat: off unless the standard ``OTEL_*``
variables ask for them.

**When tracing is on** (:func:`enabled`):

* ``OTEL_SDK_DISABLED=true`` turns it off whatever else is set;
* else ``OTEL_TRACES_EXPORTER`` set names the exporters (comma-separated: ``otlp``, ``console``);
  ``none`` alone (or only ``none``) means off;
* else it is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set
  (the exporter is then ``otlp``);
* else it is off. Off costs this module's import and one look at the environment: neither the
  SDK's tracing, nor an exporter, nor an instrumentation is imported.

**Where it is set up** (:func:`configure`, once per process, after any fork): the api in the app
factory (``app/main.py``), a worker in each pool process (``workers/signals.py``: ``worker_process_init``
for prefork and solo pools, ``worker_init`` for the thread pool), beat at ``beat_init``. Every process
instruments the same libraries with the maintained packages: the aiohttp server (one span per
request, named by route template), Celery (a producer span per message sent, a consumer span per
run; the trace context travels in the message headers, ``traceparent``), the aiohttp client
(webhook deliveries, the outbound proxy), urllib3 (provider calls), SQLAlchemy (every engine, from
its next connection on: :class:`infra.tracing.setup.EveryEngine`) and redis. So a
request, the task it queued, the provider call and the webhook delivery share one trace id.

The rest follows the SDK's own variables: ``OTEL_SERVICE_NAME`` (default ``tessera-api``,
``tessera-worker``, ``tessera-beat`` by role), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``
and ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_PROPAGATORS``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_*``
(http/protobuf). A client span without a parent (a connection pool's or a broker poll's own
statement, a heartbeat) is not exported: traces start at a request, a message or a scheduled send.

**Nothing sensitive leaves the process**: every exporter is wrapped by
:class:`infra.tracing.scrub.ScrubbingExporter` (URLs reduced to their route, credential headers
and statement parameters dropped, card numbers, API keys and signing secrets masked in any value).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # never imported at run time unless tracing is on
    from opentelemetry.sdk.trace.export import SpanExporter

    from infra.tracing.setup import Tracing

#: The default ``service.name`` of each process role (``OTEL_SERVICE_NAME`` overrides it).
SERVICE_NAMES = {"api": "tessera-api", "worker": "tessera-worker", "beat": "tessera-beat"}


class _State:
    """This process's tracing and the process it was set up in (a forked child sets up its own)."""

    tracing: Tracing | None = None
    pid: int | None = None


def exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The trace exporters the environment asks for (``otlp``, ``console``, ...), lower-case; an
    empty list when tracing is off (the rule is in the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return [name for name in (part.strip() for part in named.split(",")) if name and name != "none"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return ["otlp"]
    return []


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment (default ``os.environ``) turns tracing on."""
    return bool(exporter_names(environ))


def configure(role: str, *, exporter: SpanExporter | None = None) -> Tracing | None:
    """Set up tracing for this process as ``role`` (``api``, ``worker`` or ``beat``): a tracer
    provider exporting through the scrubber, and the instrumentations. Once per process: a second
    call in the same process returns the first's result; a forked child sets up its own.

    ``exporter`` (tests): export to it instead of what the environment names, whatever the
    environment says, without installing the provider as the global one. Returns None when tracing
    is off (nothing of OpenTelemetry is imported then)."""
    if _State.pid == os.getpid():
        return _State.tracing
    if exporter is None and not enabled():
        return None
    from infra.tracing.setup import start

    _State.tracing = start(SERVICE_NAMES.get(role, f"tessera-{role}"), exporters=exporter_names(), exporter=exporter)
    _State.pid = os.getpid()
    return _State.tracing


def current() -> Tracing | None:
    """The tracing set up in this process by :func:`configure`, or None."""
    return _State.tracing if _State.pid == os.getpid() else None


def flush() -> None:
    """Export the spans still buffered (a pool process about to exit); nothing when tracing is off."""
    tracing = current()
    if tracing is not None:
        tracing.flush()


def shutdown() -> None:
    """Undo :func:`configure` in this process: remove the instrumentations, flush and stop the
    provider (tests; a process exiting flushes by itself)."""
    tracing = current()
    _State.tracing, _State.pid = None, None
    if tracing is not None:
        tracing.stop()
