"""The platform's Liquid filters for token expressions (masks, fingerprints, search indexes, the proxy).

Each filter is a plain function ``(value, *arguments) -> value``; :data:`FILTERS` names them for the
environment (``domain.tokens.engine.build_environment`` wraps each in its guards). A filter refuses
bad input with Liquid's ``FilterValueError`` / ``FilterArgumentError``, which a render reports as
``domain.tokens.errors.ExpressionError``; messages name the filter and the rule, never the data.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping
from functools import lru_cache

import jsonpath
from liquid.exceptions import FilterArgumentError, FilterValueError
from liquid.undefined import Undefined

from domain.tokens.cards import mask_pan
from domain.tokens.engine import MAX_OUTPUT_SIZE, undefined_error

MAX_JSON_PATH_LENGTH = 1024
"""Longest path accepted by the ``json`` filter."""

MASK_CHAR = "X"
"""The character masking filters put in place of a hidden one."""


# ---- helpers -------------------------------------------------------------------------------------


def _text(value: object, filter_name: str) -> str | None:
    """Coerce a filter's input to text: None stays None, numbers and bools become strings."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    raise FilterValueError(f"{filter_name}: expected a string or a number, found {type_name(value)}", token=None)


def type_name(value: object) -> str:
    """How a value's type is named in messages: ``an object``, ``an array`` or the Python type's name."""
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


# ---- filters -------------------------------------------------------------------------------------


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
        raise undefined_error(value, value.token)
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
        raise FilterValueError(f"card_exp: expected a card object, found {type_name(card)}", token=None)
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
        raise FilterValueError(f"to_number: expected a string or a number, found {type_name(value)}", token=None)
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


FILTERS: dict[str, Callable[..., object]] = {
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
