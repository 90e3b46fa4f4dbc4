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
    ca.intermediate = certificate("Test Application Integration CA", ca.intermediate_key, issuer=ca.root,
                                  issuer_key=ca.root_key, ca=True, marker=INTERMEDIATE_OID, **window)
    ca.leaf = certificate("test-smp-broker-sign", ca.leaf_key, issuer=ca.intermediate,
                          issuer_key=ca.intermediate_key, marker=LEAF_OID, **window)
    return ca


def _write_anchors():
    import os

    from tests.wallets.issuers import WalletBIssuer, pem

    ca = _current_wallet_a_ca()
    issuer = WalletBIssuer(intermediate_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=30),
                           root_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(days=3650))
    root_path, keys_path = os.environ.get("TESSERA_WALLET_A_ROOT_CA"), os.environ.get("TESSERA_WALLET_B_ROOT_KEYS")
    if root_path:
        Path(root_path).write_bytes(pem(ca.root))
    if keys_path:
        Path(keys_path).write_text(json.dumps({"keys": [issuer.root_entry()]}))
    return ca, issuer


#: The chain and the wallet-b issuer the API trusts during the tests.
HTTP_CA, HTTP_ISSUER = _write_anchors()
