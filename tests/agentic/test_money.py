"""Amounts and the merchant key-set address of allowances, without the stack: exact decimals per
currency, the SSRF rules of the key-set fetch (with private addresses refused, as in production)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from domain.agentic.credentials import key_set_url_errors
from domain.agentic.money import money, parse_money
from infra import http

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "currency", "parsed"),
    [
        ("25.00", "USD", Decimal("25.00")),
        ("25.5", "USD", Decimal("25.5")),
        (12, "JPY", Decimal(12)),
        ("1.234", "BHD", Decimal("1.234")),
        (2.5, "EUR", Decimal("2.5")),
    ],
)
def test_amounts_parse_exactly(value, currency, parsed):
    assert parse_money(value, currency) == (parsed, [])


@pytest.mark.parametrize(
    ("value", "currency"),
    [
        ("1.001", "USD"),
        ("1.5", "JPY"),
        ("0", "USD"),
        ("-1", "USD"),
        ("1e3", "USD"),
        ("NaN", "USD"),
        (True, "USD"),
        ("1" * 16, "USD"),
        (None, "USD"),
        ("abc", "USD"),
    ],
)
def test_bad_amounts_are_refused(value, currency):
    parsed, messages = parse_money(value, currency)
    assert parsed is None and messages


def test_amounts_are_shown_with_the_currency_minor_unit():
    assert money(Decimal("25.5000"), "USD") == {"value": "25.50", "currency": "USD"}
    assert money(Decimal("12.0000"), "JPY") == {"value": "12", "currency": "JPY"}
    assert money(Decimal("1.2340"), "BHD") == {"value": "1.234", "currency": "BHD"}


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/jwks.json",
        "http://10.0.0.7/jwks.json",
        "http://169.254.169.254/latest",
        "http://[::1]/k",
        "http://localhost/jwks.json",
        "ftp://merchant.example/jwks.json",
        "http://user@merchant.example/k",
    ],
)
def test_unsafe_key_set_addresses_are_refused(url):
    assert key_set_url_errors(url, allow_private=False)


def test_a_public_key_set_address_is_taken():
    assert key_set_url_errors("https://merchant.example/.well-known/jwks.json", allow_private=False) == []


def test_the_fetch_refuses_a_host_resolving_to_a_private_address():
    result = http.fetch("http://localhost:9/jwks.json", timeout_s=2, allow_private=False)
    assert result.outcome == "refused"
    assert result.status_code is None
