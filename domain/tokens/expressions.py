"""The expression engine: Liquid templates for token fingerprints, masks and search indexes.

An expression is a Liquid template (python-liquid 2) rendered against the context
``{"data": <token data>, "metadata": {...}, "type": "<token type>"}`` (see :func:`make_context`).
Expressions come from API callers, so the single module-level environment is locked down:

* an undefined variable is an error (``{{ data.nope }}`` raises), except that it may be tested for
  truthiness (``{% if data.cvc %}``) and replaced with the ``default`` filter;
* an unknown filter is an error, found when the expression is validated, not only when a branch
  using it happens to run;
* no template loader, no ``include``/``render`` tags and no template inheritance tags;
* resource limits: template length (:data:`MAX_TEMPLATE_LENGTH`), output size
  (:data:`MAX_OUTPUT_SIZE`), loop iterations (:data:`MAX_LOOP_ITERATIONS`), the size of any
  intermediate string a filter produces, the length of ranges a filter may expand, and the total
  work filters may do in one render (:data:`MAX_FILTER_WORK`).

Every failure surfaces as :class:`ExpressionError` with a readable message that names the rule,
never the token data.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache, wraps
from typing import Any, NamedTuple

import jsonpath
from liquid import Environment, RenderContext
from liquid.builtin.expressions import FilteredExpression, Path
from liquid.builtin.expressions.arguments import KeywordArgument, PositionalArgument
from liquid.builtin.output import OutputNode
from liquid.exceptions import (
    FilterArgumentError,
    FilterValueError,
    LiquidError,
    TemplateNotFoundError,
    UndefinedError,
)
from liquid.undefined import FalsyStrictUndefined, Undefined

from domain.tokens.cards import mask_pan

__all__ = [
    "MAX_FILTER_WORK",
    "MAX_LOOP_ITERATIONS",
    "MAX_OUTPUT_SIZE",
    "MAX_TEMPLATE_LENGTH",
    "ExpressionError",
    "apply_mask",
    "environment",
    "evaluate",
    "make_context",
    "render",
    "validate_expression",
    "validate_mask",
]

MAX_TEMPLATE_LENGTH = 4096
"""Longest expression source accepted, in characters."""

MAX_OUTPUT_SIZE = 1_048_576
"""Largest rendered output, in characters; also the largest string any filter may produce."""

MAX_LOOP_ITERATIONS = 10_000
"""Most loop iterations (nested loops multiply) in one render; also the longest range a filter
may expand (``(1..n) | join``)."""

MAX_LOCAL_NAMESPACE = 4 * MAX_OUTPUT_SIZE
"""Most bytes held by ``assign``/``capture`` variables in one render."""

MAX_FILTER_WORK = 32 * MAX_OUTPUT_SIZE
"""Work budget of one render: every filter call costs 1 plus the length of its input and of its
result (characters of a string, items of an array or object), so a loop cannot run costly filters
over large values thousands of times."""

MAX_JSON_PATH_LENGTH = 1024
"""Longest path accepted by the ``json`` filter."""

MAX_MASK_DEPTH = 64
"""Deepest nesting of objects and arrays accepted in a mask."""

TEMPLATE_CACHE_SIZE = 1024
"""Parsed templates kept in the LRU cache."""

MASK_CHAR = "X"


class ExpressionError(ValueError):
    """An expression could not be parsed or rendered.

    Raised for syntax errors, unknown filters, undefined variables, bad filter arguments and
    resource limit breaches. ``str(err)`` is a one-line message suitable for an API error.
    """


class _Undefined(FalsyStrictUndefined):
    """Strict undefined: output, filters and comparisons raise; ``if`` and ``default`` work."""

    force_liquid_default = True


class _ExpressionEnvironment(Environment):
    """Environment with resource limits and no way to load other templates."""

    output_stream_limit = MAX_OUTPUT_SIZE
    loop_iteration_limit = MAX_LOOP_ITERATIONS
    local_namespace_limit = MAX_LOCAL_NAMESPACE
    context_depth_limit = 30
    block_nesting_limit = 30

    def get_template(self, name: str, **kwargs: object) -> Any:  # type: ignore[override]
        """Refuse to load templates: expressions are self-contained."""
        raise TemplateNotFoundError("loading templates is not allowed in expressions", token=None)

    async def get_template_async(self, name: str, **kwargs: object) -> Any:  # type: ignore[override]
        """Refuse to load templates: expressions are self-contained."""
        raise TemplateNotFoundError("loading templates is not allowed in expressions", token=None)


# --------------------------------------------------------------------------------------------
# Filter helpers
# --------------------------------------------------------------------------------------------


def _text(value: object, filter_name: str) -> str | None:
    """Coerce a filter's input to text: None stays None, numbers and bools become strings."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise FilterValueError(f"{filter_name}: expected a string or a number, found {_type_name(value)}", token=None)


