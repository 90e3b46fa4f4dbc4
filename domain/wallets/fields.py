"""Reading the fields of a wallet token: one place for the shape checks both wallets need.

Every reader raises :class:`~domain.wallets.errors.MalformedToken` (or the error class it is given)
naming the field path, never echoing the value: a token field can hold key material or card data.
Also the card data and clock types both wallets return and take.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, overload

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.hazmat.primitives.serialization import load_der_public_key

from domain.wallets.errors import MalformedToken, PaymentDataInvalid, WalletTokenError
from storage.types import utcnow

#: A clock returning an aware UTC datetime; tests inject a fixed one (defaults to the wall clock).
Clock = Callable[[], dt.datetime]

DEFAULT_CLOCK: Clock = utcnow


def obj(value: object, path: str, error: type[WalletTokenError] = MalformedToken) -> dict:
    """``value`` when it is a JSON object, else ``error`` naming ``path``."""
    if not isinstance(value, dict):
        raise error(f"{path} must be an object")
    return value


@overload
def text(
    container: dict,
    key: str,
    path: str,
    error: type[WalletTokenError] = MalformedToken,
    *,
    optional: Literal[False] = False,
) -> str: ...


@overload
def text(
    container: dict, key: str, path: str, error: type[WalletTokenError] = MalformedToken, *, optional: bool
) -> str | None: ...


def text(
    container: dict, key: str, path: str, error: type[WalletTokenError] = MalformedToken, *, optional: bool = False
) -> str | None:
    """``container[key]`` as a non-empty string (``None`` when ``optional`` and absent, null or empty),
    else ``error``."""
    value = container.get(key)
    if optional and value in (None, ""):
        return None
    if not isinstance(value, str) or not value:
        raise error(f"{path}.{key} must be a non-empty string")
    if not value.isascii():
        try:
            value.encode("utf-8")  # JSON can carry lone surrogates; signed strings are UTF-8 bytes
        except UnicodeEncodeError:
            raise error(f"{path}.{key} is not valid Unicode text") from None
    return value


def b64(value: str, path: str, error: type[WalletTokenError] = MalformedToken) -> bytes:
    """Strict standard base64 (RFC 4648 section 4, padding required) to bytes, else ``error``."""
    try:
        decoded = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise error(f"{path} is not valid base64") from None
    if not decoded:
        raise error(f"{path} is empty")
    return decoded


def hexa(value: str, path: str, error: type[WalletTokenError] = MalformedToken) -> bytes:
    """Hexadecimal text to bytes, else ``error``."""
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise error(f"{path} is not valid hexadecimal") from None


def load_json(raw: str | bytes, path: str, error: type[WalletTokenError] = MalformedToken) -> dict:
    """A JSON object parsed from ``raw`` (text or UTF-8 bytes), else ``error``."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise error(f"{path} is not valid JSON") from None
    return obj(value, path, error)


def p256_public_key(der_or_point: bytes, path: str) -> ec.EllipticCurvePublicKey:
    """A P-256 public key from DER SubjectPublicKeyInfo or an uncompressed X9.62 point, else
    :class:`MalformedToken`. Other curves and key types are refused."""
    key: PublicKeyTypes
    try:
        if der_or_point[:1] == b"\x04":
            key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), der_or_point)
        else:
            key = load_der_public_key(der_or_point)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise MalformedToken(f"{path} is not a valid P-256 public key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise MalformedToken(f"{path} is not a P-256 public key")
    return key


def aware(moment: dt.datetime) -> dt.datetime:
    """``moment`` checked to be timezone-aware (a naive clock is a programming error)."""
    if moment.tzinfo is None:
        raise ValueError("the clock must return an aware datetime")
    return moment


@dataclass(frozen=True)
class CardData:
    """The card inside a wallet token (spec 001 section 2, ``data``): the DPAN/MPAN ``number``,
    ``expiration_month`` (1-12) and four-digit ``expiration_year``. The number is kept out of ``repr``."""

    number: str = field(repr=False)
    expiration_month: int
    expiration_year: int

    def as_dict(self) -> dict:
        """``{number, expiration_month, expiration_year}`` as the resource's ``data`` member."""
        return {
            "number": self.number,
            "expiration_month": self.expiration_month,
            "expiration_year": self.expiration_year,
        }


@dataclass(frozen=True)
class Authentication:
    """The one-time authentication of a network-token payment (spec 001 section 2, ``authentication``):
    the base64 ``threeds_cryptogram`` (kept out of ``repr``) and the ``eci_indicator`` when the network
    sends one."""

    threeds_cryptogram: str = field(repr=False)
    eci_indicator: str | None

    def as_dict(self) -> dict:
        """``{threeds_cryptogram, eci_indicator}`` as the resource's ``authentication`` member."""
        return {"threeds_cryptogram": self.threeds_cryptogram, "eci_indicator": self.eci_indicator}


def card_number(value: object, path: str) -> str:
    """A DPAN/MPAN: 12 to 19 ASCII digits, else :class:`PaymentDataInvalid`."""
    if not isinstance(value, str) or not (12 <= len(value) <= 19) or not (value.isascii() and value.isdigit()):
        raise PaymentDataInvalid(f"{path} must be 12 to 19 digits")
    return value
