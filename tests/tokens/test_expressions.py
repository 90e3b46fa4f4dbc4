"""Unit tests for domain.tokens.expressions: the Liquid expression engine, its filters, masks and limits."""

from __future__ import annotations

import pytest

from domain.tokens import expressions
from domain.tokens.engine import MAX_LOOP_ITERATIONS, MAX_OUTPUT_SIZE
from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import (
    MAX_TEMPLATE_LENGTH,
    apply_mask,
    make_context,
    render,
    validate_expression,
    validate_mask,
)

pytestmark = pytest.mark.unit

VISA = "4242424242424242"


@pytest.fixture
def ctx():
    return make_context(
        "card",
        {
            "number": VISA,
            "expiration_month": 4,
            "expiration_year": 2030,
            "cvc": "123",
            "verified": True,
            "ratio": 0.5,
            "nothing": None,
            "blank_text": "",
            "nested": {"items": [1, {"b": "x"}], "key with space": "s"},
        },
        {"customer": "c-1"},
    )


def r(template, context):
    return render(template, context)


# --- context and plain rendering ----------------------------------------------------------------


def test_make_context():
    assert make_context("bank", {"a": 1}) == {"data": {"a": 1}, "metadata": {}, "type": "bank"}
    assert make_context("card", 1, {"k": "v"})["metadata"] == {"k": "v"}


def test_render_variables(ctx):
    assert r("{{ data.number }}", ctx) == VISA
    assert r("{{ type }}:{{ metadata.customer }}", ctx) == "card:c-1"
    assert r("{{ data.nested.items[1].b }}", ctx) == "x"
    assert r("plain text", ctx) == "plain text"
    assert r("{{ data.number | slice: 0, 6 }}", ctx) == "424242"


def test_error_is_a_value_error():
    assert issubclass(ExpressionError, ValueError)


# --- strict undefined ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "{{ data.missing }}",
        "{{ missing }}",
        "{{ data.missing.deeper }}",
        "{{ data.missing | upcase }}",
        "{{ data.missing | reveal_last: 4 }}",
        "{{ data.number | append: data.missing }}",
        "{{ data.nested.items[9] }}",
        "{{ data.missing | size }}",
    ],
)
def test_undefined_is_an_error(ctx, template):
    with pytest.raises(ExpressionError):
        r(template, ctx)


def test_undefined_message_names_the_variable(ctx):
    with pytest.raises(ExpressionError, match=r"data\.missing is undefined"):
        r("{{ data.missing }}", ctx)


def test_undefined_can_be_tested_and_defaulted(ctx):
    assert r("{% if data.missing %}yes{% else %}no{% endif %}", ctx) == "no"
    assert r("{% unless data.missing %}absent{% endunless %}", ctx) == "absent"
    assert r("{{ data.missing | default: 'n/a' }}", ctx) == "n/a"
    assert r("{{ data.nothing }}", ctx) == ""  # a null value is defined


# --- syntax, unknown filters, forbidden tags, template length ------------------------------------


@pytest.mark.parametrize(
    "template",
    ["{{ data.number", "{% if data.number %}x", "{{ data.number | }}", "{% endif %}", "{{ data..number }}"],
)
def test_syntax_errors(ctx, template):
    with pytest.raises(ExpressionError, match="invalid expression"):
        validate_expression(template)
    with pytest.raises(ExpressionError):
        r(template, ctx)


def test_syntax_error_message_is_one_readable_line():
    with pytest.raises(ExpressionError) as info:
        validate_expression("{{ data.number")
    message = str(info.value)
    assert "\n" not in message
    assert "line 1" in message


def test_unknown_filter_is_found_when_validating_even_in_a_dead_branch():
    with pytest.raises(ExpressionError, match="unknown filter 'nope'"):
        validate_expression("{{ data.number | nope }}")
    with pytest.raises(ExpressionError, match="unknown filter 'nope'"):
        validate_expression("{% if false %}{{ data.number | nope }}{% endif %}")


@pytest.mark.parametrize(
    "template",
    [
        "{% include 'other' %}",
        "{% render 'other' %}",
        "{% extends 'base' %}",
        "{% block b %}{% endblock %}",
        "{% liquid include 'other' %}",
    ],
)
def test_includes_and_inheritance_are_not_available(template):
    with pytest.raises(ExpressionError):
        validate_expression(template)


def test_valid_expressions_pass_validation():
    validate_expression("{{ data.number | card_mask }}")
    validate_expression("{% for x in data.items %}{{ x | digits }}{% endfor %}")
    validate_expression("")