def _type_name(value: object) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


def _count(value: object, filter_name: str, arg_name: str) -> int:
    """A non-negative integer argument; digit strings and integral floats are accepted."""
    if isinstance(value, bool):
        raise FilterArgumentError(f"{filter_name}: {arg_name} must be an integer", token=None)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit() and value.strip().isascii():
        value = int(value.strip())
    if not isinstance(value, int):
        raise FilterArgumentError(f"{filter_name}: {arg_name} must be an integer", token=None)
    if value < 0:
        raise FilterArgumentError(f"{filter_name}: {arg_name} must not be negative", token=None)
    return value


def _mask_char(value: object, filter_name: str) -> str:
    if not isinstance(value, str) or len(value) != 1:
        raise FilterArgumentError(f"{filter_name}: the replacement must be a single character", token=None)
    return value


def _reveal(text: str, first: int, last: int, char: str) -> str:
    size = len(text)
    if first + last >= size:
        return text
    tail = text[size - last :] if last else ""
    return text[:first] + char * (size - first - last) + tail


# --------------------------------------------------------------------------------------------
# Custom filters
# --------------------------------------------------------------------------------------------


def reveal_last_filter(value: object, n: object = 4, char: object = MASK_CHAR) -> str | None:
    """``reveal_last: n[, char]``: replace all but the last ``n`` characters with ``X``.

    ``{{ "123456789" | reveal_last: 4 }}`` -> ``XXXXX6789``; ``char`` changes the replacement
    character. None stays None; numbers are converted to strings; a value no longer than ``n`` is
    returned unchanged.
    """
    text = _text(value, "reveal_last")
    if text is None:
        return None
    return _reveal(text, 0, _count(n, "reveal_last", "n"), _mask_char(char, "reveal_last"))


def reveal_first_filter(value: object, n: object = 6, char: object = MASK_CHAR) -> str | None:
    """``reveal_first: n[, char]``: replace all but the first ``n`` characters with ``X``.

    ``{{ "123456789" | reveal_first: 2 }}`` -> ``12XXXXXXX``. Same coercions as ``reveal_last``.
    """
    text = _text(value, "reveal_first")
    if text is None:
        return None
    return _reveal(text, _count(n, "reveal_first", "n"), 0, _mask_char(char, "reveal_first"))


def reveal_filter(value: object, first: object = 0, last: object = 0, char: object = MASK_CHAR) -> str | None:
    """``reveal: first, last[, char]``: keep ``first`` leading and ``last`` trailing characters.

    ``{{ "4111111111111111" | reveal: 6, 4 }}`` -> ``411111XXXXXX1111``. A value no longer than
    ``first + last`` is returned unchanged. Same coercions as ``reveal_last``.
    """
    text = _text(value, "reveal")
    if text is None:
        return None
    return _reveal(
        text,
        _count(first, "reveal", "first"),
        _count(last, "reveal", "last"),
        _mask_char(char, "reveal"),
    )


def card_mask_filter(value: object) -> str | None:
    """``card_mask``: mask a card number, first six and last four visible (``424242XXXXXX4242``).

    Shorter values keep only the last four (see :func:`domain.tokens.cards.mask_pan`). None stays None.
    """
    text = _text(value, "card_mask")
    if text is None:
        return None
    return mask_pan(text)


def last4_filter(value: object) -> str | None:
    """``last4``: the last four characters (all of a shorter value). None stays None."""
    text = _text(value, "last4")
    if text is None:
        return None
    return text[-4:]


def digits_filter(value: object) -> str | None:
    """``digits``: keep the ASCII digits only (``"4242-4242"`` -> ``42424242``). None stays None."""
    text = _text(value, "digits")
    if text is None:
        return None
    return "".join(c for c in text if "0" <= c <= "9")


