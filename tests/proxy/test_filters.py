"""The filters proxy expressions use, one test each (python-liquid, domain.tokens.expressions)."""

from __future__ import annotations

import pytest

from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import evaluate, render

CARD = {"number": "4242424242424242", "expiration_month": 3, "expiration_year": 2029, "cvc": "123"}


def ev(source: str, value):
    return evaluate(source, {"value": value})


def test_last4():
    assert ev("{{ value | json: '$.number' | last4 }}", CARD) == "4242"
    assert ev("{{ value | last4 }}", "12") == "12"
    assert ev("{{ value | last4 }}", 123456) == "3456"


def test_reveal_last():
    assert ev("{{ value | json: '$.number' | reveal_last: 4 }}", CARD) == "XXXXXXXXXXXX4242"
    assert ev("{{ value | reveal_last: 2, '*' }}", "12345") == "***45"


def test_card_bin():
    assert ev("{{ value | json: '$.number' | card_bin }}", CARD) == "424242"
    assert ev("{{ value | card_bin: 8 }}", "4242 4242 4242 4242") == "42424242"
    with pytest.raises(ExpressionError, match="card_bin"):
        ev("{{ value | card_bin: 0 }}", "4242")


def test_card_exp():
    assert ev("{{ value | card_exp }}", CARD) == "03/29"
    assert ev("{{ value | card_exp: 'MMYYYY' }}", CARD) == "032029"
    assert ev("{{ value | card_exp: 'YY-M' }}", {"data": CARD}) == "29-3"  # a token object
    with pytest.raises(ExpressionError, match="card_exp"):
        ev("{{ value | card_exp }}", {"number": "4242"})


def test_json():
    assert ev("{{ value | json: '$.expiration_month' }}", CARD) == 3
    assert ev("{{ value | json: \"$['number']\" }}", CARD) == CARD["number"]
    assert ev("{{ value | json: '$.missing' }}", CARD) is None
    with pytest.raises(ExpressionError, match="singular"):
        ev("{{ value | json: '$..number' }}", CARD)


def test_to_string():
    assert ev("{{ value | json: '$.expiration_month' | to_string }}", CARD) == "3"
    assert ev("{{ value | to_string }}", {"b": 1, "a": [True, None]}) == '{"a":[true,null],"b":1}'


def test_to_number():
    assert ev("{{ value | to_number }}", "12") == 12
    assert ev("{{ value | to_number }}", " 12.50 ") == 12.5
    assert ev("{{ value | to_number }}", 7) == 7
    for bad in ("12abc", "nan", "1e999"):
        with pytest.raises(ExpressionError, match="to_number"):
            ev("{{ value | to_number }}", bad)


def test_pad_left():
    assert ev("{{ value | pad_left: 5, '0' }}", 42) == "00042"
    assert ev("{{ value | pad_left: 2 }}", "abc") == "abc"
    with pytest.raises(ExpressionError, match="pad_left"):
        ev("{{ value | pad_left: 5, 'ab' }}", "x")


def test_pad_right():
    assert ev("{{ value | pad_right: 5, 'x' }}", "42") == "42xxx"
    assert ev("{{ value | pad_right: 4 }}", "ab") == "ab  "
    with pytest.raises(ExpressionError, match="width"):
        ev("{{ value | pad_right: 99999999 }}", "x")


def test_to_base64():
    assert ev("{{ value | to_base64 }}", "user:pass") == "dXNlcjpwYXNz"
    assert ev("{{ value | to_base64 }}", {"a": 1}) == "eyJhIjoxfQ=="
    assert render("{{ value | json: '$.number' | to_base64 }}", {"value": CARD}) == "NDI0MjQyNDI0MjQyNDI0Mg=="


def test_evaluate_keeps_types_and_refuses_templates():
    assert ev("{{ value }}", CARD) == CARD
    with pytest.raises(ExpressionError, match="exactly one"):
        ev("a {{ value }}", CARD)
    with pytest.raises(ExpressionError):
        evaluate("{{ nothing }}", {})