def test_template_length_limit(ctx):
    validate_expression("x" * MAX_TEMPLATE_LENGTH)
    with pytest.raises(ExpressionError, match="limit"):
        validate_expression("x" * (MAX_TEMPLATE_LENGTH + 1))
    with pytest.raises(ExpressionError):
        r("x" * (MAX_TEMPLATE_LENGTH + 1), ctx)


@pytest.mark.parametrize("template", [None, 42, ["{{ data }}"]])
def test_non_string_expression(template):
    with pytest.raises(ExpressionError, match="must be a string"):
        validate_expression(template)


def test_context_must_be_a_mapping():
    with pytest.raises(ExpressionError):
        render("x", ["not", "a", "mapping"])


# --- limits -------------------------------------------------------------------------------------


def test_output_limit(ctx):
    assert len(r("{{ data }}", {"data": "x" * MAX_OUTPUT_SIZE})) == MAX_OUTPUT_SIZE
    with pytest.raises(ExpressionError, match="limit"):
        r("{{ data }}", {"data": "x" * (MAX_OUTPUT_SIZE + 1)})
    with pytest.raises(ExpressionError, match="limit"):
        r("{{ data }}{{ data }}", {"data": "x" * (MAX_OUTPUT_SIZE // 2 + 1)})


def test_loop_iteration_limit(ctx):
    assert r(f"{{% for i in (1..{MAX_LOOP_ITERATIONS}) %}}{{% endfor %}}", ctx) == ""
    with pytest.raises(ExpressionError, match="loop iteration limit"):
        r(f"{{% for i in (1..{MAX_LOOP_ITERATIONS + 1}) %}}x{{% endfor %}}", ctx)
    with pytest.raises(ExpressionError, match="loop iteration limit"):
        r("{% for i in (1..1000) %}{% for j in (1..1000) %}{% endfor %}{% endfor %}", ctx)


def test_range_expansion_in_filters_is_limited(ctx):
    assert r("{{ (1..3) | join: ',' }}", ctx) == "1,2,3"
    with pytest.raises(ExpressionError, match="range"):
        r("{{ (1..100000000) | join: ',' }}", ctx)


def test_amplifying_filters_are_limited(ctx):
    with pytest.raises(ExpressionError, match="exceed"):
        r("{{ data | replace: 'a', data }}", {"data": "a" * 2000})
    with pytest.raises(ExpressionError, match="exceed"):
        r("{{ data | split: '' | join: data }}", {"data": "a" * 2000})
    chain = "{{ data" + " | base64_encode" * 60 + " }}"
    with pytest.raises(ExpressionError, match="exceed"):
        r(chain, {"data": "abc"})


def test_filter_work_budget_bounds_loops_over_large_values():
    big = {"data": "ab" * 400_000}
    assert render("{{ data | upcase | size }}", big) == "800000"
    with pytest.raises(ExpressionError, match="work budget"):
        render("{% for i in (1..1000) %}{% assign x = data | upcase %}{% endfor %}", big)
    # the budget is per render: the next render starts afresh
    assert render("{{ data | upcase | size }}", big) == "800000"


def test_filters_work_outside_a_render_without_a_budget():
    assert expressions.environment.filters["upcase"]("ab" * 400_000)[:2] == "AB"


def test_assign_growth_is_limited(ctx):
    template = "{% assign s = 'xxxxxxxxxx' %}{% for i in (1..40) %}{% assign s = s | append: s %}{% endfor %}"
    with pytest.raises(ExpressionError):
        r(template, ctx)


# --- caching ------------------------------------------------------------------------------------


def test_parsed_templates_are_cached_in_a_bounded_lru(ctx):
    template = "{{ data.number | last4 }} cached"
    r(template, ctx)
    before = expressions._compile.cache_info()
    r(template, ctx)
    after = expressions._compile.cache_info()
    assert after.hits == before.hits + 1
    assert after.maxsize == expressions.TEMPLATE_CACHE_SIZE


# --- reveal filters -----------------------------------------------------------------------------


def test_reveal_last(ctx):
    assert r("{{ data.number | reveal_last: 4 }}", ctx) == "XXXXXXXXXXXX4242"
    assert r("{{ data.number | reveal_last: 4, '*' }}", ctx) == "************4242"
    assert r("{{ data.number | reveal_last: 0 }}", ctx) == "X" * 16
    assert r("{{ data.cvc | reveal_last: 4 }}", ctx) == "123"
    assert r("{{ data.expiration_year | reveal_last: 2 }}", ctx) == "XX30"
    assert r("{{ data.nothing | reveal_last: 2 }}", ctx) == ""
    assert r("{{ data.number | reveal_last: '2' }}", ctx) == "XXXXXXXXXXXXXX42"


def test_reveal_first(ctx):
    assert r("{{ data.number | reveal_first: 6 }}", ctx) == "424242XXXXXXXXXX"
    assert r("{{ data.number | reveal_first: 2, '#' }}", ctx) == "42##############"
    assert r("{{ data.cvc | reveal_first: 5 }}", ctx) == "123"
    assert r("{{ data.ratio | reveal_first: 1 }}", ctx) == "0XX"


def test_reveal(ctx):
    assert r("{{ data.number | reveal: 6, 4 }}", ctx) == "424242XXXXXX4242"
    assert r("{{ data.number | reveal: 0, 4, '*' }}", ctx) == "************4242"
    assert r("{{ data.number | reveal: 2, 0 }}", ctx) == "42XXXXXXXXXXXXXX"
    assert r("{{ data.cvc | reveal: 2, 2 }}", ctx) == "123"


@pytest.mark.parametrize(
    "template",
    [
        "{{ data.number | reveal_last: -1 }}",
        "{{ data.number | reveal_last: 'x' }}",
        "{{ data.number | reveal_last: true }}",
        "{{ data.number | reveal_last: 2, 'ab' }}",
        "{{ data.number | reveal_last: 2, '' }}",
        "{{ data.number | reveal: 2, -3 }}",
        "{{ data.nested | reveal_last: 2 }}",
        "{{ data.nested.items | reveal_first: 2 }}",
    ],
)
def test_reveal_rejects_bad_arguments(ctx, template):
    with pytest.raises(ExpressionError) as info:
        r(template, ctx)
    assert VISA not in str(info.value)


# --- other custom filters -----------------------------------------------------------------------


def test_card_mask_filter(ctx):
    assert r("{{ data.number | card_mask }}", ctx) == "424242XXXXXX4242"
    assert r("{{ '378282246310005' | card_mask }}", ctx) == "378282XXXXX0005"
    assert r("{{ '123456789' | card_mask }}", ctx) == "XXXXX6789"
    assert r("{{ 4242424242424242 | card_mask }}", ctx) == "424242XXXXXX4242"
    assert r("{{ data.nothing | card_mask }}", ctx) == ""


def test_last4_filter(ctx):
    assert r("{{ data.number | last4 }}", ctx) == "4242"
    assert r("{{ data.cvc | last4 }}", ctx) == "123"
    assert r("{{ 123456 | last4 }}", ctx) == "3456"
    assert r("{{ data.nothing | last4 }}", ctx) == ""


def test_digits_filter(ctx):
    assert r("{{ '4242-4242 4242.4242' | digits }}", ctx) == VISA
    assert r("{{ '+1 (555) 010-9999' | digits }}", ctx) == "15550109999"
    assert r("{{ 'x²y٣' | digits }}", ctx) == ""
    assert r("{{ 12.5 | digits }}", ctx) == "125"
    assert r("{{ data.nothing | digits }}", ctx) == ""


def test_filters_chain(ctx):
    assert r("{{ '4242 4242 4242 4242' | digits | card_mask }}", ctx) == "424242XXXXXX4242"
    assert r("{{ data.number | digits | last4 | prepend: 'ends ' }}", ctx) == "ends 4242"


# --- stringify ----------------------------------------------------------------------------------


def test_stringify_objects_are_compact_json_with_sorted_keys():
    first = render("{{ data | stringify }}", {"data": {"b": 1, "a": {"d": [1, 2], "c": None}}})
    second = render("{{ data | stringify }}", {"data": {"a": {"c": None, "d": [1, 2]}, "b": 1}})
    assert first == second == '{"a":{"c":null,"d":[1,2]},"b":1}'


def test_stringify_scalars_and_strings():
    assert render("{{ data | stringify }}", {"data": "already text"}) == "already text"
    assert render("{{ data | stringify }}", {"data": 42}) == "42"
    assert render("{{ data | stringify }}", {"data": 1.5}) == "1.5"
    assert render("{{ data | stringify }}", {"data": True}) == "true"
    assert render("{{ data | stringify }}", {"data": None}) == "null"
    assert render("{{ data | stringify }}", {"data": ["x", 1, {"é": "ü"}]}) == '["x",1,{"é":"ü"}]'


def test_stringify_rejects_nan():
    with pytest.raises(ExpressionError):
        render("{{ data | stringify }}", {"data": {"x": float("nan")}})


def test_stringify_is_stable_across_calls():
    data = {"z": 1, "y": [3, {"k": "v", "a": 0}], "x": "s"}
    outputs = {render("{{ data | stringify }}", {"data": dict(reversed(list(data.items())))}) for _ in range(5)}
    outputs.add(render("{{ data | stringify }}", {"data": data}))
    assert len(outputs) == 1


# --- json ---------------------------------------------------------------------------------------


def test_json_filter_paths(ctx):
    assert r("{{ data | json: '$.number' }}", ctx) == VISA
    assert r("{{ data | json: '$.nested.items[1].b' }}", ctx) == "x"
    assert r("{{ data | json: \"$['nested']['key with space']\" }}", ctx) == "s"
    assert r("{{ data | json: '$.nested.items[-2]' }}", ctx) == "1"
    assert r("{{ data | json: '$.nested.items' | stringify }}", ctx) == '[1,{"b":"x"}]'
    assert r("{{ data | json: '$' | json: '$.cvc' }}", ctx) == "123"


def test_json_filter_missing_selects_nothing(ctx):
    assert r("{{ data | json: '$.missing' }}", ctx) == ""
    assert r("{{ data | json: '$.nested.items[7]' }}", ctx) == ""
    assert r("{{ data | json: '$.number.deeper' }}", ctx) == ""
    assert r("{{ data | json: '$.nested[0]' }}", ctx) == ""


def test_json_filter_reads_json_text():
    assert render("{{ enc | json: '$.data.number' }}", {"enc": '{"data": {"number": "4111"}}'}) == "4111"
    assert render("{{ enc | json: '$' }}", {"enc": "not json"}) == "not json"


@pytest.mark.parametrize("path", ["a.b", "$.", "$[", "$.a[x]", "$..a", "$.a['b", "$ a"])
def test_json_filter_malformed_path(ctx, path):
    with pytest.raises(ExpressionError, match="json"):
        r("{{ data | json: path }}", {**ctx, "path": path})


def test_json_filter_path_must_be_a_string(ctx):
    with pytest.raises(ExpressionError, match="json"):
        r("{{ data | json: 3 }}", ctx)


def test_json_filter_path_length_is_limited(ctx):
    with pytest.raises(ExpressionError, match="longer than"):
        r("{{ data | json: path }}", {**ctx, "path": "$" + ".a" * 600})


def test_custom_filters_have_docstrings():
    for name in (
        "reveal_last",
        "reveal_first",
        "reveal",
        "card_mask",
        "last4",
        "digits",
        "stringify",
        "json",
    ):
        func = expressions.environment.filters[name]
        assert func.__doc__ and func.__doc__.strip()


# --- masks --------------------------------------------------------------------------------------


def test_mask_keeps_types(ctx):
    mask = {
        "month": "{{ data.expiration_month }}",
        "verified": "{{ data.verified }}",
        "ratio": "{{ data.ratio }}",
        "nested": "{{ data.nested }}",
        "nothing": "{{ data.nothing }}",
        "with_filter": "{{ data.expiration_month | plus: 1 }}",
        "spaced": " {{ data.expiration_month }}",
        "trimmed": "{{- data.expiration_month -}}",
    }
    masked = apply_mask(mask, ctx)
    assert masked == {
        "month": 4,
        "verified": True,
        "ratio": 0.5,
        "nested": {"items": [1, {"b": "x"}], "key with space": "s"},
        "nothing": None,
        "with_filter": "5",
        "spaced": " 4",
        "trimmed": 4,
    }
    masked["nested"]["items"].append("mutated")
    assert ctx["data"]["nested"]["items"] == [1, {"b": "x"}]


def test_mask_walks_structures_and_keeps_literals(ctx):
    mask = {
        "card": {"last": "{{ data.number | last4 }}", "tags": ["fixed", "{{ type }}", 7, None, False]},
        "n": 1.5,
    }
    assert apply_mask(mask, ctx) == {
        "card": {"last": "4242", "tags": ["fixed", "card", 7, None, False]},
        "n": 1.5,
    }


@pytest.mark.parametrize("mask", [None, 3, 2.5, True])
def test_mask_scalars_are_returned_as_they_are(ctx, mask):
    assert apply_mask(mask, ctx) is mask


def test_mask_string_root(ctx):
    assert apply_mask("{{ data.number | card_mask }}", ctx) == "424242XXXXXX4242"


def test_mask_empty_render_becomes_none(ctx):
    assert apply_mask({"a": "{{ data.blank_text }}", "b": "", "c": "{% if false %}x{% endif %}"}, ctx) == {
        "a": None,
        "b": None,
        "c": None,
    }


def test_mask_absent_optional_field_is_none_but_typos_in_roots_fail(ctx):
    assert apply_mask({"name": "{{ data.name }}"}, ctx) == {"name": None}
    with pytest.raises(ExpressionError, match=r"mask\.n: 'dta' is undefined"):
        apply_mask({"n": "{{ dta.number }}"}, ctx)
    with pytest.raises(ExpressionError, match=r"mask\.n"):
        apply_mask({"n": "{{ data.number.deeper }}"}, ctx)
    with pytest.raises(ExpressionError, match=r"mask\.n\[1\]"):
        apply_mask({"n": ["ok", "{{ data.missing | upcase }}"]}, ctx)


def test_mask_errors(ctx):
    with pytest.raises(ExpressionError, match="unknown filter"):
        apply_mask({"a": "{{ data.number | nope }}"}, ctx)
    with pytest.raises(ExpressionError, match="unsupported"):
        apply_mask({"a": object()}, ctx)
    deep: object = "{{ type }}"
    for _ in range(expressions.MAX_MASK_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ExpressionError, match="nested"):
        apply_mask(deep, ctx)


def test_validate_mask():
    assert validate_mask({"a": "{{ data.number | card_mask }}", "b": [1, None, "text"], "c": 2}) == []
    assert validate_mask("{{ data.x }}") == []
    assert validate_mask(None) == []
    problems = validate_mask({"a": "{{ data.x | nope }}", "b": ["ok", "{{ oops"], "c": {1: "x"}, "d": {1, 2}})
    assert len(problems) == 4
    assert problems[0].startswith("mask.a: ") and "unknown filter 'nope'" in problems[0]
    assert problems[1].startswith("mask.b[1]: ")
    assert problems[2].startswith("mask.c[")
    assert problems[3].startswith("mask.d: ")
    assert validate_mask("{{ x") == [validate_mask("{{ x")[0]]
    assert validate_mask("{{ x")[0].startswith("mask: ")


@pytest.mark.parametrize("value", ["4242424242424242", '<a> & "b"', "", 12, -7, 10**30, True, 1.5, None, [1, 2]])
def test_a_bare_path_renders_as_liquid_renders_it(value):
    from domain.tokens.expressions import environment

    context = {"data": {"card": {"number": value}}, "metadata": {}, "type": "token"}
    expected = environment.from_string("{{ data.card.number }}").render(context)
    assert render("{{ data.card.number }}", context) == expected
    assert render("{{data.card.number}}", context) == expected


def test_a_bare_path_to_a_missing_key_still_raises():
    with pytest.raises(ExpressionError):
        render("{{ nothing.here }}", {"data": {}, "metadata": {}, "type": "token"})


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ data.number, reveal_last: 4 }}", "XXXXXXXXXXXX4242"),
        ("{{ data.number,reveal_last:4 }}", "XXXXXXXXXXXX4242"),
        ('{{ data.number, reveal_last: 4, "*" }}', "************4242"),
        ("a\n{{ data.number, last4 }}-{{ data.number, slice: 0, 4 }}", "a\n4242-4242"),
        ("{{ data.number | slice: 0, 8, last4 }}", "4242"),
        ("{{ data.number | slice: 0, 8, reveal_last: 2, '#' }}", "######42"),
    ],
)
def test_a_comma_where_a_filter_pipe_belongs_is_read_as_the_pipe(template, expected):
    context = {"data": {"number": "4242424242424242"}, "metadata": {}, "type": "card"}
    assert r(template, context) == expected


@pytest.mark.parametrize(
    ("template", "position"),
    [
        ('{{ data.number, "x" }}', "line 1, column 15"),
        ("{{ data.number, }}", "line 1, column 15"),
        ("{% if data.number, last4 %}x{% endif %}", "line 1, column 18"),
        ("ab\n{{ data.number, nope }}", "line 2, column 15"),
    ],
)
def test_any_other_comma_is_an_error_naming_its_position(template, position):
    with pytest.raises(ExpressionError, match="invalid expression") as info:
        validate_expression(template)
    assert position in str(info.value)