def stringify_filter(value: object) -> str:
    """``stringify``: a stable string for any value.

    Strings are returned unchanged; anything else (objects, arrays, numbers, booleans, nil) is
    compact JSON with object keys sorted, so ``{"b": 1, "a": 2}`` always gives
    ``{"a":2,"b":1}``, ``true`` gives ``true`` and nil gives ``null``. Non-ASCII characters are
    kept as they are. NaN and infinities are rejected.
    """
    if isinstance(value, str):
        return value
    try:
        return json.dumps(
            value,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            default=_json_default,
        )
    except RecursionError as err:
        raise FilterValueError("stringify: value is nested too deeply", token=None) from err
    except (TypeError, ValueError) as err:
        raise FilterValueError(f"stringify: value is not representable as JSON ({err})", token=None) from err


def _json_default(value: object) -> object:
    if isinstance(value, Undefined):
        raise UndefinedError(value.msg, token=value.token)
    if isinstance(value, (tuple, range)):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"unsupported type {type(value).__name__}")


@lru_cache(maxsize=256)
def _compile_json_path(path: str) -> jsonpath.JSONPath:
    """Compile ``path`` with python-jsonpath (RFC 9535); only singular queries (names and indexes,
    ``$.a['b'][0]``) are accepted. Raises FilterArgumentError when malformed or not singular."""
    if not path.startswith("$"):
        raise FilterArgumentError("json: a path must start with '$'", token=None)
    try:
        compiled = jsonpath.compile(path)
    except jsonpath.JSONPathError as err:
        raise FilterArgumentError(f"json: malformed path ({str(err).splitlines()[0]})", token=None) from None
    if not isinstance(compiled, jsonpath.JSONPath) or not compiled.singular_query():
        raise FilterArgumentError("json: only singular paths (member names and indexes) are supported", token=None)
    return compiled


def json_filter(value: object, path: object = "$") -> object:
    """``json: "$.a.b[0]"``: select a value with a JSONPath (python-jsonpath, RFC 9535).

    Singular queries only: ``$`` (the value itself), ``.name``, ``['name']`` / ``["name"]`` and
    ``[index]`` (negative indexes count from the end). A string that holds a JSON object or array is parsed
    first, so the filter also reads JSON text. Returns the selected value (objects and arrays
    included, e.g. for ``| stringify``), or nil when the path selects nothing. Raises an
    ExpressionError (at render) when the path is not a string or is malformed.
    """
    if not isinstance(path, str):
        raise FilterArgumentError("json: the path must be a string", token=None)
    if len(path) > MAX_JSON_PATH_LENGTH:
        raise FilterArgumentError(f"json: the path is longer than {MAX_JSON_PATH_LENGTH} characters", token=None)
    compiled = _compile_json_path(path.strip())
    current = value
    if isinstance(current, str) and current.lstrip()[:1] in ("{", "["):
        try:
            current = json.loads(current)
        except ValueError:
            pass
    if not isinstance(current, (Mapping, list, tuple)):
        return current if compiled.empty() else None
    try:
        match = compiled.match(current)
    except jsonpath.JSONPathError:
        return None
    return None if match is None else match.obj


# Filters for payment integrations (the outbound proxy's expressions use them most).

_MAX_PAN_DIGITS = 19
_EXP_FORMAT = re.compile(r"YYYY|YY|MM|M")


def card_bin_filter(value: object, n: object = 6) -> str | None:
    """``card_bin[: n]``: the BIN, the first ``n`` digits (default 6; at most 19) of a card number.

    ``{{ "4242 4242 4242 4242" | card_bin }}`` -> ``424242``; separators are dropped first. None
    stays None; numbers are converted to strings.
    """
    text = _text(value, "card_bin")
    if text is None:
        return None
    size = _count(n, "card_bin", "n")
    if not 1 <= size <= _MAX_PAN_DIGITS:
        raise FilterArgumentError(f"card_bin: n must be between 1 and {_MAX_PAN_DIGITS}", token=None)
    return "".join(c for c in text if "0" <= c <= "9")[:size]


