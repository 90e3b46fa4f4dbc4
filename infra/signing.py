"""Standard Webhooks signatures (https://www.standardwebhooks.com).

Each delivery carries three headers:

* ``webhook-id``: the message id (stable across retries of the same message),
* ``webhook-timestamp``: integer Unix seconds when the attempt was signed,
* ``webhook-signature``: space-separated list of ``v1,<base64 signature>``,

where the signature is ``HMAC-SHA256(key, f"{id}.{timestamp}.".encode() + body)``
and ``key`` is the base64-decoded part of the ``whsec_...`` secret.

Receivers verify with :func:`verify` (or any Standard Webhooks library):
recompute the signature over the *raw* body bytes, compare in constant time,
and reject timestamps too far from their clock to stop replays.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

__all__ = [
    "SECRET_PREFIX",
    "SignatureError",
    "generate_secret",
    "headers",
    "sign",
    "verify",
]

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret
_SECRET_BYTES = 32


class SignatureError(Exception):
    """A webhook signature could not be verified.

    Raised by :func:`verify` for missing/malformed headers, a timestamp
    outside the tolerance, or no matching signature. The message is short and
    does not contain the secret or the body.
    """


def generate_secret() -> str:
    """Create a new signing secret.

    Returns:
        ``"whsec_"`` followed by the standard base64 encoding of 32 random
        bytes (from :mod:`secrets`), 50 characters in total.
    """
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(_SECRET_BYTES)).decode("ascii")


def _key(secret: str) -> bytes:
    """Decode a ``whsec_`` secret (prefix optional) into raw key bytes."""
    if not isinstance(secret, str):
        raise ValueError("secret must be a str")
    raw = secret[len(SECRET_PREFIX) :] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("secret is not valid base64") from None
    if not key:
        raise ValueError("secret is empty")
    return key


def _signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    to_sign = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, to_sign, hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """Compute the ``webhook-signature`` header value for one message.

    Args:
        secret: ``"whsec_<base64 key>"`` (the prefix is optional).
        msg_id: the message id, as sent in ``webhook-id``.
        timestamp: integer Unix time in seconds, as sent in
            ``webhook-timestamp``.
        body: the exact request body bytes.

    Returns:
        ``"v1,<base64 HMAC-SHA256(key, f'{msg_id}.{timestamp}.' + body)>"``.

    Raises:
        ValueError: if the secret is not valid base64 or is empty.
    """
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise ValueError("timestamp must be an int (Unix seconds)")
    return "v1," + _signature(_key(secret), msg_id, timestamp, bytes(body))


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Build the three Standard Webhooks headers for one delivery.

    Args:
        secret, msg_id, timestamp, body: as for :func:`sign`.

    Returns:
        ``{"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(...)}``.

    Raises:
        ValueError: as for :func:`sign`.
    """
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: int = 300,
    now: float | None = None,
) -> None:
    """Verify a received webhook; return normally if it is authentic.

    Header names are matched case-insensitively. ``webhook-signature`` may
    hold several space-separated ``v<n>,<base64>`` entries (e.g. during secret
    rotation); it is enough that one ``v1`` entry matches. Comparison is
    constant-time.

    Args:
        secret: the endpoint's ``whsec_...`` secret.
        headers: the received request headers (any mapping of str to str).
        body: the raw received body bytes (not re-serialised JSON).
        tolerance_s: maximum allowed distance, in seconds, between
            ``webhook-timestamp`` and ``now`` (past or future).
        now: current Unix time in seconds; defaults to :func:`time.time`.

    Raises:
        SignatureError: a header is missing or malformed, the timestamp is
            outside the tolerance, or no signature matches.
        ValueError: the secret itself is malformed.
    """
    lowered = {str(k).lower(): v for k, v in headers.items()}
    msg_id = lowered.get("webhook-id")
    ts_raw = lowered.get("webhook-timestamp")
    sig_header = lowered.get("webhook-signature")
    if not msg_id or not ts_raw or not sig_header:
        raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature header")
    ts_raw = ts_raw.strip()
    if not ts_raw.isascii() or not ts_raw.isdigit():
        raise SignatureError("invalid webhook-timestamp header")
    timestamp = int(ts_raw)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        raise SignatureError("webhook-timestamp is outside the allowed tolerance")

    expected = _signature(_key(secret), msg_id, timestamp, bytes(body)).encode("ascii")
    matched = False
    for entry in sig_header.split():
        version, sep, value = entry.partition(",")
        if not sep or version != "v1":
            continue
        # Do not short-circuit: compare every candidate in constant time.
        if hmac.compare_digest(expected, value.encode("ascii", "replace")):
            matched = True
    if not matched:
        raise SignatureError("no matching signature")
