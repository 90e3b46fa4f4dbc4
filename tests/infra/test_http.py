"""Tests for infra.http against real local HTTP(S) servers (no mocks).

This machine has no internet access: tests only ever connect to 127.0.0.1.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from infra.addresses import is_public_address, validate_destination_url
from infra.http import USER_AGENT, DeliveryResult, deliver

pytestmark = pytest.mark.unit


class Recorder:
    """Requests seen by the test server (thread-safe append)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self.lock = threading.Lock()

    def add(self, **item: object) -> None:
        with self.lock:
            self.requests.append(item)

    def paths(self) -> list[object]:
        with self.lock:
            return [r["path"] for r in self.requests]


def _make_handler(rec: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _reply(self, status: int, body: bytes = b"ok", extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            rec.add(
                path=self.path,
                method="POST",
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
            )
            path = self.path.split("?", 1)[0]
            if path == "/ok":
                self._reply(200, b'{"received":true}')
            elif path == "/fail":
                self._reply(500, b"boom")
            elif path == "/missing":
                self._reply(404, b"nope")
            elif path == "/ratelimited":
                self._reply(429, b"slow down", {"Retry-After": "17"})
            elif path == "/unavailable-date":
                self._reply(503, b"", {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
            elif path == "/redirect":
                self._reply(302, b"", {"Location": "/target"})
            elif path == "/target":
                self._reply(200)
            elif path == "/slow":
                time.sleep(1.5)
                try:
                    self._reply(200)
                except OSError:
                    pass
            elif path == "/huge":
                chunk = b"x" * 65536
                total = 8 * 1024 * 1024
                self.send_response(200)
                self.send_header("Content-Length", str(total))
                self.end_headers()
                try:
                    for _ in range(total // len(chunk)):
                        self.wfile.write(chunk)
                except OSError:
                    pass
            elif path == "/drip":
                # Sends a valid status line, then one header byte at a time,
                # each gap shorter than the per-read timeout.
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    self.wfile.flush()
                    for b in b"X-Slow: " + b"a" * 40:
                        time.sleep(0.2)
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                except OSError:
                    pass
                self.close_connection = True
            else:
                self._reply(200)

    return Handler


class Server:
    def __init__(self, httpd: ThreadingHTTPServer, rec: Recorder) -> None:
        self.httpd = httpd
        self.rec = rec
        self.port = httpd.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def _serve(httpd: ThreadingHTTPServer) -> Iterator[None]:
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture
def server() -> Iterator[Server]:
    rec = Recorder()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(rec))
    httpd.daemon_threads = True
    for _ in _serve(httpd):
        yield Server(httpd, rec)


def _free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def post(url: str, *, timeout_s: float = 5.0, allow_private: bool = True, **kw: object) -> DeliveryResult:
    return deliver(
        url,
        b'{"type":"ping"}',
        {"webhook-id": "msg_1", "x-secret-ish": "s3cr3t"},
        timeout_s=timeout_s,
        allow_private=allow_private,
        **kw,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- outcomes


def test_success_200(server: Server) -> None:
    result = post(server.url("/ok?a=1"))
    assert result.outcome == "success"
    assert result.status_code == 200
    assert result.error is None
    assert result.transient is False
    assert result.retry_after_s is None
    assert isinstance(result.duration_ms, int) and 0 <= result.duration_ms < 5000
    assert result.response_body == b'{"received":true}'
    [req] = server.rec.requests
    assert req["path"] == "/ok?a=1"
    assert req["body"] == b'{"type":"ping"}'
    headers = req["headers"]
    assert isinstance(headers, dict)
    assert headers["content-type"] == "application/json"
    assert headers["user-agent"] == USER_AGENT == "Tessera-Webhooks/1"
    assert headers["webhook-id"] == "msg_1"
    assert headers["content-length"] == str(len(b'{"type":"ping"}'))


def test_500_is_transient(server: Server) -> None:
    result = post(server.url("/fail"))
    assert (result.outcome, result.status_code, result.transient) == ("http_error", 500, True)
    assert result.error == "HTTP 500"


def test_404_is_permanent(server: Server) -> None:
    result = post(server.url("/missing"))
    assert (result.outcome, result.status_code, result.transient) == ("http_error", 404, False)


def test_429_retry_after_seconds(server: Server) -> None:
    result = post(server.url("/ratelimited"))
    assert (result.outcome, result.status_code, result.transient) == ("http_error", 429, True)
    assert result.retry_after_s == 17


def test_503_retry_after_http_date_is_ignored(server: Server) -> None:
    result = post(server.url("/unavailable-date"))
    assert (result.status_code, result.transient, result.retry_after_s) == (503, True, None)


def test_redirect_is_not_followed(server: Server) -> None:
    result = post(server.url("/redirect"))
    assert result.outcome == "http_error"
    assert result.status_code == 302
    assert result.transient is False
    assert server.rec.paths() == ["/redirect"]
    assert "/target" not in server.rec.paths()


def test_read_timeout(server: Server) -> None:
    started = time.monotonic()
    result = post(server.url("/slow"), timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert result.outcome == "timeout"
    assert result.status_code is None
    assert result.transient is True
    assert elapsed < 1.4


def test_total_time_is_bounded_against_dripping_server(server: Server) -> None:
    # Every byte arrives within the 0.5 s read timeout, but the whole answer
    # would take ~8 s: the total budget (3 x timeout) must cut it off.
    started = time.monotonic()
    result = post(server.url("/drip"), timeout_s=0.5)
    elapsed = time.monotonic() - started
    assert result.outcome == "timeout"
    assert result.transient is True
    assert elapsed < 3.0


def test_connection_refused_on_closed_port() -> None:
    result = post(f"http://127.0.0.1:{_free_port()}/", timeout_s=2)
    assert result.outcome == "connection_error"
    assert result.status_code is None
    assert result.transient is True
    assert result.error == "connection refused"


def test_loopback_refused_when_private_not_allowed(server: Server) -> None:
    for host in ("127.0.0.1", "localhost"):
        result = post(server.url("/ok", host=host), allow_private=False)
        assert result.outcome == "refused"
        assert result.transient is False
        assert result.status_code is None
        assert result.error is not None and "not public" in result.error
    assert server.rec.requests == []


def test_loopback_allowed_when_private_allowed(server: Server) -> None:
    assert post(server.url("/ok"), allow_private=True).outcome == "success"


def test_response_read_only_up_to_cap(server: Server) -> None:
    started = time.monotonic()
    result = post(server.url("/huge"), max_response_bytes=1000)
    assert result.outcome == "success"
    assert result.response_body == b"x" * 1000
    assert time.monotonic() - started < 4
    result = post(server.url("/huge"), max_response_bytes=0)
    assert result.status_code == 200 and result.response_body == b""


def test_host_header_is_url_host_and_port(server: Server) -> None:
    post(server.url("/ok"))
    post(server.url("/ok", host="localhost"))
    hosts = [r["headers"]["host"] for r in server.rec.requests]  # type: ignore[index]
    assert hosts == [f"127.0.0.1:{server.port}", f"localhost:{server.port}"]


def test_caller_cannot_override_host_or_user_agent(server: Server) -> None:
    deliver(
        server.url("/ok"),
        b"{}",
        {"Host": "evil.example", "User-Agent": "x", "Content-Type": "application/cloudevents+json"},
        timeout_s=5,
        allow_private=True,
    )
    [req] = server.rec.requests
    headers = req["headers"]
    assert isinstance(headers, dict)
    assert headers["host"] == f"127.0.0.1:{server.port}"
    assert headers["user-agent"] == USER_AGENT
    assert headers["content-type"] == "application/cloudevents+json"


def test_errors_do_not_echo_request_material(server: Server) -> None:
    for result in (
        post(server.url("/slow?token=abc"), timeout_s=0.3),
        post(f"http://127.0.0.1:{_free_port()}/hook?token=abc"),
        post(server.url("/fail?token=abc")),
        post(server.url("/ok?token=abc"), allow_private=False),
    ):
        assert result.error is not None
        for secret in ("token", "abc", "s3cr3t", "ping", "msg_1"):
            assert secret not in result.error


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1/x",
        "http://user:pw@127.0.0.1/",
        "http://user@127.0.0.1/",
        "http:///nohost",
        "http://127.0.0.1:99999/",
        "file:///etc/passwd",
    ],
)
def test_bad_urls_refused_without_connecting(url: str) -> None:
    result = post(url)
    assert result.outcome == "refused"
    assert result.transient is False


def test_unresolvable_host_is_connection_error() -> None:
    result = post("http://does-not-exist.invalid/", timeout_s=3)
    assert result.outcome in ("connection_error", "timeout")
    assert result.transient is True


# ------------------------------------------------------------ address table


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("172.31.255.255", False),
        ("192.168.1.1", False),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("100.127.255.254", False),
        ("0.0.0.0", False),  # noqa: S104 - an address under test, not a bind
        ("224.0.0.1", False),
        ("255.255.255.255", False),
        ("198.18.0.1", False),
        ("192.0.2.1", False),
        ("::", False),
        ("::1", False),
        ("fc00::1", False),
        ("fd12:3456::1", False),
        ("fe80::1", False),
        ("fe80::1%1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("2002:a00:1::1", False),  # 6to4 of 10.0.0.1
        ("2001:0:4136:e378::1", False),  # Teredo
        ("2001:db8::1", False),
        ("::127.0.0.1", False),  # IPv4-compatible (deprecated)
        ("8.8.8.8", True),
        ("1.1.1.1", True),
        ("100.128.0.1", True),
        ("2606:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
    ],
)
def test_is_public_address(address: str, public: bool) -> None:
    assert is_public_address(ipaddress.ip_address(address)) is public


def test_is_public_address_rejects_non_address() -> None:
    with pytest.raises(TypeError):
        is_public_address("8.8.8.8")  # type: ignore[arg-type]


# ----------------------------------------------------- form-only validation


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/tessera",
        "http://example.com:8080/a?b=c",
        "https://[2606:4700::1111]/x",
        "https://bücher.example/hook",
        "https://not-yet-registered.example/hook",
    ],
)
def test_validate_destination_url_accepts(url: str) -> None:
    assert validate_destination_url(url) is None


@pytest.mark.parametrize(
    "url",
    [
        "",
        "example.com/hook",
        "ftp://example.com/",
        "javascript:alert(1)",
        "https://user:pass@example.com/",
        "https://@example.com/",
        "https:///path",
        "https://example.com:0/",
        "https://example.com:70000/",
        "https://exa mple.com/",
        "https://example.com/\r\nX: y",
        "https://example.com/" + "a" * 2048,
    ],
)
def test_validate_destination_url_rejects(url: str) -> None:
    error = validate_destination_url(url)
    assert isinstance(error, str) and error


def test_validate_destination_url_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dns(*args: object, **kwargs: object) -> None:
        raise AssertionError("validate_destination_url must not resolve DNS")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert validate_destination_url("https://hooks.example.com/x") is None


# --------------------------------------------------------------------- HTTPS


def _make_cert(tmp_path: Path) -> tuple[Path, Path]:
    """Self-signed certificate for DNS name ``localhost`` (and no IP SAN)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path = tmp_path / "cert.pem"
    key_path = tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class TLSServer(Server):
    sni: list[str | None]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TLSServer]:
    cert_path, key_path = _make_cert(tmp_path)
    rec = Recorder()
    sni: list[str | None] = []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_path, key_path)

    def on_sni(sslobj: ssl.SSLObject, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        sni.append(server_name)

    ctx.sni_callback = on_sni  # type: ignore[assignment]

    class TLSHTTPServer(ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self) -> tuple[socket.socket, object]:
            sock, addr = super().get_request()
            sock.settimeout(5)
            try:
                return ctx.wrap_socket(sock, server_side=True), addr
            except (ssl.SSLError, OSError):
                sock.close()
                raise

    httpd = TLSHTTPServer(("127.0.0.1", 0), _make_handler(rec))
    for _ in _serve(httpd):
        srv = TLSServer(httpd, rec)
        srv.sni = sni
        srv.ca = str(cert_path)  # type: ignore[attr-defined]
        yield srv


def test_https_pinned_ip_with_sni_and_verification(tls_server: TLSServer, monkeypatch: pytest.MonkeyPatch) -> None:
    lookups: list[object] = []
    real_getaddrinfo: Callable[..., object] = socket.getaddrinfo

    def spy(host: object, *args: object, **kwargs: object) -> object:
        lookups.append(host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    result = deliver(
        tls_server.url("/ok", host="localhost", scheme="https"),
        b"{}",
        {},
        timeout_s=5,
        allow_private=True,
        ca_certs=tls_server.ca,  # type: ignore[attr-defined]
    )
    assert result.outcome == "success", result.error
    assert tls_server.sni == ["localhost"]
    [req] = tls_server.rec.requests
    assert req["headers"]["host"] == f"localhost:{tls_server.port}"  # type: ignore[index]
    # The name was resolved exactly once; the connection used the vetted IP
    # literal (a numeric lookup inside socket.create_connection is not DNS).
    names = [h for h in lookups if h == "localhost"]
    assert names == ["localhost"]
    for host in lookups:
        if host != "localhost":
            ipaddress.ip_address(host)  # raises if anything else was resolved


def test_https_certificate_must_match_url_host(tls_server: TLSServer) -> None:
    # The certificate is for "localhost" only; 127.0.0.1 must not verify.
    result = deliver(
        tls_server.url("/ok", host="127.0.0.1", scheme="https"),
        b"{}",
        {},
        timeout_s=5,
        allow_private=True,
        ca_certs=tls_server.ca,  # type: ignore[attr-defined]
    )
    assert result.outcome == "connection_error"
    assert result.error is not None and "TLS" in result.error
    assert tls_server.rec.requests == []


def test_https_untrusted_certificate_fails(tls_server: TLSServer) -> None:
    result = deliver(
        tls_server.url("/ok", host="localhost", scheme="https"),
        b"{}",
        {},
        timeout_s=5,
        allow_private=True,
    )
    assert result.outcome == "connection_error"
    assert result.error is not None and "certificate" in result.error
    assert tls_server.rec.requests == []
