"""Proxy request rules as pure functions (core document section 4, Proxy rules 3-6)."""

from __future__ import annotations

import pytest

from config.settings import get_settings
from domain.proxy.errors import ProxyError
from domain.proxy.rules import check_destination_base, destination_url, forward_headers, proxy_header_names

NAMES = proxy_header_names("TS")


def test_header_names_follow_the_prefix_setting():
    prefix = get_settings().header_prefix
    names = proxy_header_names(prefix)
    assert names.url == f"{prefix}-PROXY-URL"
    assert names.key_query == f"{prefix.lower()}-proxy-key"
    other = proxy_header_names("ACME")
    assert (other.url, other.keep_alive, other.connection, other.encrypted, other.destination_status) == (
        "ACME-PROXY-URL",
        "ACME-PROXY-KEEP-ALIVE",
        "ACME-PROXY-CONNECTION",
        "ACME-ENCRYPTED",
        "ACME-PROXY-DESTINATION-STATUS",
    )
    assert other.key_query == "acme-proxy-key" and other.own_prefix == "acme-"


def test_destination_composition():
    url = destination_url(
        "https://api.example.com/v1///", "/charges/ch_1", "a=1&ts-proxy-key=secret&b=%20x", key_query=NAMES.key_query
    )
    assert url == "https://api.example.com/v1/charges/ch_1?a=1&b=%20x"
    assert destination_url("https://api.example.com", "", "", key_query=NAMES.key_query) == "https://api.example.com"
    assert destination_url("https://api.example.com:8443/", "/x", "TS-Proxy-Key=k", key_query=NAMES.key_query) == (
        "https://api.example.com:8443/x"
    )
    # the key parameter is recognised percent-encoded too; other parameters keep their bytes
    assert destination_url("https://a.example.com", "/", "ts%2Dproxy%2Dkey=k&q=a+b", key_query=NAMES.key_query) == (
        "https://a.example.com/?q=a+b"
    )


@pytest.mark.parametrize(
    "base",
    [
        "http://api.example.com",
        "ftp://api.example.com",
        "https://127.0.0.1",
        "https://10.1.2.3/path",
        "https://[::1]/",
        "https://[fd00::1]:443",
        "https://127.1",
        "https://2130706433",
        "https://0x7f000001",
        "https://user:pass@api.example.com",
        "https://api.example.com/?a=1",
        "https://api.example.com/#frag",
        "https://bad_host.example.com",
        "",
        "api.example.com",
    ],
)
def test_destination_refusals(base):
    with pytest.raises(ProxyError) as caught:
        check_destination_base(base)
    error = caught.value
    assert error.status == 400
    body = error.body()
    assert set(body) == {"proxy_error"}
    assert set(body["proxy_error"]) == {"errors", "title", "status", "detail"}
    assert body["proxy_error"]["status"] == 400 and body["proxy_error"]["errors"]["destination"]


@pytest.mark.parametrize("base", ["https://localhost", "https://localhost:8443/v1/", "https://gateway"])
def test_one_label_hosts_are_dns_names(base):
    # whether the name may be reached is the SSRF guard's decision on the resolved address
    assert check_destination_base(base) == base.rstrip("/")


@pytest.mark.parametrize(
    "path",
    [
        "/../admin",
        "/a/%2e%2e/b",
        "/./x",
        "noslash",
        "/a\\b",
        "/%2F..%2F..%2Fadmin",
        "/..;/x",
        "/.;a=1/x",
        "/%252e%252e/x",
        "/%25252e%25252e/x",
        "/%2e%2e%3b/x",
        "/a%2fb",
        "/a%5cb",
        "/a%255Cb",
        "/a%250Ab",
        "/%2525252525252e",
    ],
)
def test_paths_with_dot_segments_are_refused(path):
    with pytest.raises(ProxyError) as caught:
        destination_url("https://api.example.com/tenant-a", path, "", key_query=NAMES.key_query)
    assert caught.value.errors == {"path": [caught.value.detail]}


def test_paths_that_stay_below_the_base_are_kept_byte_for_byte():
    for path in ("/a..b/c.d/...x", "/%20x/%3Bq/a;b=1", "/v1/charges/ch_1;x", "/%25"):
        assert destination_url("https://api.example.com/t", path, "", key_query=NAMES.key_query) == (
            "https://api.example.com/t" + path
        )


def test_forwarded_headers():
    incoming = [
        ("Host", "tessera.local"),
        ("TS-API-KEY", "key_caller_secret"),
        ("ts-proxy-url", "https://api.example.com"),
        ("TS-Encrypted", "abc"),
        ("TS-PROXY-KEEP-ALIVE", "timeout=5"),
        ("TS-PROXY-CONNECTION", "keep-alive"),
        ("Connection", "close, X-Hop"),
        ("X-Hop", "1"),
        ("Keep-Alive", "timeout=1"),
        ("Transfer-Encoding", "chunked"),
        ("Proxy-Authorization", "Basic eA=="),
        ("Content-Length", "12"),
        ("Upgrade", "h2c"),
        ("TE", "trailers"),
        ("Authorization", "Bearer destination-token"),
        ("X-Api-Key", "destination-key"),
        ("Accept", "application/json"),
        ("Accept", "text/plain"),
    ]
    out = forward_headers(incoming, NAMES)
    assert out == [
        ("Keep-Alive", "timeout=5"),
        ("Connection", "keep-alive"),
        ("Authorization", "Bearer destination-token"),
        ("X-Api-Key", "destination-key"),
        ("Accept", "application/json"),
        ("Accept", "text/plain"),
    ]
    assert "key_caller_secret" not in repr(out)


def test_header_values_with_line_breaks_are_refused():
    with pytest.raises(ProxyError) as caught:
        forward_headers([("X-A", "a\r\nX-Injected: 1")], NAMES)
    assert caught.value.status == 400 and "headers.X-A" in caught.value.errors
