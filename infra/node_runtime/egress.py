"""The one way out of a sandboxed process: an HTTP CONNECT proxy on a unix socket, in the worker.

A sandboxed process has a network namespace of its own with nothing but its loopback
(:mod:`infra.node_runtime.sandbox`); the socket of this proxy is bound into it at
``/sandbox/egress.sock``, and ``runner.js`` sends every ``fetch`` and ``http``/``https`` request
through it as a ``CONNECT host:port`` tunnel (TLS stays end to end: the proxy sees only the host
and port). Each tunnel is vetted here, on the resolved address, by the SSRF guard of webhook
deliveries and the proxy (:func:`infra.addresses.vetted_addresses`): loopback, private, link-local,
metadata and every other non-public address is refused with ``403``, whatever
``TESSERA_ALLOW_PRIVATE_DESTINATIONS`` says (that setting is for the platform's own deliveries).
Only the ``host:port`` pairs of ``TESSERA_REACTOR_EGRESS_ALLOW`` (exact, case-insensitive) skip the
check. The connection goes to the vetted address itself, so a name cannot resolve differently
between the check and the connect.

Limits: a request head of at most 8 KiB read within :data:`HEAD_SECONDS`; at most
``max_tunnels`` tunnels at once (``503`` past that); a tunnel with no traffic either way for
:data:`IDLE_SECONDS` is closed. Refusals are logged with the host and port (never a byte of what
goes through).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import tempfile
import threading
from pathlib import Path

from infra.addresses import DestinationRefused, vetted_addresses

log = logging.getLogger("tessera.egress")

MAX_HEAD_BYTES = 8192
HEAD_SECONDS = 10.0
CONNECT_SECONDS = 10.0
IDLE_SECONDS = 120.0
_CHUNK = 1 << 16


def parse_connect(head: bytes) -> tuple[str, int]:
    """``(host, port)`` of a ``CONNECT host:port HTTP/1.x`` request head (IPv6 hosts in brackets).

    Raises ``ValueError`` naming what is wrong (another method, a malformed target)."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1 request line")
    method, target, _version = parts
    if method != "CONNECT":
        raise ValueError(f"only CONNECT is served, not {method[:16]}")
    host, sep, port_text = target.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError("the target must be host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(ch in host for ch in "/\\@ \t"):
        raise ValueError("the target's host is malformed")
    return host.lower(), int(port_text)


class EgressProxy:
    """A CONNECT proxy listening on a fresh unix socket (``path``, in a private folder) in a
    daemon thread; one per worker process. ``allow``: ``host:port`` pairs exempt from the address
    check. :meth:`close` stops it and removes the socket."""

    def __init__(self, *, allow: frozenset[str] = frozenset(), max_tunnels: int = 256):
        self.allow = allow
        self._folder = Path(tempfile.mkdtemp(prefix="tessera-egress-"))
        os.chmod(self._folder, 0o700)
        self.path = self._folder / "egress.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(self.path))
        self._server.listen(64)
        self._slots = threading.BoundedSemaphore(max_tunnels)
        self._closed = False
        #: Tunnels refused so far (for tests and metrics).
        self.refused = 0
        self._thread = threading.Thread(target=self._serve, name="tessera-egress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and remove the socket (open tunnels end with their peers)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._server.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self._folder.rmdir()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._answer(client, 503, "too many tunnels at once")
                client.close()
                continue
            threading.Thread(target=self._tunnel, args=(client,), name="tessera-egress-tunnel", daemon=True).start()

    def _tunnel(self, client: socket.socket) -> None:
        try:
            upstream = self._open(client)
            if upstream is not None:
                with upstream:
                    _relay(client, upstream)
        except OSError:
            pass
        finally:
            client.close()
            self._slots.release()

    def _open(self, client: socket.socket) -> socket.socket | None:
        """Read the CONNECT request, vet and connect; answer 200 and return the upstream socket,
        or answer the refusal and return None."""
        client.settimeout(HEAD_SECONDS)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(MAX_HEAD_BYTES)
            if not chunk:
                return None
            head += chunk
            if len(head) > MAX_HEAD_BYTES:
                self._answer(client, 431, "request head too large")
                return None
        end = head.index(b"\r\n\r\n") + 4
        early = head[end:]
        try:
            host, port = parse_connect(head)
        except ValueError as exc:
            self._answer(client, 405, str(exc))
            return None
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            addresses = vetted_addresses(host, port, allow_private=target in self.allow, timeout_s=CONNECT_SECONDS)
        except DestinationRefused as exc:
            self.refused += 1
            log.info("customer code's connection to %s refused: %s", target, exc)
            self._answer(client, 403, f"{target} may not be reached from customer code: {exc}")
            return None
        upstream = None
        for address in addresses:
            try:
                upstream = socket.create_connection((address, port), timeout=CONNECT_SECONDS)
                break
            except OSError:
                continue
        if upstream is None:
            self._answer(client, 502, f"{target} did not accept a connection")
            return None
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if early:
            upstream.sendall(early)
        return upstream

    @staticmethod
    def _answer(client: socket.socket, status: int, reason: str) -> None:
        body = reason.encode("utf-8", "replace")[:512]
        phrase = {
            403: "Forbidden",
            405: "Method Not Allowed",
            431: "Request Header Fields Too Large",
            502: "Bad Gateway",
            503: "Service Unavailable",
        }[status]
        with contextlib.suppress(OSError):
            client.sendall(
                f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}"
                f"\r\nconnection: close\r\n\r\n".encode()
                + body
            )


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until both directions ended or nothing moved for :data:`IDLE_SECONDS`."""
    peers = {a: b, b: a}
    open_reads = {a, b}
    for sock in peers:
        sock.setblocking(True)
        sock.settimeout(None)
    with selectors.DefaultSelector() as selector:
        for sock in peers:
            selector.register(sock, selectors.EVENT_READ)
        while open_reads:
            ready = selector.select(IDLE_SECONDS)
            if not ready:
                return
            for key, _ in ready:
                source = key.fileobj
                try:
                    data = source.recv(_CHUNK)  # type: ignore[union-attr]
                except OSError:
                    return
                target = peers[source]  # type: ignore[index]
                if data:
                    try:
                        target.sendall(data)
                    except OSError:
                        return
                    continue
                selector.unregister(source)
                open_reads.discard(source)
                with contextlib.suppress(OSError):
                    target.shutdown(socket.SHUT_WR)
