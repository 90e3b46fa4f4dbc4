"""Fuzzing the expression engine (``domain/tokens/expressions.py``) and the proxy's expression parser
(``domain/proxy/detokenize.py``) with hypothesis.

Whatever the template, mask or ``{{ ... }}`` text: the engine answers with a value or refuses with its
typed error (:class:`ExpressionError`; the proxy's :class:`ProxyError`), never another exception; an
output stays within :data:`MAX_OUTPUT_SIZE`; and no error message repeats the token's card number or
CVC (errors name the rule, never the data). ``TESSERA_FUZZ_EXAMPLES`` (default 300) sets the examples
per property; the wallet token parsers are fuzzed in ``tests/wallets/test_fuzz.py``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from domain.proxy.detokenize import parse_expression
from domain.proxy.errors import ProxyError
from domain.tokens.engine import MAX_OUTPUT_SIZE
from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import (
    apply_mask,
    environment,
    evaluate,
    make_context,
    render,
    validate_expression,
    validate_mask,
)

pytestmark = pytest.mark.fuzz

PAN = "4111111111111111"
CVC = "737"
CONTEXT = make_context(
    "card",
    {
        "number": PAN,
        "expiration_month": 4,
        "expiration_year": 2031,
        "cvc": CVC,
        "name": "Ada L",
        "nested": {"list": [1, "two", {"three": 3}]},
    },
    {"customer": "c-1"},
)
FUZZ = settings(
    max_examples=int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

FILTERS = sorted(environment.filters)
FRAGMENTS = st.sampled_from(
    [
        "{{",
        "}}",
        "{%",
        "%}",
        " ",
        "|",
        ":",
        ",",
        "'",
        '"',
        ".",
        "[",
        "]",
        "(",
        ")",
        "..",
        "-",
        "data",
        "data.number",
        "data.cvc",
        "data.nested.list",
        "data.nested.list[2].three",
        "metadata.customer",
        "type",
        "data.nope",
        "for x in",
        "endfor",
        "if",
        "else",
        "endif",
        "unless",
        "endunless",
        "case",
        "when",
        "endcase",
        "assign",
        "capture",
        "endcapture",
        "raw",
        "endraw",
        "comment",
        "endcomment",
        "cycle",
        "increment",
        "tablerow",
        "endtablerow",
        "include",
        "render",
        "limit:",
        "offset:",
        "reversed",
        "(1..5)",
        "(1..999999999)",
        "0",
        "1",
        "-1",
        "99999999999999999999",
        "3.5",
        "true",
        "nil",
        "empty",
        "blank",
        "'$.number'",
        '"$"',
        "'$..*'",
        "'MM/YY'",
        "'*'",
        "x",
        "forloop.index",
        *FILTERS,
    ]
)
TEMPLATES = st.lists(FRAGMENTS, max_size=24).map("".join) | st.text(max_size=200)


def _clean(err: Exception) -> None:
    message = str(err)
    assert PAN not in message and f"'{CVC}'" not in message and f'"{CVC}"' not in message, message


@FUZZ
@given(template=TEMPLATES)
def test_render_and_evaluate_answer_or_refuse_with_expression_error(template):
    assume(PAN not in template and CVC not in template)
    try:
        validate_expression(template)
    except ExpressionError as err:
        _clean(err)
    for run in (render, evaluate):
        try:
            value = run(template, CONTEXT)
        except ExpressionError as err:
            _clean(err)
        else:
            if isinstance(value, str):
                assert len(value) <= MAX_OUTPUT_SIZE


JSON_LEAVES = st.one_of(TEMPLATES, st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False))
MASKS = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(mask=MASKS)
def test_a_mask_is_applied_or_refused_with_expression_error(mask):
    assume(PAN not in repr(mask) and CVC not in repr(mask))
    problems = validate_mask(mask)
    assert isinstance(problems, list) and all(isinstance(p, str) and PAN not in p for p in problems)
    try:
        apply_mask(mask, CONTEXT)
    except ExpressionError as err:
        _clean(err)


INNER = st.lists(
    st.sampled_from(
        [
            "token:",
            "network_token:",
            "token_intent:",
            "encrypted",
            "9f1c0c3e-7d7e-4c41-8d0e-3c8a7a0b9f10",
            "tok_1",
            " ",
            "|",
            ",",
            "json:",
            '"$.number"',
            "'$.data.number'",
            "last4",
            "reveal_last: 4",
            "to_number",
            ":",
            "'",
            '"',
            "{",
            "}",
            "\\n",
            "\\",
            *FILTERS,
        ]
    ),
    max_size=12,
).map("".join) | st.text(max_size=120)


@FUZZ
@given(inner=INNER)
def test_a_proxy_expression_parses_or_is_refused_as_a_proxy_error(inner):
    try:
        expression = parse_expression(inner, where="body")
    except ProxyError as err:
        assert err.status == 400
    else:
        validate_expression(expression.source)  # what the parser accepts, the engine renders
