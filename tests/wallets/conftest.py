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