def card_exp_filter(value: object, fmt: object = "MM/YY") -> str | None:
    """``card_exp[: "MM/YY"]``: a card's expiration formatted from its ``expiration_month`` and
    ``expiration_year`` (a card's data, or a token object whose ``data`` is a card).

    Format codes: ``MM`` (two-digit month), ``M`` (month), ``YYYY`` (four-digit year), ``YY`` (two
    digits); anything else is copied. ``{{ card | card_exp: "MMYY" }}`` -> ``1229``. None stays None;
    raises an ExpressionError when the month or year is missing or not a number.
    """
    if value is None:
        return None
    if not isinstance(fmt, str):
        raise FilterArgumentError("card_exp: the format must be a string", token=None)
    card = value.get("data") if isinstance(value, Mapping) and "expiration_month" not in value else value
    if not isinstance(card, Mapping):
        raise FilterValueError(f"card_exp: expected a card object, found {_type_name(card)}", token=None)
    try:
        month, year = int(str(card["expiration_month"])), int(str(card["expiration_year"]))
    except (KeyError, TypeError, ValueError):
        raise FilterValueError(
            "card_exp: the card has no numeric expiration_month and expiration_year", token=None
        ) from None
    if year < 100:
        year += 2000
    parts = {"YYYY": f"{year:04d}", "YY": f"{year % 100:02d}", "MM": f"{month:02d}", "M": str(month)}
    return _EXP_FORMAT.sub(lambda m: parts[m.group(0)], fmt)


