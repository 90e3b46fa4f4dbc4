"""Names and certificates of the proxy's test destination, shared by ``tests/proxy`` and
``benchmarks/proxy.py`` (no test settings are imported here).

The destination names (``*.tessera.test``) resolve through :func:`resolve_names`, which patches
``socket.getaddrinfo`` for those names only: the machine's resolver knows no two-label name on
loopback, so name resolution is the one thing simulated; connections, TLS and HTTP are real. The
server certificate also names ``localhost`` (:data:`LOCAL`), which the machine resolves itself: a
newcomer's local HTTPS server.
"""

from __future__ import annotations

import datetime as dt
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

DEST = "dest.tessera.test"
#: Names the tests resolve, to the address each stands for.
NAMES = {
    DEST: "127.0.0.1",
    "internal.tessera.test": "10.0.0.5",
    "metadata.tessera.test": "169.254.169.254",
}
#: A one-label name the machine's own resolver knows (loopback), also named by the certificate.
LOCAL = "localhost"


def resolve_names(monkeypatch=None) -> None:
    """Make the names of :data:`NAMES` resolve to their addresses (every other name as usual), for
    the test (``monkeypatch``) or for the rest of the process (without)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name in NAMES:
            return real(NAMES[name], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    if monkeypatch is None:
        socket.getaddrinfo = getaddrinfo
    else:
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate it signs for the names of :data:`NAMES` and :data:`LOCAL`:
    ``(ca.pem, server.pem, server-key.pem)``."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("Tessera test CA"))
        .issuer_name(_name("Tessera test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(DEST))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in (*NAMES, LOCAL)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths
