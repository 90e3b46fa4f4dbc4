"""Safe outbound HTTP: webhook delivery and the outbound proxy.

The entry points that talk to the network are :func:`deliver_many` (a batch of POSTs sent
concurrently), :func:`deliver` (one POST) and :func:`forward` (one request of any method, awaited from
another event loop, for the proxy). They share one keep-alive connection pool per process
(aiohttp on one event loop per process, reused across tasks) with these protections:

* **SSRF** (:mod:`infra.addresses`, in the pools of :mod:`infra.http_pool`): the pool's resolver
  resolves a host name here, once per DNS-cache period, with
  :func:`socket.getaddrinfo`. If *any* resolved address is not public (see
  :func:`infra.addresses.is_public_address`) the delivery is refused before any connection is
  made, unless ``allow_private`` is true. Connections go only to vetted IP addresses (aiohttp
  never resolves the name another way; an IP-literal URL is vetted before the request), while the
  request still carries the original ``Host`` header and, for https, the original host name is used
  for SNI and certificate verification.
* **No redirects**: a 3xx answer is reported like any other non-2xx answer.
* **Bounded time**: ``timeout_s`` bounds DNS resolution, the TCP connect and
  every socket read; the whole attempt is bounded by
  ``TOTAL_TIMEOUT_FACTOR * timeout_s`` (so a server that drips bytes cannot
  hold a worker forever).
* **Bounded concurrency**: at most ``per_host`` connections to one host at a time.
* **Bounded memory**: at most ``max_response_bytes`` of the answer are read;
  the connection is then closed.
* **Safe errors**: :attr:`DeliveryResult.error` never contains the request
  body, the request headers, or the URL's path/query.

:func:`infra.addresses.validate_destination_url` is the form-only check used when a webhook
endpoint is created (no DNS).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import multidict
import yarl

from infra.addresses import (
    ALLOWED_SCHEMES,
    MAX_URL_LENGTH,
    DnsTimeout,
    Refused,
    idna_host,
    is_ip_literal,
    split_url,
    vet,
)
from infra.http_pool import POOL

__all__ = [
    "TOTAL_TIMEOUT_FACTOR",
    "USER_AGENT",
    "DeliveryResult",
    "ForwardError",
    "Forwarded",
    "Outcome",
    "Request",
    "deliver",
    "deliver_many",
    "fetch",
    "forward",
]

USER_AGENT = "Tessera-Webhooks/1"
#: Upper bound on the whole :func:`deliver` call, as a multiple of ``timeout_s``.
TOTAL_TIMEOUT_FACTOR = 3
_READ_CHUNK = 16 * 1024
# Headers the caller may not set: they are computed here (Host must match the
# URL, framing headers must match the body, the User-Agent is fixed).
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-connection",
        "user-agent",
    }
)

Outcome = Literal["success", "http_error", "timeout", "connection_error", "refused"]


@dataclass(frozen=True)
class DeliveryResult:
    """What happened to one delivery attempt.

    Attributes:
        status_code: HTTP status of the answer, or ``None`` if no answer was
            received (refused, timeout, connection error).
        duration_ms: wall time of the whole attempt in milliseconds
            (including DNS resolution), ``>= 0``.
        outcome: ``"success"`` (2xx), ``"http_error"`` (any other status,
            including 3xx since redirects are never followed), ``"timeout"``,
            ``"connection_error"`` (DNS failure, refused/reset connection,
            TLS failure, malformed answer) or ``"refused"`` (the URL or its
            resolved addresses were rejected before connecting).
        error: short human-readable reason, ``None`` on success. Safe to
            log: never contains the request body, request headers or the
            URL's path/query.
        transient: ``True`` if retrying later may help (timeouts, connection
            errors, 5xx, 408, 409, 425, 429); ``False`` for success, refused and
            other 4xx/3xx answers.
        retry_after_s: seconds from a ``Retry-After`` header in
            delta-seconds form on a 429 or 503 answer, else ``None``.
        response_body: the first bytes of the answer body, at most
            ``max_response_bytes`` (may be shorter if the read was cut by the
            total time budget). Not part of ``repr``.
    """

    status_code: int | None
    duration_ms: int
    outcome: Outcome
    error: str | None
    transient: bool
    retry_after_s: int | None = None
    response_body: bytes = field(default=b"", repr=False)


# --------------------------------------------------------------------------
# Delivery
# --------------------------------------------------------------------------


def _host_header(host: str, port: int, explicit_port: bool, scheme: str) -> str:
    """Build the Host header value: ``host[:port]`` with IPv6 in brackets."""
    shown = f"[{host}]" if ":" in host else host
    if explicit_port and port != ALLOWED_SCHEMES[scheme]:
        return f"{shown}:{port}"
    return shown


def _build_headers(extra: Mapping[str, str], host_header: str) -> dict[str, str]:
    """Merge caller headers over defaults; reserved headers are set here only."""
    out: dict[str, str] = {"content-type": "application/json"}
    for name, value in extra.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise Refused("request header names and values must be strings")
        if not name or any(c in name for c in " \t\r\n:") or not name.isascii():
            raise Refused("invalid request header name")
        if any(c in value for c in "\r\n\x00"):
            raise Refused("invalid request header value")
        lower = name.lower()
        if lower in _RESERVED_HEADERS:
            continue
        out[lower] = value
    out["user-agent"] = USER_AGENT
    out["host"] = host_header
    return out


def _parse_retry_after(value: str | None) -> int | None:
    """Parse a delta-seconds Retry-After value; HTTP-date form yields None."""
    if value is None:
        return None
    value = value.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 10:
        return None
    return int(value)


#: Non-5xx answers worth retrying: Request Timeout, Conflict, Too Early, Too Many Requests. Any other
#: non-2xx answer (3xx, 4xx) is permanent: the receiver will answer the same next time.
_TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})


def _classify_status(status: int) -> tuple[Outcome, bool, str | None]:
    if 200 <= status < 300:
        return "success", False, None
    transient = status >= 500 or status in _TRANSIENT_STATUSES
    return "http_error", transient, f"HTTP {status}"


def _tls_error_message(exc: BaseException) -> str:
    """Short, safe description of a TLS failure."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        nested = getattr(cur, "certificate_error", None) or getattr(cur, "os_error", None)
        if isinstance(nested, BaseException) and nested is not cur:  # aiohttp wraps the ssl error
            cur = nested
            continue
        if isinstance(cur, ssl.SSLCertVerificationError):
            detail = getattr(cur, "verify_message", None) or "certificate verify failed"
            return f"TLS certificate verification failed: {detail}"
        if isinstance(cur, ssl.CertificateError):
            return "TLS certificate does not match the host name"
        cur = cur.__cause__ or cur.__context__
    return "TLS handshake failed"


