"""Fixtures for the wallet token tests: the public vectors in ``vectors/`` and fixed clocks."""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path

import pytest

#: Copies of the public test vectors, each folder with its licence (see vectors/README.md).
VECTORS = Path(__file__).resolve().parent / "vectors"


def fixed(moment: dt.datetime):
    """A clock that always answers ``moment``."""
    return lambda: moment


@pytest.fixture(scope="session")
def wallet_a_vector() -> dict:
    """The public EC_v1 token, its merchant certificate/key PEM and Apple's root PEM."""
    folder = VECTORS / "wallet-a"
    return {
        "token": json.loads((folder / "token.json").read_text()),
        "certificate": (folder / "certificate.pem").read_bytes(),
        "private_key": (folder / "private_key.pem").read_bytes(),
        "root": (folder / "AppleRootCA-G3.pem").read_bytes(),
        "root_path": str(folder / "AppleRootCA-G3.pem"),
    }


@pytest.fixture(scope="session")
def wallet_b_vectors() -> dict:
    """The public ECv2 vectors (see their ``_notes``)."""
    return json.loads((VECTORS / "wallet-b" / "ecv2-vectors.json").read_text())


def flip(value: str, index: int = -1) -> str:
    """Base64 ``value`` with one bit of its byte at ``index`` flipped."""
    raw = bytearray(base64.b64decode(value))
    raw[index] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


# ---- the HTTP tests' trust anchors --------------------------------------------------------------
# tests/conftest.py points TESSERA_WALLET_A_ROOT_CA and TESSERA_WALLET_B_ROOT_KEYS at these files;
# they are written here, at import, before the API reads them, with a chain valid around today.


def _current_wallet_a_ca():
    from storage.types import utcnow
    from tests.wallets.issuers import INTERMEDIATE_OID, LEAF_OID, WalletACA, certificate

    now = utcnow()
    window = {"not_before": now - dt.timedelta(days=1), "not_after": now + dt.timedelta(days=3650)}
    ca = WalletACA()
    ca.root = certificate("Test Root CA", ca.root_key, ca=True, **window)
    ca.intermediate = certificate(
        "Test Application Integration CA",
        ca.intermediate_key,
        issuer=ca.root,
        issuer_key=ca.root_key,
        ca=True,
        marker=INTERMEDIATE_OID,
        **window,
    )
    ca.leaf = certificate(
        "test-smp-broker-sign",
        ca.leaf_key,
        issuer=ca.intermediate,
        issuer_key=ca.intermediate_key,
        marker=LEAF_OID,
        **window,
    )
    return ca


def _write_anchors():
    import os

    from tests.wallets.issuers import WalletBIssuer, pem

    ca = _current_wallet_a_ca()
    issuer = WalletBIssuer(
        intermediate_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=30),
        root_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=3650),
    )
    root_path, keys_path = os.environ.get("TESSERA_WALLET_A_ROOT_CA"), os.environ.get("TESSERA_WALLET_B_ROOT_KEYS")
    if root_path:
        Path(root_path).write_bytes(pem(ca.root))
    if keys_path:
        Path(keys_path).write_text(json.dumps({"keys": [issuer.root_entry()]}))
    return ca, issuer


#: The chain and the wallet-b issuer the API trusts during the tests.
HTTP_CA, HTTP_ISSUER = _write_anchors()


# ---- domains' association files, served over HTTPS on loopback ----------------------------------


class DomainFiles:
    """The association files the loopback HTTPS server answers: ``served`` maps a domain to its file."""

    def __init__(self) -> None:
        self.served: dict[str, bytes] = {}
        self.requests: list[str] = []


def _tls_identity(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (written where TESSERA_WALLET_A_DOMAIN_CA_CERTS points)
    and its key."""
    import ipaddress
    import os

    from cryptography import x509

    from tests.wallets.issuers import certificate, key_pem, new_key, pem

    key = new_key()
    now = dt.datetime.now(dt.UTC)
    names = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = certificate(
        "127.0.0.1",
        key,
        ca=True,
        extra=(names,),
        not_before=now - dt.timedelta(days=1),
        not_after=now + dt.timedelta(days=30),
    )
    cert_path = Path(os.environ.get("TESSERA_WALLET_A_DOMAIN_CA_CERTS") or folder / "wallet-domains-ca.pem")
    cert_path.write_bytes(pem(cert))
    key_path = cert_path.with_suffix(".key")
    key_path.write_bytes(key_pem(key))
    return cert_path, key_path


@pytest.fixture(scope="session")
def domain_files() -> DomainFiles:
    """An HTTPS server on the port TESSERA_WALLET_A_DOMAIN_FILE_URL names, answering
    ``GET /<domain>/.well-known/apple-developer-merchantid-domain-association`` from ``served``."""
    import ssl
    import tempfile
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.conftest import WALLET_DOMAINS_PORT

    files = DomainFiles()
    cert_path, key_path = _tls_identity(Path(tempfile.mkdtemp()))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            domain, _, rest = self.path.lstrip("/").partition("/")
            files.requests.append(domain)
            body = (
                files.served.get(domain)
                if rest == ".well-known/apple-developer-merchantid-domain-association"
                else None
            )
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", WALLET_DOMAINS_PORT), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield files
    server.shutdown()
