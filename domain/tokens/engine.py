"""The Liquid environment expressions run in: python-liquid 2, locked down for callers' expressions.

* an undefined variable is an error (``{{ data.nope }}`` raises), except that it may be tested for
  truthiness (``{% if data.cvc %}``) and replaced with the ``default`` filter;
* an unknown filter is an error (``strict_filters``);
* no template loader, no ``include``/``render`` tags and no template inheritance tags;
* resource limits: output size (:data:`MAX_OUTPUT_SIZE`), loop iterations
  (:data:`MAX_LOOP_ITERATIONS`), ``assign``/``capture`` bytes (:data:`MAX_LOCAL_NAMESPACE`), the size
  of any intermediate string a filter produces, the length of ranges a filter may expand, and the
  total work filters may do in one render (:data:`MAX_FILTER_WORK`, see :func:`work_budget`).

The one environment, built with the platform's filters (``domain.tokens.filters``), is
``domain.tokens.expressions.environment``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps
from typing import Any

from liquid import Environment
from liquid.exceptions import FilterValueError, TemplateNotFoundError, UndefinedError
from liquid.undefined import FalsyStrictUndefined, StrictUndefined, Undefined

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


class _Undefined(FalsyStrictUndefined):
    """Strict undefined: output, filters and comparisons raise; ``if`` and ``default`` work."""

    force_liquid_default = True


def undefined_error(value: Undefined, token: Any) -> UndefinedError:
    """The error of using the undefined ``value`` where a value is needed, at ``token`` (None when
    unknown). The environment's undefined is strict, so its message names the missing variable."""
    message = value.msg if isinstance(value, StrictUndefined) else f"'{value.name}' is undefined"
    return UndefinedError(message, token=token)


class _ExpressionEnvironment(Environment):
    """Environment with resource limits and no way to load other templates."""

    output_stream_limit = MAX_OUTPUT_SIZE
    loop_iteration_limit = MAX_LOOP_ITERATIONS
    local_namespace_limit = MAX_LOCAL_NAMESPACE
    context_depth_limit = 30
    block_nesting_limit = 30

    def get_template(self, name: str, **kwargs: object) -> Any:
        """Refuse to load templates: expressions are self-contained."""
        raise TemplateNotFoundError("loading templates is not allowed in expressions", token=None)

    async def get_template_async(self, name: str, **kwargs: object) -> Any:
        """Refuse to load templates: expressions are self-contained."""
        raise TemplateNotFoundError("loading templates is not allowed in expressions", token=None)


# ---- guards around every filter: strict undefined, range expansion, result size and work --------

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
        raise undefined_error(value, value.token)
    if isinstance(value, range) and len(value) > MAX_LOOP_ITERATIONS:
        raise FilterValueError(
            f"{name}: range of {len(value)} items exceeds the limit of {MAX_LOOP_ITERATIONS}", token=None
        )
    if isinstance(value, str) and len(value) > MAX_OUTPUT_SIZE:
        raise FilterValueError(f"{name}: string exceeds the size limit of {MAX_OUTPUT_SIZE} characters", token=None)


_work_budget: ContextVar[list[int] | None] = ContextVar("expression_work_budget", default=None)


@contextmanager
def work_budget() -> Iterator[None]:
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


def build_environment(filters: Mapping[str, Callable[..., object]]) -> Environment:
    """A locked-down Liquid environment: strict undefined and filters, no template loading and no
    ``include``/``render``/inheritance tags, the limits of this module, and ``filters`` (name ->
    function) added to Liquid's own; every filter is wrapped by the guards (operand, result and work
    limits)."""
    env = _ExpressionEnvironment(undefined=_Undefined, strict_filters=True, autoescape=False)
    for tag in ("include", "render", "extends", "block", "macro", "call", "with", "translate"):
        env.tags.pop(tag, None)
    for name, func in filters.items():
        env.add_filter(name, func)
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard(name, func)
    return env