@dataclass(frozen=True)
class Request:
    """One request for :func:`deliver_many`: ``url``, JSON ``body`` bytes and extra ``headers``;
    ``method`` ``POST`` (a delivery) or ``GET`` (:func:`fetch`: the body is not sent)."""

    url: str
    body: bytes
    headers: Mapping[str, str]
    method: str = "POST"


async def close_sessions() -> None:
    """Close the pooled sessions of the running event loop (an application's own loop, at its
    shutdown; the pool's own loop closes at interpreter exit)."""
    await POOL.close_loop_sessions()


def _connect_error_message(exc: BaseException) -> str:
    cause = getattr(exc, "os_error", None) or exc.__cause__ or exc
    if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
        return "connection refused"
    return "could not connect"


async def _post(
    session: aiohttp.ClientSession, request: Request, *, timeout_s: float, allow_private: bool, max_response_bytes: int
) -> DeliveryResult:
    """One attempt of one request on the pooled ``session`` (never raises for network problems)."""
    started = time.monotonic()

    def result(
        outcome: Outcome,
        error: str | None,
        transient: bool,
        status: int | None = None,
        retry_after: int | None = None,
        response_body: bytes = b"",
    ) -> DeliveryResult:
        return DeliveryResult(
            status_code=status,
            duration_ms=max(0, round((time.monotonic() - started) * 1000)),
            outcome=outcome,
            error=error,
            transient=transient,
            retry_after_s=retry_after,
            response_body=response_body,
        )

    parts, error = split_url(request.url)
    if parts is None:
        return result("refused", error, False)
    scheme = parts.scheme.lower()
    assert parts.hostname is not None
    hostname = idna_host(parts.hostname)
    explicit_port = parts.port is not None
    port = parts.port if parts.port is not None else ALLOWED_SCHEMES[scheme]
    try:
        request_headers = _build_headers(request.headers, _host_header(hostname, port, explicit_port, scheme))
        if is_ip_literal(hostname):  # aiohttp does not ask the resolver about an IP literal
            vet([hostname], allow_private)
    except Refused as exc:
        return result("refused", str(exc), False)
    netloc = f"[{hostname}]" if ":" in hostname else hostname
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    url = yarl.URL(f"{scheme}://{netloc}:{port}{target}", encoded=True)
    timeout = aiohttp.ClientTimeout(total=TOTAL_TIMEOUT_FACTOR * timeout_s, sock_connect=timeout_s, sock_read=timeout_s)
    try:
        async with session.request(
            request.method,
            url,
            data=bytes(request.body) if request.method != "GET" else None,
            headers=request_headers,
            allow_redirects=False,
            timeout=timeout,
        ) as answer:
            status = answer.status
            retry_after = _parse_retry_after(answer.headers.get("retry-after")) if status in (429, 503) else None
            try:
                body = await answer.content.read(max_response_bytes) if max_response_bytes else b""
            except (aiohttp.ClientError, OSError, ValueError):
                # The status line and headers arrived; a broken body does not change the outcome.
                body = b""
            if not answer.content.at_eof():
                answer.close()  # not read to the end: the connection is not reused
    except (Refused, DnsTimeout, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        outcome, error = _failure(exc, timeout_s)
        return result(outcome, error, outcome != "refused")
    outcome, transient, err = _classify_status(status)
    return result(outcome, err, transient, status, retry_after, body[:max_response_bytes])


def _failure(exc: BaseException, timeout_s: float) -> tuple[Outcome, str]:
    """``(outcome, safe message)`` for an exception raised while sending a request and reading its
    answer: ``refused`` (the SSRF guard), ``timeout`` or ``connection_error``."""
    if isinstance(exc, Refused):
        return "refused", str(exc)
    if isinstance(exc, DnsTimeout):
        return "timeout", "DNS resolution timed out"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "connection_error", "DNS resolution failed"
    if isinstance(exc, (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError, ssl.SSLError)):
        return "connection_error", _tls_error_message(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "timeout", f"connect timed out after {timeout_s:g}s"
    if isinstance(exc, TimeoutError):
        return "timeout", "timed out waiting for the response"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connection_error", _connect_error_message(exc)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection_error", "connection closed before a response was received"
    if isinstance(exc, (aiohttp.ClientResponseError, aiohttp.ClientPayloadError, ValueError)):
        return "connection_error", "malformed response"
    text = str(exc).lower()
    return "connection_error", "connection reset by peer" if "reset" in text else "connection failed"


def deliver_many(
    requests: list[Request],
    *,
    timeout_s: float,
    allow_private: bool,
    per_host: int = 32,
    max_response_bytes: int = 64 * 1024,
    ca_certs: str | None = None,
) -> list[DeliveryResult]:
    """POST every request concurrently, safely, and report what happened to each (same order).

    The requests share the process's keep-alive connection pool (one event loop per process, reused
    across tasks), at most ``per_host`` connections to one host at a time. Each request follows the
    rules of :func:`deliver`: the SSRF guard sits in the pool's resolver (only vetted addresses are
    connected to; private, loopback and link-local ones refused unless ``allow_private``), redirects
    are never followed, ``timeout_s`` bounds the connect and each read and the whole attempt is bounded
    by ``TOTAL_TIMEOUT_FACTOR * timeout_s``. Network problems are reported in the results, never raised.

    Raises:
        ValueError: if ``timeout_s <= 0``, ``per_host < 1`` or ``max_response_bytes < 0``.
        TypeError: if a body is not bytes.
    """
    if not timeout_s > 0:
        raise ValueError("timeout_s must be > 0")
    if per_host < 1:
        raise ValueError("per_host must be >= 1")
    if max_response_bytes < 0:
        raise ValueError("max_response_bytes must be >= 0")
    for request in requests:
        if not isinstance(request.body, (bytes, bytearray, memoryview)):
            raise TypeError("body must be bytes")
    if not requests:
        return []

    async def run() -> list[DeliveryResult]:
        session = POOL.session(allow_private=allow_private, ca_certs=ca_certs, timeout_s=timeout_s, per_host=per_host)
        return list(
            await asyncio.gather(
                *(
                    _post(
                        session,
                        r,
                        timeout_s=timeout_s,
                        allow_private=allow_private,
                        max_response_bytes=max_response_bytes,
                    )
                    for r in requests
                )
            )
        )

    return asyncio.run_coroutine_threadsafe(run(), POOL.loop()).result()


def deliver(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    allow_private: bool,
    max_response_bytes: int = 64 * 1024,
    ca_certs: str | None = None,
) -> DeliveryResult:
    """POST ``body`` to ``url`` once, safely, and report what happened (:func:`deliver_many` of one).

    The request carries ``content-type: application/json`` (the caller may
    override it), the caller's ``headers``, ``user-agent: Tessera-Webhooks/1``
    and a ``Host`` header equal to the URL's host (plus ``:port`` if the URL
    names a non-default port). Caller values for ``Host``, ``User-Agent``,
    ``Content-Length``, ``Transfer-Encoding`` and other hop-by-hop headers are
    ignored. Redirects are never followed and nothing is retried here.

    The host is resolved once; if any resolved address fails
    :func:`infra.addresses.is_public_address` and ``allow_private`` is false the result is
    ``refused`` and no connection is made. Otherwise the vetted addresses are
    tried in order (next one only if connecting failed), connecting to the
    IP itself while using the URL's host name for ``Host``, SNI and
    certificate verification.

    Args:
        url: ``http://`` or ``https://`` URL without userinfo, ``<= 2048``
            characters.
        body: the request body (JSON bytes), sent with ``Content-Length``.
        headers: extra request headers (e.g. the ``webhook-*`` signature
            headers). Names/values must be str without CR/LF.
        timeout_s: seconds, ``> 0``; bounds DNS resolution, the TCP connect
            (plus TLS handshake) and each socket read separately. The whole
            call is additionally bounded by ``TOTAL_TIMEOUT_FACTOR * timeout_s``.
        allow_private: if true, private/loopback/... destinations are allowed
            (self-hosted installs delivering inside their own network).
        max_response_bytes: read at most this many bytes of the answer body
            (``>= 0``); the connection is closed afterwards.
        ca_certs: path to a PEM CA bundle for https verification; ``None``
            uses the system trust store. Mainly for tests.

    Returns:
        A :class:`DeliveryResult`. Network problems are reported in the
        result, never raised.

    Raises:
        ValueError: if ``timeout_s <= 0`` or ``max_response_bytes < 0``
            (programming errors).
        TypeError: if ``body`` is not bytes.
    """
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError("body must be bytes")
    [result] = deliver_many(
        [Request(url, bytes(body), headers)],
        timeout_s=timeout_s,
        allow_private=allow_private,
        max_response_bytes=max_response_bytes,
        ca_certs=ca_certs,
    )
    return result


# --------------------------------------------------------------------------
# Forwarding (the outbound proxy)
# --------------------------------------------------------------------------

#: Hop-by-hop answer headers (RFC 9110 section 7.6.1) and framing the api recomputes: not passed back.
_HOP_BY_HOP_ANSWER = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)


@dataclass(frozen=True)
class Forwarded:
    """A destination's answer to :func:`forward`: ``status``, ``headers`` (``(name, value)`` pairs in
    the order received, hop-by-hop and framing headers left out), ``body`` (as sent: never
    decompressed) and ``duration_ms``."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    duration_ms: int


class ForwardError(Exception):
    """:func:`forward` received no usable answer. ``outcome`` is ``refused`` (the URL or its resolved
    addresses are not allowed), ``timeout`` (no complete answer within the time limit),
    ``too_large`` (the answer is longer than allowed) or ``connection_error``; ``message`` is safe to
    show (never the request's headers, body, path or query)."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome
        self.message = message


async def _send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    *,
    timeout_s: float,
    allow_private: bool,
    max_response_bytes: int,
) -> Forwarded:
    started = time.monotonic()
    parts, error = split_url(url, max_length=MAX_URL_LENGTH + 8192)
    if parts is None:
        raise ForwardError("refused", error or "URL is not valid")
    assert parts.hostname is not None
    hostname = idna_host(parts.hostname)
    port = parts.port if parts.port is not None else ALLOWED_SCHEMES[parts.scheme.lower()]
    netloc = f"[{hostname}]" if ":" in hostname else hostname
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if is_ip_literal(hostname):  # aiohttp does not ask the resolver about an IP literal
            vet([hostname], allow_private)
        async with session.request(
            method,
            yarl.URL(f"{parts.scheme.lower()}://{netloc}:{port}{target}", encoded=True),
            data=body if body else None,
            headers=multidict.CIMultiDict(headers),
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as answer:
            content = await answer.content.read(max_response_bytes + 1)
            if len(content) > max_response_bytes:
                answer.close()
                raise ForwardError("too_large", f"the answer is longer than {max_response_bytes} bytes")
            kept = [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in answer.raw_headers
                if name.decode("latin-1").lower() not in _HOP_BY_HOP_ANSWER
            ]
            return Forwarded(answer.status, kept, content, max(0, round((time.monotonic() - started) * 1000)))
    except ForwardError:
        raise
    except (Refused, DnsTimeout, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        outcome, message = _failure(exc, timeout_s)
        raise ForwardError(outcome, message) from None


async def forward(
    method: str,
    url: str,
    headers: list[tuple[str, str]],
    body: bytes | None,
    *,
    timeout_s: float,
    allow_private: bool,
    extra_ca: str | None = None,
    per_host: int = 64,
    max_response_bytes: int = 10 * 1024 * 1024,
) -> Forwarded:
    """Send one request and return the destination's answer, awaited from any event loop.

    The request runs on the calling loop's pooled ``ClientSession`` (a keep-alive pool of at most
    ``per_host`` connections per destination host; :func:`close_sessions` at the loop's end) with the
    same SSRF guard as :func:`deliver` (resolved addresses vetted unless ``allow_private``), TLS 1.2
    or higher with the system's roots plus ``extra_ca`` (a PEM path), redirects never followed, no
    header added but ``Host`` and the body's framing, the answer never decompressed. ``headers`` are
    sent as given (repeated names kept); ``timeout_s`` bounds the whole exchange, answer body included.

    Raises :class:`ForwardError` (``refused``, ``timeout``, ``too_large``, ``connection_error``);
    cancelling the awaiting task cancels the request.
    """
    if not timeout_s > 0:
        raise ValueError("timeout_s must be > 0")

    session = POOL.session(
        allow_private=allow_private, ca_certs=None, timeout_s=timeout_s, per_host=per_host, extra_ca=extra_ca
    )
    return await _send(
        session,
        method,
        url,
        headers,
        body,
        timeout_s=timeout_s,
        allow_private=allow_private,
        max_response_bytes=max_response_bytes,
    )


def fetch(
    url: str,
    *,
    timeout_s: float,
    allow_private: bool,
    max_response_bytes: int = 64 * 1024,
    ca_certs: str | None = None,
    accept: str = "application/json",
) -> DeliveryResult:
    """GET ``url`` once under the rules of :func:`deliver` (the SSRF guard, no redirects, bounded
    time and memory) and report what happened; the answer's first ``max_response_bytes`` are in
    ``response_body``. Network problems are reported in the result (``refused`` for an address the
    guard rejects), never raised. ``accept``: the Accept header sent."""
    [result] = deliver_many(
        [Request(url, b"", {"accept": accept}, method="GET")],
        timeout_s=timeout_s,
        allow_private=allow_private,
        max_response_bytes=max_response_bytes,
        ca_certs=ca_certs,
    )
    return result
