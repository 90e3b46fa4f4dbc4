"""Malformed input never makes a 500: each kind is answered with a 4xx problem and changes nothing
(core document section 7: errors are RFC 7807 problems; bad input changes nothing)."""

from __future__ import annotations

import http.client
import urllib.parse

import pytest

from tests.helpers import assert_problem

pytestmark = pytest.mark.api

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


def _token_count(tenant) -> int:
    """How many tokens the tenant has (the list walks every page)."""
    count, start = 0, None
    while True:
        answer = tenant.client.get("/v2/tokens?size=100" + (f"&start={start}" if start else ""))
        assert answer.status == 200, answer
        count += len(answer.json["data"])
        start = answer.json["pagination"].get("next")
        if not start:
            return count


def _raw_request(api, method: str, target: str, headers: dict[str, bytes | str], body: bytes = b"") -> tuple:
    """Send bytes as they are (no client-side quoting or header encoding); returns (status, body, headers)."""
    parsed = urllib.parse.urlsplit(api.base_url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        answer = connection.getresponse()
        return answer.status, answer.read(), answer.headers
    finally:
        connection.close()


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"[" * 5000 + b"]" * 5000, id="deep-array"),
        pytest.param(b'{"type":"token","data":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}", id="deep-object"),
        pytest.param(b'{"type":"token","data":' + b"9" * 5000 + b"}", id="huge-integer"),
        pytest.param(b'{"type":"token","data":"\\ud800"}', id="lone-high-surrogate"),
        pytest.param(b'{"type":"token","data":"a\\udc00b"}', id="lone-low-surrogate"),
    ],
)
@pytest.mark.parametrize("path", ["/tokenize", "/tokens"])
def test_malformed_json_is_400_and_writes_nothing(api, tenant, raw, path):
    before = _token_count(tenant)
    body = assert_problem(tenant.client.post(path, raw=raw), 400)
    assert body["status"] == 400
    assert _token_count(tenant) == before


def test_malformed_json_on_a_model_body_is_400(api, tenant):
    for raw in (
        b'{"name":"' + b"\\ud800" + b'","type":"public"}',
        b'{"name":' + b"7" * 5000 + b"}",
        b'{"name":' + b"[" * 4000 + b"]" * 4000 + b"}",
    ):
        assert_problem(tenant.client.post("/applications", raw=raw), 400)


def test_nul_in_a_path_segment_is_a_4xx(api, tenant):
    for target in (
        "/tokens/abc%00def",
        "/applications/%00",
        "/agentic/payment-methods/pm_%00",
        "/webhooks/%00/deliveries",
    ):
        answer = tenant.client.get(target)
        assert answer.status in (400, 404), (target, answer)
        assert_problem(answer, answer.status)
    answer = tenant.client.patch("/tokens/a%00b", {"metadata": {}}, content_type="application/merge-patch+json")
    assert answer.status in (400, 404), answer
    assert_problem(answer, answer.status)


@pytest.mark.parametrize(
    "target",
    [
        "/v2/tokens?metadata.k=a%00b",
        "/v2/tokens?type=card%00",
        "/applications?page=1%00",
        "/logs?entity_id=%00",
        "/agentic/payment-methods?consumer_id=%00",
        "/v2/tokens?start=%00",
    ],
)
def test_nul_in_a_query_value_is_400(api, tenant, target):
    assert_problem(tenant.client.get(target), 400)


def test_api_key_that_is_not_utf8_is_401(api, tenant):
    status, raw, headers = _raw_request(api, "GET", "/applications", {"TS-API-KEY": b"key_\xff\xfe\xc3("})
    assert status == 401, raw
    assert headers["Content-Type"].startswith("application/problem+json")


@pytest.mark.parametrize(
    "cursor",
    [
        "not-a-cursor",
        "eyJ0IjoiMjAyNi0wMS0wMSIsImlkIjoieCJ9",  # {"t":"2026-01-01","id":"x"}: our shape, unsigned
        "eyJ0IjoiYSIsImlkIjoxfQ",  # {"t":"a","id":1}
        "%FF%FE",
        "A" * 5000,
    ],
)
@pytest.mark.parametrize(
    "path", ["/v2/tokens", "/agentic/payment-methods", "/webhooks/00000000-0000-0000-0000-000000000000/deliveries"]
)
def test_forged_cursor_is_400(api, tenant, cursor, path):
    answer = tenant.client.get(f"{path}?start={cursor}")
    if path.startswith("/webhooks/") and answer.status == 404:
        return  # the webhook does not exist: the path is checked before the cursor
    body = assert_problem(answer, 400)
    assert "start" in str(body.get("errors") or body), body


def test_forged_cursor_in_a_search_body_is_400(api, tenant):
    body = assert_problem(tenant.client.post("/v2/tokens/search", {"query": "id:x", "start": "eyJ0IjoxfQ"}), 400)
    assert "start" in body["errors"]


def _multipart(boundary: bytes, parts: list[tuple[bytes, bytes]]) -> bytes:
    out = b""
    for disposition, content in parts:
        out += b"--" + boundary + b"\r\n" + disposition + b"\r\n\r\n" + content + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        pytest.param("multipart/form-data; boundary=abc", b"--zzz\r\nbroken\r\n\r\n", id="wrong-boundary"),
        pytest.param("multipart/form-data", b"--abc\r\n\r\nx\r\n--abc--\r\n", id="no-boundary"),
        pytest.param(
            "multipart/form-data; boundary=abc",
            b'--abc\r\nContent-Disposition: form-data; name="document"\r\n\r\nunterminated',
            id="unterminated",
        ),
        pytest.param(
            "multipart/form-data; boundary=abc",
            _multipart(b"abc", [(b'Content-Disposition: form-data; name="document"; filename="a\x00b.txt"', b"hello")]),
            id="nul-in-filename",
        ),
        pytest.param(
            "multipart/form-data; boundary=abc",
            _multipart(b"abc", [(b'Content-Disposition: form-data; name="docu\x00ment"', b"hello")]),
            id="nul-in-name",
        ),
        pytest.param(
            "multipart/form-data; boundary=abc",
            _multipart(b"abc", [(b'Content-Disposition: form-data; name="document"; filename="\xff\xfe"', b"hello")]),
            id="non-utf8-filename",
        ),
        pytest.param("multipart/form-data; boundary=" + "b" * 200, b"--" + b"b" * 200 + b"\r\n", id="long-boundary"),
    ],
)
def test_malformed_multipart_is_400_and_stores_nothing(api, tenant, content_type, body):
    before = tenant.client.get("/documents").json
    answer = tenant.client.post("/documents", raw=body, content_type=content_type)
    assert 400 <= answer.status < 500, answer
    assert_problem(answer, answer.status)
    assert tenant.client.get("/documents").json == before