def to_number_filter(value: object) -> int | float | None:
    """``to_number``: a string holding a decimal number as a number (``"12"`` -> 12, ``"12.50"`` ->
    12.5); numbers stay as they are, None stays None. Raises an ExpressionError for anything else
    (booleans, objects, text that is not a finite number)."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    if not isinstance(value, str):
        raise FilterValueError(f"to_number: expected a string or a number, found {_type_name(value)}", token=None)
    text = value.strip()
    if re.fullmatch(r"[+-]?[0-9]{1,30}", text):
        return int(text)
    if re.fullmatch(r"[+-]?([0-9]{1,30}(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,3})?", text):
        number = float(text)
        if number == number and number not in (float("inf"), float("-inf")):
            return number
    raise FilterValueError("to_number: the value is not a number", token=None)


def _pad(value: object, width: object, char: object, name: str, left: bool) -> str | None:
    text = _text(value, name)
    if text is None:
        return None
    size = _count(width, name, "width")
    if size > MAX_OUTPUT_SIZE:
        raise FilterArgumentError(f"{name}: width exceeds {MAX_OUTPUT_SIZE}", token=None)
    fill = _mask_char(char, name)
    return text.rjust(size, fill) if left else text.ljust(size, fill)


def pad_left_filter(value: object, width: object = 0, char: object = " ") -> str | None:
    """``pad_left: width[, char]``: prepend ``char`` (default a space) until ``width`` characters
    (``{{ "42" | pad_left: 5, "0" }}`` -> ``00042``); longer values are unchanged. None stays None."""
    return _pad(value, width, char, "pad_left", True)


def pad_right_filter(value: object, width: object = 0, char: object = " ") -> str | None:
    """``pad_right: width[, char]``: append ``char`` (default a space) until ``width`` characters
    (``{{ "42" | pad_right: 5, "x" }}`` -> ``42xxx``). Same rules as ``pad_left``."""
    return _pad(value, width, char, "pad_right", False)


def to_base64_filter(value: object) -> str | None:
    """``to_base64``: standard base64 (with padding) of the UTF-8 text of the value; objects and
    arrays are encoded as their ``stringify`` JSON. None stays None."""
    if value is None:
        return None
    text = value if isinstance(value, str) else stringify_filter(value)
    return base64.b64encode(text.encode()).decode("ascii")


_CUSTOM_FILTERS: dict[str, Callable[..., object]] = {
    "reveal_last": reveal_last_filter,
    "reveal_first": reveal_first_filter,
    "reveal": reveal_filter,
    "card_mask": card_mask_filter,
    "last4": last4_filter,
    "digits": digits_filter,
    "stringify": stringify_filter,
    "json": json_filter,
    "card_bin": card_bin_filter,
    "card_exp": card_exp_filter,
    "to_string": stringify_filter,
    "to_number": to_number_filter,
    "pad_left": pad_left_filter,
    "pad_right": pad_right_filter,
    "to_base64": to_base64_filter,
}

# --------------------------------------------------------------------------------------------
# Guards around every filter: strict undefined, range expansion and result size.
# --------------------------------------------------------------------------------------------

_UNDEFINED_TOLERANT_FILTERS = frozenset({"default"})


def _estimate_replace(left: object, args: tuple) -> int:
    if not isinstance(left, str) or not args:
        return 0
    seq = str(args[0]) if args[0] is not None else ""
    sub = str(args[1]) if len(args) > 1 and args[1] is not None else ""
    occurrences = left.count(seq) if seq else len(left) + 1
    return len(left) + occurrences * max(len(sub) - len(seq), 0)


def _estimate_join(left: object, args: tuple) -> int:
    if not isinstance(left, (list, tuple, range)):
        return 0
    separator = args[0] if args else " "
    separator_len = len(separator) if isinstance(separator, str) else len(str(separator))
    items = len(left) * separator_len
    if isinstance(left, range):
        return items + len(left) * max(len(str(left.start)), len(str(left.stop)))
    return items + sum(len(item) for item in left if isinstance(item, str))


_ESTIMATORS: dict[str, Callable[[object, tuple], int]] = {
    "replace": _estimate_replace,
    "join": _estimate_join,
}


def _check_operand(name: str, value: object, *, allow_undefined: bool) -> None:
    if isinstance(value, Undefined) and not allow_undefined:
        raise UndefinedError(value.msg, token=value.token)
    if isinstance(value, range) and len(value) > MAX_LOOP_ITERATIONS:
        raise FilterValueError(
            f"{name}: range of {len(value)} items exceeds the limit of {MAX_LOOP_ITERATIONS}", token=None
        )
    if isinstance(value, str) and len(value) > MAX_OUTPUT_SIZE:
        raise FilterValueError(f"{name}: string exceeds the size limit of {MAX_OUTPUT_SIZE} characters", token=None)


_work_budget: ContextVar[list[int] | None] = ContextVar("expression_work_budget", default=None)


@contextmanager
def _budget() -> Iterator[None]:
    """Give the render running in this block a fresh :data:`MAX_FILTER_WORK` budget."""
    token = _work_budget.set([MAX_FILTER_WORK])
    try:
        yield
    finally:
        _work_budget.reset(token)


def _size(value: object) -> int:
    if isinstance(value, (str, list, tuple, range, dict)):
        return len(value)
    return 0


def _charge(name: str, cost: int) -> None:
    budget = _work_budget.get()
    if budget is None:
        return
    budget[0] -= cost
    if budget[0] < 0:
        raise FilterValueError(f"{name}: expression exceeds its work budget of {MAX_FILTER_WORK}", token=None)


def _guard(name: str, func: Callable[..., object]) -> Callable[..., object]:
    """Wrap a filter so that it cannot turn a small template into a huge value or run for long."""
    allow_undefined = name in _UNDEFINED_TOLERANT_FILTERS
    estimator = _ESTIMATORS.get(name)

    @wraps(func)
    def guarded(left: object, *args: object, **kwargs: object) -> object:
        _check_operand(name, left, allow_undefined=allow_undefined)
        for arg in args:
            _check_operand(name, arg, allow_undefined=False)
        for key, arg in kwargs.items():
            if key not in ("environment", "context"):
                _check_operand(name, arg, allow_undefined=False)
        if estimator is not None and estimator(left, args) > MAX_OUTPUT_SIZE:
            raise FilterValueError(f"{name}: result would exceed {MAX_OUTPUT_SIZE} characters", token=None)
        _charge(name, 1 + _size(left))
        result = func(left, *args, **kwargs)
        _charge(name, _size(result))
        if isinstance(result, str) and len(result) > MAX_OUTPUT_SIZE:
            raise FilterValueError(f"{name}: result exceeds {MAX_OUTPUT_SIZE} characters", token=None)
        if isinstance(result, list) and len(result) > MAX_OUTPUT_SIZE:
            raise FilterValueError(f"{name}: result exceeds {MAX_OUTPUT_SIZE} items", token=None)
        return result

    # Only synchronous rendering is used; never let an async variant bypass the guard.
    guarded.__dict__.pop("filter_async", None)
    return guarded


def _build_environment() -> Environment:
    env = _ExpressionEnvironment(undefined=_Undefined, strict_filters=True, autoescape=False)
    for tag in ("include", "render", "extends", "block", "macro", "call", "with", "translate"):
        env.tags.pop(tag, None)
    for name, func in _CUSTOM_FILTERS.items():
        env.add_filter(name, func)
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard(name, func)
    return env


environment: Environment = _build_environment()
"""The one environment every expression is parsed and rendered with."""


# --------------------------------------------------------------------------------------------
# Parsing, caching and rendering
# --------------------------------------------------------------------------------------------


class _Compiled(NamedTuple):
    template: Any  # liquid.BoundTemplate
    path: Path | None  # set when the template is exactly ``{{ some.path }}``


def _describe(err: BaseException) -> str:
    """A one-line message for a Liquid error: its message plus line and column when known."""
    if isinstance(err, LiquidError):
        message = str(err.message) if err.message is not None else type(err).__name__
        try:
            where = err.context()
        except ValueError:
            where = None
        if where is not None:
            return f"{message} (line {where[0]}, column {where[1] + 1})"
        return message
    if isinstance(err, RecursionError):
        return "expression is nested too deeply"
    return f"expression failed ({type(err).__name__})"


#: A comma followed by a filter name, where Liquid wanted the end of an output expression.
_STRAY_COMMA = re.compile(r",\s*([A-Za-z_][\w-]*)")


def _comma_as_pipe(source: str, err: LiquidError) -> str | None:
    """``source`` with the comma Liquid stopped at read as the filter pipe it was meant to be
    (``{{ data.number, reveal_last: 4 }}`` -> ``{{ data.number| reveal_last: 4 }}``), when the
    comma is followed by a known filter's name; None otherwise (the error stands)."""
    token = getattr(err, "token", None)
    index = getattr(token, "start_index", None)
    if getattr(token, "kind", None) != "comma" or not isinstance(index, int):
        return None
    match = _STRAY_COMMA.match(source, index)
    if match is None or match.group(1) not in environment.filters:
        return None
    return source[:index] + "|" + source[index + 1 :]


