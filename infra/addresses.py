"""Outbound address vetting: the SSRF guard shared by webhook delivery, the outbound proxy, key-set
fetches and the customer code's egress tunnel.

:func:`is_public_address` says whether an IP address may be connected to (never private, loopback,
link-local, multicast, reserved, or such an address tunnelled in IPv6). :func:`validate_destination_url`
is the form-only check of a destination URL (no DNS), used when a webhook endpoint is created;
:func:`split_url` is the same check giving the URL's parts. :func:`resolve` resolves a name within a time
bound and :func:`vet` refuses any non-public answer; :func:`vetted_addresses` does both for transports
other than the HTTP client (:mod:`infra.http`), raising :class:`DestinationRefused`.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Sequence
from typing import Any, TypedDict
from urllib.parse import SplitResult, urlsplit

MAX_URL_LENGTH = 2048
#: The URL schemes a destination may use and their default ports.
ALLOWED_SCHEMES = {"http": 80, "https": 443}

# --------------------------------------------------------------------------
# Address classification
# --------------------------------------------------------------------------

_BLOCKED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # carrier-grade NAT (RFC 6598)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local (cloud metadata lives here)
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # TEST-NET-1
        "192.88.99.0/24",  # 6to4 relay anycast (deprecated)
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # TEST-NET-2
        "203.0.113.0/24",  # TEST-NET-3
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, includes 255.255.255.255
    )
)
_BLOCKED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/8",  # unspecified, loopback, IPv4-compatible (deprecated), ...
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215)
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments, incl. Teredo 2001::/32
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)
_NAT64_WKP = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Tell whether ``ip`` is a publicly routable unicast address.

    Pure function (no I/O). Returns ``False`` for private (RFC 1918, unique
    local ``fc00::/7``), loopback, link-local, multicast, reserved,
    unspecified, carrier-grade NAT (``100.64.0.0/10``), documentation and
    benchmarking ranges. IPv6 addresses that embed an IPv4 address are judged
    by the embedded address: IPv4-mapped (``::ffff:a.b.c.d``), NAT64
    well-known prefix (``64:ff9b::/96``) and 6to4 (``2002::/16``). Teredo and
    the deprecated IPv4-compatible form are never public. A scope id on an
    IPv6 address is ignored.

    Args:
        ip: an :class:`ipaddress.IPv4Address` or :class:`ipaddress.IPv6Address`.

    Returns:
        ``True`` only if connecting to ``ip`` cannot reach this host or its
        private networks.

    Raises:
        TypeError: if ``ip`` is not an ``ipaddress`` address object.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
        mapped = ip.ipv4_mapped
        if mapped is not None:
            return is_public_address(mapped)
        if ip in _NAT64_WKP:
            return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip in _SIXTOFOUR:
            embedded = ip.sixtofour
            return embedded is not None and is_public_address(embedded)
        if ip.teredo is not None or ip.is_site_local:
            return False
        blocked: tuple[ipaddress.IPv4Network, ...] | tuple[ipaddress.IPv6Network, ...]
        blocked = _BLOCKED_V6
    elif isinstance(ip, ipaddress.IPv4Address):
        blocked = _BLOCKED_V4
    else:
        raise TypeError(f"expected an IPv4Address or IPv6Address, got {type(ip).__name__}")
    if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return False
    if any(ip in net for net in blocked):
        return False
    return ip.is_global


# --------------------------------------------------------------------------
# URL checks
# --------------------------------------------------------------------------


def split_url(url: str, max_length: int = MAX_URL_LENGTH) -> tuple[SplitResult | None, str | None]:
    """Parse and form-check ``url``; return ``(parts, None)`` or ``(None, error)``."""
    if not isinstance(url, str) or not url:
        return None, "URL is empty"
    if len(url) > max_length:
        return None, f"URL is longer than {max_length} characters"
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        return None, "URL contains whitespace or control characters"
    if "\\" in url:
        return None, "URL contains a backslash"
    try:
        parts = urlsplit(url)
    except ValueError:
        return None, "URL is malformed"
    scheme = parts.scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        return None, "URL scheme must be http or https"
    if "@" in parts.netloc:
        return None, "URL must not contain credentials (user@host)"
    if not parts.hostname:
        return None, "URL has no host"
    try:
        port = parts.port
    except ValueError:
        return None, "URL port is invalid"
    if port == 0:
        return None, "URL port is invalid"
    try:
        idna_host(parts.hostname)
    except UnicodeError:
        return None, "URL host is not a valid host name"
    return parts, None


def idna_host(hostname: str) -> str:
    """Return the ASCII (IDNA) form of ``hostname``; raise UnicodeError if invalid."""
    try:
        ipaddress.ip_address(hostname)
        return hostname
    except ValueError:
        pass
    if hostname.isascii():
        if any(not (c.isalnum() or c in "-._") for c in hostname):
            raise UnicodeError("invalid character in host name")
        return hostname.lower()
    return hostname.encode("idna").decode("ascii").lower()


def validate_destination_url(url: str) -> str | None:
    """Form-only check of a webhook destination URL, for when it is created.

    Checks: scheme is ``http`` or ``https``; a host is present; no userinfo
    (``user:pass@``); valid port; no whitespace/control characters; total
    length ``<= 2048`` characters. Does **not** resolve DNS (the host may not
    exist yet) and so does not decide whether the address is public; that is
    enforced on every delivery by :func:`deliver`.

    Args:
        url: the candidate URL.

    Returns:
        ``None`` if acceptable, else a short error message suitable for an API
        validation error.

    Raises:
        Nothing.
    """
    _parts, error = split_url(url)
    return error


# --------------------------------------------------------------------------
# Name resolution and vetting
# --------------------------------------------------------------------------


class Refused(Exception):
    """The destination is not allowed (the message says why; no secret in it)."""


class DnsTimeout(Exception):
    """Name resolution took longer than its time bound."""


class _Lookup(TypedDict, total=False):
    """What the resolver thread hands back: getaddrinfo's answer or the exception it raised."""

    result: Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]]
    error: BaseException


