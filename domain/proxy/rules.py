"""The proxy's request rules as pure functions (core document section 4, Proxy rules 2-6).

* :func:`destination_url`: the URL a request is forwarded to, from the destination base (the
  ``<prefix>-PROXY-URL`` header of an ephemeral proxy, or a pre-configured proxy's
  ``destination_url``), the path after ``/proxy`` and the query string (rule 5).
* :func:`check_destination_base`: the base's own rules (HTTPS, a DNS host, no IP literal), also used
  when a pre-configured proxy is stored. A one-label host such as ``localhost`` is a DNS name too:
  whether it may be reached is the SSRF guard's decision on the resolved address.
* :func:`forward_headers`: the headers sent to the destination (rules 4 and 6).

Header names come from the ``TESSERA_HEADER_PREFIX`` setting (:func:`proxy_header_names`). Whether a
DNS name resolves to a private address is checked when connecting (the outbound client's resolver),
not here.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import unquote, urlsplit

from config.settings import get_settings
from domain.proxy.errors import invalid_request

#: Hop-by-hop headers (RFC 9110 section 7.6.1, RFC 9112) and headers the outbound client sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
MAX_URL_LENGTH = 2048
_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)")


@dataclass(frozen=True)
class ProxyHeaderNames:
    """The service's proxy header names for one prefix (spec/README.md decision 1), lower-cased
    where they are compared: ``url`` (``<prefix>-PROXY-URL``), ``key``, ``keep_alive``,
    ``connection``, ``encrypted``, ``destination_status``, ``api_key``; ``key_query`` is the query
    parameter ``<prefix lowercased>-proxy-key``; ``own_prefix`` is ``<prefix>-`` lower-cased."""

    url: str
    key: str
    keep_alive: str
    connection: str
    encrypted: str
    destination_status: str
    api_key: str
    key_query: str
    own_prefix: str


@lru_cache(maxsize=8)
def proxy_header_names(prefix: str) -> ProxyHeaderNames:
    """The proxy's header names for ``prefix`` (the ``header_prefix`` setting, default ``TS``)."""

    def name(suffix: str) -> str:
        return f"{prefix}-{suffix}"

    return ProxyHeaderNames(
        url=name("PROXY-URL"),
        key=name("PROXY-KEY"),
        keep_alive=name("PROXY-KEEP-ALIVE"),
        connection=name("PROXY-CONNECTION"),
        encrypted=name("ENCRYPTED"),
        destination_status=name("PROXY-DESTINATION-STATUS"),
        api_key=name("API-KEY"),
        key_query=name("proxy-key").lower(),
        own_prefix=name("").lower(),
    )


def header_names() -> ProxyHeaderNames:
    """The proxy's header names for the configured ``TESSERA_HEADER_PREFIX``."""
    return proxy_header_names(get_settings().header_prefix)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def check_destination_base(base: str, *, where: str = "destination") -> str:
    """Validate a destination base and return it with trailing slashes removed (Proxy rule 5).

    Accepted: ``https://<dns name>[:port][/path]`` with a syntactically valid host name of one or more
    labels (``localhost`` included: the outbound client's SSRF guard decides on the resolved address), no IP
    literal (IPv4, IPv6 or the numeric shorthands ``127.1`` / ``0x7f000001``), no user info, no query
    string and no fragment, at most :data:`MAX_URL_LENGTH` characters. Raises a 400
    :class:`~domain.proxy.errors.ProxyError` naming ``where``. Accepted bases are remembered (a
    bounded cache: the same few destinations are invoked again and again).
    """
    if isinstance(base, str):
        return _checked_base(base, where)
    return _check_destination_base(base, where=where)


@lru_cache(maxsize=1024)
def _checked_base(base: str, where: str) -> str:
    return _check_destination_base(base, where=where)  # a refusal raises: never cached


def _check_destination_base(base: str, *, where: str) -> str:
    if not isinstance(base, str) or not base.strip():
        raise invalid_request("A destination URL is required.", where=where)
    base = base.strip()
    if len(base) > MAX_URL_LENGTH:
        raise invalid_request(f"The destination URL is longer than {MAX_URL_LENGTH} characters.", where=where)
    try:
        parts = urlsplit(base)
        port = parts.port
    except ValueError:
        raise invalid_request("The destination is not a valid URL.", where=where) from None
    if parts.scheme.lower() != "https":
        raise invalid_request("The destination must use HTTPS.", where=where)
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise invalid_request("The destination URL may not carry credentials; send them in headers.", where=where)
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise invalid_request("The destination URL has no host.", where=where)
    labels = host.split(".")
    if _is_ip_literal(host) or "[" in parts.netloc or _NUMERIC_LABEL.fullmatch(labels[-1]):
        raise invalid_request("The destination host must be a DNS name, not an IP address.", where=where)
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise invalid_request("The destination host is not a valid DNS name.", where=where)
    if port == 0:
        raise invalid_request("The destination port is not valid.", where=where)
    if parts.query or parts.fragment or "?" in base or "#" in base:
        raise invalid_request("The destination base may not carry a query string or a fragment.", where=where)
    return base.rstrip("/")