def _argument_comma(source: str, template: Any) -> int | None:
    """The index of a comma Liquid read as separating a filter's arguments although a known filter's
    name follows it (``{{ value | json: "$.a", last4 }}``: ``last4`` is no variable but the next
    filter), in an output statement; None when there is none."""
    for node in template.nodes:
        if not isinstance(node, OutputNode) or type(node.expression) is not FilteredExpression:
            continue
        for applied in node.expression.filters:
            for argument in applied.args:
                if isinstance(argument, KeywordArgument):
                    name, token = argument.name, argument.token
                elif isinstance(argument, PositionalArgument) and type(argument.value) is Path:
                    segments = argument.value.path
                    name = segments[0] if len(segments) == 1 and isinstance(segments[0], str) else None
                    token = argument.value.token
                else:
                    continue
                index = getattr(token, "start_index", None)
                if name not in environment.filters or not isinstance(index, int):
                    continue
                before = source[:index].rstrip()
                if before.endswith(","):
                    return len(before) - 1
    return None


def _parse(source: str) -> Any:
    """Parse ``source``, reading each stray comma before a filter name as a pipe (liberal in what an
    expression may say; the same length, so positions in later errors stay those of ``source``).

    Two places are read so: a comma where Liquid wanted the end of an output (after a value:
    ``{{ data.number, last4 }}``), and a comma among a filter's arguments followed by a known filter's
    name (``{{ data.number | slice: 0, 4, last4 }}``, where the name would otherwise be read as an
    undefined variable). The proxy's expressions (``domain.proxy.detokenize``) use this too."""
    repaired: dict[int, LiquidError] = {}  # index of a comma read as a pipe -> the error it made
    while True:
        try:
            template = environment.from_string(source)
        except LiquidError as err:
            index = getattr(getattr(err, "token", None), "start_index", None)
            if index in repaired:  # the pipe is wrong there too (a tag, not an output): the comma's error
                raise repaired[index] from None
            attempt = _comma_as_pipe(source, err)
            if attempt is None:
                raise
            repaired[index] = err
            source = attempt
            continue
        index = _argument_comma(source, template)
        if index is None or index in repaired:
            return template
        repaired[index] = LiquidError("unexpected comma", token=None)
        source = source[:index] + "|" + source[index + 1 :]


@lru_cache(maxsize=TEMPLATE_CACHE_SIZE)
def _compile(source: str) -> _Compiled:
    """Parse ``source`` and check its filters; raises ExpressionError. Results are LRU-cached."""
    try:
        template = _parse(source)
        analysis = template.analyze(include_partials=False)
    except Exception as err:
        raise ExpressionError(f"invalid expression: {_describe(err)}") from err
    unknown = sorted(name for name in analysis.filters if name not in environment.filters)
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown)
        raise ExpressionError(f"invalid expression: unknown filter {names}")
    path: Path | None = None
    if len(template.nodes) == 1 and isinstance(template.nodes[0], OutputNode):
        expression = template.nodes[0].expression
        if type(expression) is FilteredExpression and not expression.filters and type(expression.left) is Path:
            path = expression.left
    return _Compiled(template, path)


