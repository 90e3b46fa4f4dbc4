"""A destination for the proxy tests: an HTTPS server on loopback with a certificate of its own test
certificate authority, recording every request it receives.

The destination names (``*.tessera.test``) resolve through :func:`resolve_names`, which patches
``socket.getaddrinfo`` for those names only: the machine's resolver knows no two-label name on
loopback and the proxy refuses single-label hosts (Proxy rule 5), so name resolution is the one
thing simulated; connections, TLS and HTTP are real.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.conftest import free_port, serve_in_thread

DEST = "dest.tessera.test"
#: Names the tests resolve, to the address each stands for.
NAMES = {
    DEST: "127.0.0.1",
    "internal.tessera.test": "10.0.0.5",
    "metadata.tessera.test": "169.254.169.254",
}


def resolve_names(monkeypatch) -> None:
    """Make the names of :data:`NAMES` resolve to their addresses (every other name as usual)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name in NAMES:
            return real(NAMES[name], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate it signs for the names of :data:`NAMES`:
    ``(ca.pem, server.pem, server-key.pem)``."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("Tessera test CA")).issuer_name(_name("Tessera test CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder().subject_name(_name(DEST)).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


@dataclass
class Seen:
    """One request the destination received: method, raw path with query, headers (pairs), body."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

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
        self.received.append(Seen(request.method, request.raw_path, list(request.headers.items()), body))
        path = request.path
        if path.endswith("/slow"):
            await asyncio.sleep(self.slow_seconds)
        if "/status/" in path:
            return web.Response(status=int(path.rsplit("/", 1)[1]), text='{"error": "declined"}',
                                content_type="application/json")
        if path.endswith("/redirect"):
            return web.Response(status=302, headers={"Location": self.location})
        if path.endswith("/answer"):
            return web.Response(status=200, body=self.answer_body, content_type="application/json")
        return web.Response(status=201, text='{"ok": true}', content_type="application/json",
                            headers={"X-Upstream": "yes"})


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
