"""A destination for the proxy tests: an HTTPS server on loopback with a certificate of its own test
certificate authority (``tests/proxy/certificates.py``), recording every request it receives."""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.conftest import free_port, serve_in_thread
from tests.proxy.certificates import DEST, make_certificates


@dataclass
class Seen:
    """One request the destination received: method, raw path with query, headers (pairs), body, and
    the sender's address and port (``peer``: the same for requests sent on one kept-alive connection)."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    peer: tuple | None = None

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def json(self):
        return json.loads(self.body)


@dataclass
class Upstream:
    """The HTTPS destination. Paths ending in ``/slow`` wait ``slow_seconds``; ``.../status/<n>``
    answers n; ``.../redirect`` answers 302 to ``location``; ``.../answer`` answers ``answer_body`` as
    JSON; anything else answers 201 with ``{"ok": true}`` and the header ``X-Upstream: yes``."""

    ca: Path
    port: int = 0
    received: list[Seen] = field(default_factory=list)
    answer_body: bytes = b'{"card": {"number": "4242424242424242"}, "note": "x"}'
    location: str = "https://metadata.tessera.test/latest/meta-data"
    slow_seconds: float = 3.0

    def base(self, name: str = DEST) -> str:
        return f"https://{name}:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        self.received.append(
            Seen(request.method, request.raw_path, list(request.headers.items()), body, tuple(peer) if peer else None)
        )
        path = request.path
        if path.endswith("/slow"):
            await asyncio.sleep(self.slow_seconds)
        if "/status/" in path:
            return web.Response(
                status=int(path.rsplit("/", 1)[1]), text='{"error": "declined"}', content_type="application/json"
            )
        if path.endswith("/redirect"):
            return web.Response(status=302, headers={"Location": self.location})
        if path.endswith("/answer"):
            return web.Response(status=200, body=self.answer_body, content_type="application/json")
        return web.Response(
            status=201, text='{"ok": true}', content_type="application/json", headers={"X-Upstream": "yes"}
        )


def start_upstream(folder: Path):
    """Serve an :class:`Upstream` in a daemon thread; returns ``(upstream, stop)``."""
    ca, cert, key = make_certificates(folder)
    upstream = Upstream(ca)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream._handle)
    upstream.port = free_port()
    stop = serve_in_thread(lambda: app, upstream.port, ssl_context=context)
    return upstream, stop
