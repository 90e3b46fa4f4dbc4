"""What a span may carry out of the process: the scrubbing step every exporter sits behind.

Spans never carry card numbers, CVCs, API keys, signing secrets, bearer tokens or token data. The
instrumentations record no bodies, and no statement parameters (SQLAlchemy records the
parameterised statement, redis replaces arguments with ``?``); this step removes what could still
carry a value, on every span, event and link before export (:class:`ScrubbingExporter`):

* **URLs** are reduced to what identifies the route: a server span's ``url.path`` / ``http.target``
  become its route template (``/tokens/{id}``), its ``url.full`` / ``http.url`` the origin and the
  template; a client span's (provider calls, webhook deliveries, the proxy) keep the origin only, as
  the delivery errors do (``infra/http.py``); ``url.query`` is dropped everywhere.
* **Headers** captured by ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*`` whose name speaks of a card or a
  credential (authorization, cookies, API keys, signatures, secrets, tokens, passwords) are replaced
  by ``[REDACTED]``.
* **Statement parameters** (``db.statement.parameters``, ``db.query.parameter.*``) are dropped, and
  the ``[parameters: ...]`` part of a database error's message.
* **Any value** (attributes, span and event names, status descriptions, exception messages and
  stack traces): a Luhn-valid run of 12 to 19 digits (spaces or dashes between them allowed), an API
  key (``key_...``), a webhook signing secret (``whsec_...``) and a bearer credential become
  ``[REDACTED]``.

A client span without a parent (a connection pool's own statement, a heartbeat, a broker poll) is not
exported: traces start at a request, a message or a scheduled send.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes, AttributeValue

from infra.pan import luhn_valid

REDACTED = "[REDACTED]"

# A run of digits standing alone (not inside a word, a hex id or a uuid), spaces or dashes between them.
_DIGITS = re.compile(r"(?<![0-9A-Za-z_-])[0-9](?:[ -]?[0-9]){11,18}(?![0-9A-Za-z_]|-[0-9A-Za-z])")
_SECRETS = re.compile(
    r"key_[A-Za-z0-9_-]{20,}"  # Tessera API keys
    r"|whsec_[A-Za-z0-9+/=_-]{16,}"  # Standard Webhooks signing secrets
    r"|(?i:bearer|basic)\s+[A-Za-z0-9._~+/=-]+"  # Authorization credentials
)
_PARAMETERS = re.compile(r"\[parameters: [^\n]*\]")
_SENSITIVE_HEADER = re.compile(
    r"authorization|cookie|key|secret|signature|token|password|session|credential|cvc|cvv|card", re.I
)
_HEADER_PREFIXES = ("http.request.header.", "http.response.header.")
_URL_FULL = frozenset({"url.full", "http.url"})
_URL_PATH = frozenset({"url.path", "http.target"})
_DROPPED = frozenset({"url.query", "db.statement.parameters"})
_DROPPED_PREFIXES = ("db.query.parameter.",)


def _card_number(match: re.Match[str]) -> str:
    digits = re.sub(r"[ -]", "", match.group(0))
    return REDACTED if 12 <= len(digits) <= 19 and luhn_valid(digits) else match.group(0)


def scrub_text(text: str) -> str:
    """``text`` with card numbers, API keys, signing secrets, bearer credentials and statement
    parameters replaced by ``[REDACTED]``."""
    text = _PARAMETERS.sub(f"[parameters: {REDACTED}]", text)
    return _DIGITS.sub(_card_number, _SECRETS.sub(REDACTED, text))


def _scrub_value(value: AttributeValue) -> AttributeValue:
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, int) and not isinstance(value, bool) and 12 <= len(str(abs(value))) <= 19:
        return REDACTED if luhn_valid(str(abs(value))) else value
    if isinstance(value, Sequence) and value and isinstance(value[0], str):
        return [scrub_text(str(item)) for item in value]
    return value


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}://{host}" if rest else ""


def scrub_attributes(attributes: Attributes, *, kind: SpanKind = SpanKind.INTERNAL) -> dict[str, AttributeValue]:
    """A copy of ``attributes`` fit to leave the process (the rules in the module docstring); the
    attributes of a span of ``kind``."""
    if not attributes:
        return {}
    route = attributes.get("http.route")
    template = route if isinstance(route, str) and route and kind is not SpanKind.CLIENT else None
    scrubbed: dict[str, AttributeValue] = {}
    for key, value in attributes.items():
        if key in _DROPPED or key.startswith(_DROPPED_PREFIXES):
            continue
        if key.startswith(_HEADER_PREFIXES) and _SENSITIVE_HEADER.search(key.split(".", 3)[-1]):
            scrubbed[key] = [REDACTED] if isinstance(value, Sequence) and not isinstance(value, str) else REDACTED
        elif key in _URL_FULL and isinstance(value, str):
            scrubbed[key] = scrub_text(_origin(value) + (template or ""))
        elif key in _URL_PATH:
            if template is not None:
                scrubbed[key] = template
        else:
            scrubbed[key] = _scrub_value(value)
    return scrubbed


def scrub_span(span: ReadableSpan) -> ReadableSpan:
    """A copy of ``span`` whose name, attributes, events, links and status description are scrubbed."""
    status = span.status
    if status.status_code is StatusCode.ERROR and status.description:
        status = Status(StatusCode.ERROR, scrub_text(status.description))
    return ReadableSpan(
        name=scrub_text(span.name),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=scrub_attributes(span.attributes, kind=span.kind),
        events=[
            Event(scrub_text(event.name), scrub_attributes(event.attributes), event.timestamp) for event in span.events
        ],
        links=[Link(link.context, scrub_attributes(link.attributes)) for link in span.links],
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def exported(span: ReadableSpan) -> bool:
    """Whether ``span`` is exported at all: not a client span without a parent."""
    return not (span.kind is SpanKind.CLIENT and span.parent is None)


class ScrubbingExporter(SpanExporter):
    """Wraps an exporter: it gets the :func:`exported` spans only, each through :func:`scrub_span`."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export the scrubbed copies of ``spans`` (success when none is left)."""
        kept = [scrub_span(span) for span in spans if exported(span)]
        return self.inner.export(kept) if kept else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush the wrapped exporter."""
        return self.inner.force_flush(timeout_millis)


__all__ = ["REDACTED", "ScrubbingExporter", "exported", "luhn_valid", "scrub_attributes", "scrub_span", "scrub_text"]