def _get_compiled(source: object) -> _Compiled:
    if not isinstance(source, str):
        raise ExpressionError(f"an expression must be a string, not {_type_name(source)}")
    if len(source) > MAX_TEMPLATE_LENGTH:
        raise ExpressionError(f"expression is {len(source)} characters long; the limit is {MAX_TEMPLATE_LENGTH}")
    return _compile(source)


def _check_context(context: object) -> Mapping[str, object]:
    if not isinstance(context, Mapping):
        raise ExpressionError("the expression context must be an object")
    return context


def validate_expression(template: str) -> None:
    """Parse ``template`` without rendering it.

    A comma where a filter's pipe belongs (``{{ data.number, reveal_last: 4 }}``) is read as that
    pipe. Raises ExpressionError when ``template`` is not a string, is longer than
    :data:`MAX_TEMPLATE_LENGTH` characters, has a syntax error (the message gives line and
    column), uses a disallowed tag (``include``, ``render``) or uses an unknown filter, even in a
    branch that would not run. Undefined variables are only detected when rendering.
    """
    _get_compiled(template)


def render(template: str, context: dict) -> str:
    """Render ``template`` against ``context`` and return the output string.

    ``context`` is a mapping such as ``{"data": ..., "metadata": {...}, "type": "card"}`` (see
    :func:`make_context`). Parsed templates are kept in a bounded LRU cache.

    Raises ExpressionError for everything :func:`validate_expression` rejects, an undefined
    variable, a bad filter argument or input, and a breached limit (output longer than
    :data:`MAX_OUTPUT_SIZE` characters, more than :data:`MAX_LOOP_ITERATIONS` loop iterations,
    filters doing more than :data:`MAX_FILTER_WORK` work).
    """
    compiled = _get_compiled(template)
    context = _check_context(context)
    if compiled.path is not None:
        plain = _plain_path_value(compiled.path.path, context)
        if plain is not None:
            return plain
    try:
        with _budget():
            return compiled.template.render(context)
    except Exception as err:
        raise ExpressionError(_describe(err)) from err


def evaluate(template: str, context: Mapping[str, object]) -> object:
    """Evaluate a one-output expression ``{{ <value> | <filters> }}`` and return its typed value.

    Where :func:`render` gives text, this gives what the last filter returned (a string, a number,
    an object, an array or None), so a caller can place it in JSON as a value. Same parsing, cache,
    limits and errors as :func:`render`; also raises ExpressionError when ``template`` is anything
    but exactly one output statement, or its value is undefined.
    """
    compiled = _get_compiled(template)
    context = _check_context(context)
    nodes = compiled.template.nodes
    if len(nodes) != 1 or not isinstance(nodes[0], OutputNode):
        raise ExpressionError("an expression to evaluate must be exactly one {{ ... }} output")
    render_context = RenderContext(compiled.template, globals=compiled.template.make_globals(context))
    try:
        with _budget():
            value = nodes[0].expression.evaluate(render_context)
        if isinstance(value, Undefined):
            raise UndefinedError(value.msg, token=None)
    except Exception as err:
        raise ExpressionError(_describe(err)) from err
    return value


_PLAIN_INT = 10**18


def _plain_path_value(segments: list, context: Mapping[str, object]) -> str | None:
    """The output of a bare ``{{ a.b.c }}`` whose segments are object keys reaching a string or an
    integer (the fingerprint and search index expressions of most tokens), as Liquid renders it,
    without rendering; None for anything else (Liquid renders it, with its rules and errors)."""
    value: object = context
    for segment in segments:
        if type(segment) is not str or type(value) is not dict or segment not in value:
            return None
        value = value[segment]
    if type(value) is int and -_PLAIN_INT < value < _PLAIN_INT:  # huge integers: Liquid's rules
        return str(value)
    if type(value) is str and len(value) <= MAX_OUTPUT_SIZE:
        return value
    return None


