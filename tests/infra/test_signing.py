"""Tests for infra.signing (Standard Webhooks)."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from infra.signing import SignatureError, generate_secret, headers, sign, verify

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
SECRET = "whsec_" + base64.b64encode(KEY).decode()
MSG_ID = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
TS = 1_700_000_000
BODY = b'{"type":"token.created","data":{"id":"tok_123"}}'


def _expected(key: bytes, msg_id: str, ts: int, body: bytes) -> str:
    mac = hmac.new(key, msg_id.encode() + b"." + str(ts).encode() + b"." + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def test_generate_secret_shape() -> None:
    s1, s2 = generate_secret(), generate_secret()
    assert s1 != s2
    assert s1.startswith("whsec_")
    assert len(base64.b64decode(s1.removeprefix("whsec_"), validate=True)) == 32


def test_known_answer() -> None:
    assert sign(SECRET, MSG_ID, TS, BODY) == _expected(KEY, MSG_ID, TS, BODY)


def test_known_answer_fixed_vector() -> None:
    # Fixed value, computed once with hmac/hashlib, to catch accidental changes
    # of the signed-content layout.
    value = sign("whsec_" + base64.b64encode(b"k" * 32).decode(), "msg_1", 1, b"{}")
    digest = hmac.new(b"k" * 32, b"msg_1.1.{}", hashlib.sha256).digest()
    assert value == "v1," + base64.b64encode(digest).decode()


def test_headers() -> None:
    h = headers(SECRET, MSG_ID, TS, BODY)
    assert h == {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(TS),
        "webhook-signature": _expected(KEY, MSG_ID, TS, BODY),
    }


def test_verify_accepts_good_signature() -> None:
    verify(SECRET, headers(SECRET, MSG_ID, TS, BODY), BODY, now=TS + 10)


def test_verify_header_names_case_insensitive_and_multiple_signatures() -> None:
    h = headers(SECRET, MSG_ID, TS, BODY)
    other = _expected(b"x" * 32, MSG_ID, TS, BODY)
    received = {
        "Webhook-Id": h["webhook-id"],
        "WEBHOOK-TIMESTAMP": h["webhook-timestamp"],
        "Webhook-Signature": f"v2,abc {other} {h['webhook-signature']}",
    }
    verify(SECRET, received, BODY, now=TS)


def test_verify_rejects_tampered_body() -> None:
    with pytest.raises(SignatureError):
        verify(SECRET, headers(SECRET, MSG_ID, TS, BODY), BODY + b" ", now=TS)


def test_verify_rejects_tampered_id() -> None:
    h = headers(SECRET, MSG_ID, TS, BODY) | {"webhook-id": "msg_other"}
    with pytest.raises(SignatureError):
        verify(SECRET, h, BODY, now=TS)


def test_verify_rejects_wrong_secret() -> None:
    with pytest.raises(SignatureError):
        verify(generate_secret(), headers(SECRET, MSG_ID, TS, BODY), BODY, now=TS)


@pytest.mark.parametrize("skew", [301, -301, 10_000])
def test_verify_rejects_stale_or_future_timestamp(skew: int) -> None:
    with pytest.raises(SignatureError, match="tolerance"):
        verify(SECRET, headers(SECRET, MSG_ID, TS, BODY), BODY, now=TS + skew)


def test_verify_tolerance_is_configurable() -> None:
    verify(SECRET, headers(SECRET, MSG_ID, TS, BODY), BODY, now=TS + 3000, tolerance_s=3600)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_verify_rejects_missing_header(missing: str) -> None:
    h = headers(SECRET, MSG_ID, TS, BODY)
    del h[missing]
    with pytest.raises(SignatureError):
        verify(SECRET, h, BODY, now=TS)


def test_verify_rejects_malformed_timestamp_and_signature() -> None:
    h = headers(SECRET, MSG_ID, TS, BODY)
    with pytest.raises(SignatureError):
        verify(SECRET, h | {"webhook-timestamp": "17e8"}, BODY, now=TS)
    with pytest.raises(SignatureError):
        verify(SECRET, h | {"webhook-signature": "garbage"}, BODY, now=TS)
    with pytest.raises(SignatureError):
        verify(SECRET, h | {"webhook-signature": "v1,ünïcode"}, BODY, now=TS)


def test_verify_uses_wall_clock_by_default() -> None:
    import time

    now = int(time.time())
    verify(SECRET, headers(SECRET, MSG_ID, now, BODY), BODY)


def test_bad_secret_raises_value_error() -> None:
    with pytest.raises(ValueError):
        sign("whsec_!!!not-base64", MSG_ID, TS, BODY)
