"""Exact amounts of allowances and credentials: ISO 4217 currencies, parsing and the wire form
(spec 001 sections 3 and 7; the allowance contract is the platform's, see the OpenAPI description of
``POST /agentic/allowances``).

Amounts are ``Decimal`` values stored as ``NUMERIC(19, 4)``: at most 4 decimals (fewer when the
currency's minor unit has fewer) and 15 integer digits.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from babel.numbers import get_currency_precision, list_currencies

MAX_SCALE = 4
MAX_INTEGER_DIGITS = 15
CURRENCIES = frozenset(c for c in list_currencies() if c.isalpha() and len(c) == 3)


def currency_errors(currency: Any) -> list[str]:
    """Messages when ``currency`` is not an ISO 4217 code (upper case)."""
    if not isinstance(currency, str) or currency not in CURRENCIES:
        return ["must be an ISO 4217 currency code, like USD"]
    return []


def parse_money(value: Any, currency: str) -> tuple[Decimal | None, list[str]]:
    """``(Decimal, [])`` for a positive exact amount in ``currency`` (a decimal string, or a JSON
    number read as its shortest decimal), else ``(None, messages)``: at most the currency's minor
    unit digits (USD 2, JPY 0, BHD 3; never more than 4) and 15 integer digits."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None, ['must be a decimal string, like "25.00"']
    text = value.strip() if isinstance(value, str) else repr(value)
    try:
        amount = Decimal(text)
    except InvalidOperation:
        return None, ['must be a decimal string, like "25.00"']
    if not amount.is_finite() or "e" in text.lower():
        return None, ['must be a plain decimal string, like "25.00"']
    if amount <= 0:
        return None, ["must be greater than 0"]
    scale = min(MAX_SCALE, get_currency_precision(currency)) if currency in CURRENCIES else MAX_SCALE
    exponent = amount.as_tuple().exponent  # an int: the amount is finite
    if isinstance(exponent, int) and -exponent > scale:
        return None, [f"{currency} takes at most {scale} decimals"]
    if amount.adjusted() >= MAX_INTEGER_DIGITS:
        return None, [f"must have at most {MAX_INTEGER_DIGITS} integer digits"]
    return amount, []


def money(value: Decimal, currency: str) -> dict[str, str]:
    """``{"value": "25.00", "currency": "USD"}``: exact, with the currency's minor unit digits."""
    scale = min(MAX_SCALE, get_currency_precision(currency))
    quantized = Decimal(value).quantize(Decimal(1).scaleb(-scale))
    return {"value": format(quantized, "f"), "currency": currency}
