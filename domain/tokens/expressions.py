"""Token expressions: Liquid templates for token fingerprints, masks and search indexes.

An expression is a Liquid template (python-liquid 2) rendered against the context
``{"data": <token data>, "metadata": {...}, "type": "<token type>"}`` (see :func:`make_context`).
Expressions come from API callers, so they are parsed and rendered in the one locked-down
:data:`environment` (``domain.tokens.engine``: strict undefined and filters, no template loading,
output, loop and work limits) with the platform's filters (``domain.tokens.filters``). This module
parses (reading a stray comma before a filter name as the pipe it was meant to be), caches, renders
and evaluates expressions, and applies masks; its limits are the template length
(:data:`MAX_TEMPLATE_LENGTH`) and the nesting of masks (:data:`MAX_MASK_DEPTH`).

Every failure surfaces as :class:`domain.tokens.errors.ExpressionError` with a readable message that
names the rule, never the token data.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, NamedTuple

from liquid import Environment, RenderContext
from liquid.builtin.expressions import FilteredExpression, Path
from liquid.builtin.expressions.arguments import KeywordArgument, PositionalArgument
from liquid.builtin.output import OutputNode
from liquid.exceptions import LiquidError
from liquid.undefined import Undefined

from domain.tokens.engine import MAX_OUTPUT_SIZE, build_environment, undefined_error, work_budget
from domain.tokens.errors import ExpressionError
from domain.tokens.filters import FILTERS, type_name

__all__ = [
    "MAX_MASK_DEPTH",
    "MAX_TEMPLATE_LENGTH",
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

MAX_MASK_DEPTH = 64
"""Deepest nesting of objects and arrays accepted in a mask."""

TEMPLATE_CACHE_SIZE = 1024
"""Parsed templates kept in the LRU cache."""

environment: Environment = build_environment(FILTERS)
"""The one environment every expression is parsed and rendered with."""


# ---- parsing, caching and rendering --------------------------------------------------------------


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
        for applied in node.expression.filters or ():
            for argument in applied.args:
                name: str | None
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
            if attempt is None or not isinstance(index, int):  # _comma_as_pipe needs an index
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
        raise ExpressionError(f"an expression must be a string, not {type_name(source)}")
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


def render(template: str, context: Mapping[str, object]) -> str:
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
        with work_budget():
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
        with work_budget():
            value = nodes[0].expression.evaluate(render_context)
        if isinstance(value, Undefined):
            raise undefined_error(value, None)
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


# ---- masks ---------------------------------------------------------------------------------------


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
            raise undefined_error(value, path.token)
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
        with work_budget():
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