def make_context(token_type: str, data: object, metadata: Mapping[str, str] | None = None) -> dict:
    """Build the expression context ``{"data": data, "metadata": metadata or {}, "type": token_type}``."""
    return {"data": data, "metadata": dict(metadata or {}), "type": token_type}


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def _resolve_path(compiled: _Compiled, context: Mapping[str, object]) -> object:
    """Evaluate a bare ``{{ a.b.c }}`` leaf and return the typed value.

    A key missing from an object that exists yields None (an optional field that was not given,
    like a card's expiration); an unknown root variable or a path through a non-object raises.
    """
    path = compiled.path
    assert path is not None
    render_context = RenderContext(compiled.template, globals=compiled.template.make_globals(context))
    try:
        value = path.evaluate(render_context)
        if isinstance(value, Undefined):
            if len(path.path) > 1:
                parent = Path(path.token, path.path[:-1]).evaluate(render_context)
                if isinstance(parent, Mapping) and not isinstance(parent, Undefined):
                    return None
            raise UndefinedError(value.msg, token=path.token)
    except Exception as err:
        raise ExpressionError(_describe(err)) from err
    if isinstance(value, (dict, list)):
        return copy.deepcopy(value)
    if isinstance(value, tuple):
        return copy.deepcopy(list(value))
    if value == "":
        return None
    return value


def _mask_leaf(source: str, context: Mapping[str, object]) -> object:
    compiled = _get_compiled(source)
    if compiled.path is not None:
        return _resolve_path(compiled, context)
    try:
        with _budget():
            output = compiled.template.render(context)
    except Exception as err:
        raise ExpressionError(_describe(err)) from err
    return output if output != "" else None


def _child_path(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(str(key))}]"


def _apply(node: object, context: Mapping[str, object], where: str, depth: int) -> object:
    if depth > MAX_MASK_DEPTH:
        raise ExpressionError(f"{where}: mask is nested deeper than {MAX_MASK_DEPTH} levels")
    if isinstance(node, str):
        try:
            return _mask_leaf(node, context)
        except ExpressionError as err:
            raise ExpressionError(f"{where}: {err}") from err
    if isinstance(node, Mapping):
        return {key: _apply(value, context, _child_path(where, key), depth + 1) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_apply(value, context, _child_path(where, i), depth + 1) for i, value in enumerate(node)]
    if node is None or isinstance(node, (bool, int, float)):
        return node
    raise ExpressionError(f"{where}: unsupported mask value of type {type(node).__name__}")


def apply_mask(mask: object, context: dict) -> object:
    """Render a mask against ``context`` and return the masked value.

    A mask is any JSON value mirroring the token data: each string leaf is an expression rendered
    with ``context``; objects and arrays are walked recursively (the result has the same shape);
    numbers, booleans and None are returned as they are. Types are kept: a leaf that is exactly
    one output of a variable path with no filters (``"{{ data.expiration_month }}"``) returns the
    value itself (an int stays an int, an object a copy of the object), and None when that key is
    absent from an existing object (an optional field that was not given). A leaf rendering to the
    empty string becomes None.

    Raises ExpressionError (message prefixed with the leaf's location, e.g. ``mask.number: ...``)
    when a leaf fails to parse or render, the mask nests deeper than :data:`MAX_MASK_DEPTH` or
    holds a value that is not JSON.
    """
    return _apply(mask, _check_context(context), "mask", 0)


def _collect(node: object, where: str, depth: int, problems: list[str]) -> None:
    if depth > MAX_MASK_DEPTH:
        problems.append(f"{where}: mask is nested deeper than {MAX_MASK_DEPTH} levels")
        return
    if isinstance(node, str):
        try:
            validate_expression(node)
        except ExpressionError as err:
            problems.append(f"{where}: {err}")
    elif isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                problems.append(f"{_child_path(where, key)}: object keys must be strings")
                continue
            _collect(value, _child_path(where, key), depth + 1, problems)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            _collect(value, _child_path(where, index), depth + 1, problems)
    elif not (node is None or isinstance(node, (bool, int, float))):
        problems.append(f"{where}: unsupported mask value of type {type(node).__name__}")


def validate_mask(mask: object) -> list[str]:
    """Check every string leaf of ``mask`` with :func:`validate_expression` without rendering.

    Returns a list of problems, each ``"<location>: <message>"`` with locations such as
    ``mask``, ``mask.number`` or ``mask.items[0]``; an empty list when the mask is fine. Also
    reports non-string object keys, values that are not JSON and nesting deeper than
    :data:`MAX_MASK_DEPTH`. Never raises.
    """
    problems: list[str] = []
    _collect(mask, "mask", 0, problems)
    return problems