def resolve(host: str, port: int, timeout_s: float) -> list[str]:
    """Resolve ``host`` to a de-duplicated list of IP strings (order kept).

    Runs getaddrinfo in a daemon thread so the wait is bounded by ``timeout_s``.
    Raises DnsTimeout or socket.gaierror/OSError.
    """
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    box: _Lookup = {}

    def run() -> None:
        try:
            box["result"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except BaseException as exc:  # noqa: BLE001 - re-raised in caller thread
            box["error"] = exc

    worker = threading.Thread(target=run, name="tessera-dns", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DnsTimeout()
    if "error" in box:
        raise box["error"]
    seen: list[str] = []
    for family, _type, _proto, _canon, sockaddr in box["result"]:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = str(sockaddr[0])
        if addr not in seen:
            seen.append(addr)
    return seen


def vet(addresses: list[str], allow_private: bool) -> None:
    """Raise Refused unless every address is public (or private is allowed)."""
    if not addresses:
        raise Refused("host resolved to no addresses")
    if allow_private:
        return
    for addr in addresses:
        try:
            ip = ipaddress.ip_address(addr.split("%", 1)[0])
        except ValueError:
            raise Refused("host resolved to an unparseable address") from None
        if not is_public_address(ip):
            raise Refused(f"destination address {ip} is not public")


def is_ip_literal(host: str) -> bool:
    """True when ``host`` is an IP address written out (no name to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------
# Vetted addresses for other transports (the customer code's egress tunnel)
# --------------------------------------------------------------------------


class DestinationRefused(Exception):
    """A destination that may not be connected to; the message says why (no secret in it)."""


def vetted_addresses(host: str, port: int, *, allow_private: bool, timeout_s: float) -> list[str]:
    """The addresses ``host`` resolves to (an IP literal stands for itself), each checked with the
    SSRF guard of deliveries and the proxy (:func:`is_public_address`) unless ``allow_private``.

    Raises :class:`DestinationRefused` when any address is not public, the name does not resolve,
    or resolution takes longer than ``timeout_s`` seconds.
    """
    try:
        addresses = resolve(host, port, timeout_s)
    except DnsTimeout:
        raise DestinationRefused(f"resolving {host} took longer than {timeout_s:g} s") from None
    except OSError:
        raise DestinationRefused(f"{host} does not resolve") from None
    try:
        vet(addresses, allow_private)
    except Refused as exc:
        raise DestinationRefused(str(exc)) from None
    return addresses