#: Percent-decoding rounds a path segment may need; one that still changes after them is refused.
MAX_DECODING_ROUNDS = 4


def _fully_decoded(segment: str) -> str | None:
    """``segment`` percent-decoded until it no longer changes (``%252e`` -> ``%2e`` -> ``.``); None
    when :data:`MAX_DECODING_ROUNDS` rounds are not enough."""
    for _ in range(MAX_DECODING_ROUNDS + 1):
        decoded = unquote(segment)
        if decoded == segment:
            return decoded
        segment = decoded
    return None


def _check_path(path: str) -> None:
    """Refuse a tail that could climb out of the destination's base path, however a server along
    the way decodes it: a segment that, percent-decoded repeatedly, is ``.`` or ``..`` (with or
    without a ``;`` parameter suffix, as Tomcat and others read ``..;``) or holds a slash or a
    backslash (an encoded separator), CR, LF or NUL."""
    if path and not path.startswith("/"):
        raise invalid_request("The path after /proxy must start with '/'.", where="path")
    for segment in path.split("/"):
        decoded = _fully_decoded(segment)
        if decoded is None:
            raise invalid_request("The path after /proxy is encoded too many times over.", where="path")
        if decoded.split(";", 1)[0] in (".", ".."):
            raise invalid_request("The path after /proxy may not hold '.' or '..' segments.", where="path")
        if any(ch in decoded for ch in ("/", "\\", "\r", "\n", "\0")):
            raise invalid_request(
                "The path after /proxy holds a character that is not allowed (an encoded "
                "slash or backslash, a line break or NUL).",
                where="path",
            )


def forwarded_query(query: str, key_query: str) -> str:
    """The raw query string without the proxy-key parameter (``key_query``, matched
    case-insensitively after percent-decoding); every other parameter is kept byte for byte."""
    kept = []
    for part in query.split("&"):
        if not part:
            continue
        name = unquote(part.split("=", 1)[0].replace("+", " "))
        if name.lower() != key_query:
            kept.append(part)
    return "&".join(kept)


def destination_url(base: str, path: str, query: str, *, key_query: str, where: str = "destination") -> str:
    """The URL to forward to (Proxy rule 5): the checked base without trailing slashes, then
    ``path`` (the raw path after ``/proxy``, empty or starting with ``/``; no dot segments), then
    ``?`` and the raw ``query`` without the ``key_query`` parameter when anything is left.

    ``destination_url("https://api.example.com/v1/", "/charges", "a=1&<key_query>=k", key_query=...)``
    -> ``https://api.example.com/v1/charges?a=1``. Raises a 400 ``proxy_error``.
    """
    url = check_destination_base(base, where=where) + path
    _check_path(path)
    rest = forwarded_query(query, key_query)
    if rest:
        url = f"{url}?{rest}"
    if len(url) > MAX_URL_LENGTH + 8192:
        raise invalid_request("The destination URL is too long.", where="path")
    return url


def forward_headers(headers: Iterable[tuple[str, str]], names: ProxyHeaderNames) -> list[tuple[str, str]]:
    """The request headers sent to the destination (Proxy rules 4 and 6; section 5 rule 6).

    ``headers`` are the caller's ``(name, value)`` pairs in order, repeated names allowed. Dropped:
    hop-by-hop headers (:data:`HOP_BY_HOP`) and those the caller's ``Connection`` header names,
    ``Host`` and ``Content-Length`` (the client sets them), and every ``<prefix>-*`` header -- the
    caller's ``<prefix>-API-KEY`` included. ``<prefix>-PROXY-KEEP-ALIVE`` and
    ``<prefix>-PROXY-CONNECTION`` become ``Keep-Alive`` and ``Connection``. Everything else (the
    destination's own authentication such as ``Authorization``) is forwarded unchanged.
    Raises a 400 ``proxy_error`` for a value holding CR, LF or NUL.
    """
    pairs = list(headers)
    named_by_connection = {
        token.strip().lower() for name, value in pairs if name.lower() == "connection" for token in value.split(",")
    }
    keep_alive, connection = names.keep_alive.lower(), names.connection.lower()
    out: list[tuple[str, str]] = []
    for name, value in pairs:
        lower = name.lower()
        if any(ch in value for ch in "\r\n\0"):
            raise invalid_request(f"The header {name} holds a line break or NUL.", where=f"headers.{name}")
        if lower == keep_alive:
            out.append(("Keep-Alive", value))
        elif lower == connection:
            out.append(("Connection", value))
        elif lower.startswith(names.own_prefix) or lower in HOP_BY_HOP or lower in named_by_connection:
            continue
        else:
            out.append((name, value))
    return out
