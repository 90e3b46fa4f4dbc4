"""Card and bank account data rules: Luhn, brands, masking and validation of token data.

Token data of type ``card`` is ``{number, expiration_month, expiration_year, cvc, name}`` (core spec,
"Token"); token data of type ``bank`` is ``{routing_number, account_number}``. The validators
return normalised data plus an error map keyed by property path (``data.number``), the shape
:class:`infra.errors.Problem` answers as a validation problem. Nothing here logs or echoes the
sensitive values: error messages describe the rule that failed, never the value.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, TypeGuard

__all__ = [
    "DEFAULT_FINGERPRINT_EXPRESSIONS",
    "MAX_NAME_LENGTH",
    "aba_checksum_valid",
    "bin_of",
    "card_brand",
    "default_bank_mask",
    "default_card_mask",
    "last4",
    "luhn_valid",
    "mask_card_numbers",
    "mask_pan",
    "validate_bank",
    "validate_card",
    "without_cvc",
]

MAX_NAME_LENGTH = 200
"""Longest cardholder name accepted in ``data.name``."""

MIN_PAN_LENGTH = 12
MAX_PAN_LENGTH = 19
MASK_CHAR = "X"

DEFAULT_FINGERPRINT_EXPRESSIONS: dict[str, str] = {
    "card": "{{ data.number }}",
    "bank": "{{ data.routing_number }}|{{ data.account_number }}",
    "token": "{{ data | stringify }}",
}
"""Fingerprint expression used per token type when the request gives none."""

_CARD_KEYS = ("number", "expiration_month", "expiration_year", "cvc", "name")
_BANK_KEYS = ("routing_number", "account_number")

# Brand prefixes as inclusive ranges over the first ``len(low)`` digits, checked in order: the
# first match wins, so the narrow ranges come before the broad ones they overlap (Discover's
# 6011/644-649/65 before UnionPay's 62 and Maestro's 6x).
_BRAND_RANGES: tuple[tuple[str, str, str], ...] = (
    ("amex", "34", "34"),
    ("amex", "37", "37"),
    ("visa", "4", "4"),
    ("mastercard", "51", "55"),
    ("mastercard", "2221", "2720"),
    ("discover", "6011", "6011"),
    ("discover", "644", "649"),
    ("discover", "65", "65"),
    ("jcb", "3528", "3589"),
    ("diners", "300", "305"),
    ("diners", "3095", "3095"),
    ("diners", "36", "36"),
    ("diners", "38", "39"),
    ("unionpay", "62", "62"),
    ("maestro", "50", "50"),
    ("maestro", "56", "59"),
    ("maestro", "63", "63"),
    ("maestro", "67", "67"),
)


def _is_ascii_digits(value: object) -> bool:
    """True when ``value`` is a non-empty ``str`` of ASCII digits only (``str.isdigit`` accepts ``²``)."""
    return isinstance(value, str) and value.isascii() and value.isdigit()


def _is_int(value: object) -> TypeGuard[int]:
    """True for real integers; ``bool`` is a subclass of ``int`` but is not a number here."""
    return isinstance(value, int) and not isinstance(value, bool)


def luhn_valid(number: str) -> bool:
    """Return True when ``number`` passes the Luhn (mod 10) check.

    ``number`` must be a string of at least two ASCII digits; anything else (empty, spaces,
    dashes, non-strings) returns False rather than raising.
    """
    if not _is_ascii_digits(number) or len(number) < 2:
        return False
    total = 0
    for position, char in enumerate(reversed(number)):
        digit = ord(char) - 48
        if position % 2 == 1:
            digit *= 2
            if digit > 9:
                digit -= 9
        total += digit
    return total % 10 == 0


def card_brand(number: str) -> str | None:
    """Return the card brand of a primary account number from its leading digits.

    Returns one of ``visa``, ``mastercard``, ``amex``, ``discover``, ``jcb``, ``diners``,
    ``unionpay``, ``maestro``, or None when the prefix is unknown or ``number`` is not a string of
    ASCII digits. Only the prefix is examined; length and Luhn are not checked here.
    """
    if not _is_ascii_digits(number):
        return None
    for brand, low, high in _BRAND_RANGES:
        width = len(low)
        if len(number) >= width and low <= number[:width] <= high:
            return brand
    return None


def bin_of(number: str, length: int = 6) -> str:
    """Return the bank identification number: the first ``length`` digits of ``number``.

    Returns the whole number when it is shorter than ``length``. Raises ValueError when
    ``length`` is not a positive integer or ``number`` is not a string of ASCII digits.
    """
    if not _is_int(length) or length < 1:
        raise ValueError("length must be a positive integer")
    if not _is_ascii_digits(number):
        raise ValueError("number must be a string of digits")
    return number[:length]


def last4(number: str) -> str:
    """Return the last four characters of ``number`` (all of it when shorter).

    Raises ValueError when ``number`` is not a string.
    """
    if not isinstance(number, str):
        raise ValueError("number must be a string")
    return number[-4:]


def mask_pan(number: str) -> str:
    """Mask a card number for display, keeping its length.

    * 13 characters or more: the first six and last four stay, the rest become ``X``
      (``4111111111111111`` -> ``411111XXXXXX1111``);
    * 5 to 12 characters: only the last four stay (``123456789`` -> ``XXXXX6789``);
    * 4 characters or fewer: everything is masked, since "the last four" would be all of it.

    Works on any string (characters are not required to be digits). Raises ValueError when
    ``number`` is not a string.
    """
    if not isinstance(number, str):
        raise ValueError("number must be a string")
    size = len(number)
    if size >= 13:
        return number[:6] + MASK_CHAR * (size - 10) + number[-4:]
    if size > 4:
        return MASK_CHAR * (size - 4) + number[-4:]
    return MASK_CHAR * size


_DIGIT_RUN = re.compile(r"(?<![0-9])[0-9]{13,19}(?![0-9])")


def mask_card_numbers(text: str) -> str:
    """``text`` with every standalone run of 13 to 19 digits that passes the Luhn check masked by
    :func:`mask_pan` (``4242424242424242`` -> ``424242XXXXXX4242``). For text a client sent that is
    echoed back (a problem's ``instance`` or a refused value), so no card number is repeated."""
    return _DIGIT_RUN.sub(lambda m: mask_pan(m.group(0)) if luhn_valid(m.group(0)) else m.group(0), text)


def default_card_mask() -> dict[str, str]:
    """Return the default mask templates of a ``card`` token (a new dict on every call).

    The masked view shows the masked number and the expiration; ``name`` and ``cvc`` are left out.
    """
    return {
        "number": "{{ data.number | card_mask }}",
        "expiration_month": "{{ data.expiration_month }}",
        "expiration_year": "{{ data.expiration_year }}",
    }


def default_bank_mask() -> dict[str, str]:
    """Return the default mask templates of a ``bank`` token (a new dict on every call).

    The routing number is public information and stays; the account number keeps its last four.
    """
    return {
        "routing_number": "{{ data.routing_number }}",
        "account_number": "{{ data.account_number | reveal_last: 4 }}",
    }


def without_cvc(kind: str, data: Any) -> Any:
    """``data`` without its ``cvc`` when it is a card's (a new dict); other data as it is. A card's
    ``cvc`` is never answered and is kept only ``cvc_retention_seconds`` (core spec, "Token")."""
    if kind == "card" and isinstance(data, dict) and "cvc" in data:
        return {k: v for k, v in data.items() if k != "cvc"}
    return data


def _add(errors: dict[str, list[str]], path: str, message: str) -> None:
    errors.setdefault(path, []).append(message)


def _unknown_keys(data: dict, allowed: tuple[str, ...], prefix: str, errors: dict[str, list[str]]) -> None:
    for key in data:
        if key not in allowed:
            _add(errors, f"{prefix}.{key}", f"'{key}' is not an allowed field; allowed: {', '.join(allowed)}")


def _check_digits(
    value: object,
    path: str,
    errors: dict[str, list[str]],
    *,
    min_len: int,
    max_len: int,
) -> bool:
    """Record an error unless ``value`` is a string of ``min_len``..``max_len`` ASCII digits."""
    if not isinstance(value, str):
        _add(errors, path, "must be a string")
        return False
    if not _is_ascii_digits(value):
        _add(errors, path, "must contain digits only (no spaces, dashes or other characters)")
        return False
    if not min_len <= len(value) <= max_len:
        if min_len == max_len:
            _add(errors, path, f"must be exactly {min_len} digits")
        else:
            _add(errors, path, f"must be {min_len} to {max_len} digits long")
        return False
    return True


def validate_card(
    data: object,
    *,
    today: datetime.date,
    prefix: str = "data",
    check_expiry: bool = True,
) -> tuple[dict | None, dict[str, list[str]]]:
    """Validate the data of a ``card`` token.

    ``data`` must be an object with the keys:

    * ``number`` (required): a string of 12 to 19 ASCII digits that passes the Luhn check;
      spaces, dashes and other separators are rejected, not stripped;
    * ``expiration_month``: integer 1-12 and ``expiration_year``: four-digit integer, given
      together or not at all; when given and ``check_expiry`` is true, the card must not be expired
      on ``today`` (a card is valid through the last day of its expiration month). Vaulting passes
      ``check_expiry=False``: an expired card is a valid card to store (the account updater exists for
      exactly those cards), only its form is checked;
    * ``cvc``: a string of 3 or 4 digits; a JSON integer (not a boolean) is taken as its digits
      (``123`` -> ``"123"``) and stored as a string, as existing client libraries send it;
    * ``name``: a string of at most 200 characters.

    ``bool`` values are never accepted as integers. An optional key whose value is ``null``
    (None) is treated as absent. Any other key is an error on ``<prefix>.<key>``.

    Returns ``(normalised, errors)``: ``normalised`` holds only the keys given (None values
    dropped) and is None when ``errors`` is not empty; ``errors`` maps a property path such as
    ``data.number`` (or ``prefix`` itself when ``data`` is not an object) to a list of messages.
    Never raises for bad input.
    """
    errors: dict[str, list[str]] = {}
    if not isinstance(data, dict):
        _add(errors, prefix, "must be an object")
        return None, errors

    _unknown_keys(data, _CARD_KEYS, prefix, errors)
    result: dict = {}

    number = data.get("number")
    path = f"{prefix}.number"
    if number is None:
        _add(errors, path, "is required")
    elif _check_digits(number, path, errors, min_len=MIN_PAN_LENGTH, max_len=MAX_PAN_LENGTH):
        if luhn_valid(number):
            result["number"] = number
        else:
            _add(errors, path, "is not a valid card number (Luhn check failed)")

    month = data.get("expiration_month")
    year = data.get("expiration_year")
    month_path = f"{prefix}.expiration_month"
    year_path = f"{prefix}.expiration_year"
    month_ok = year_ok = False
    if month is not None:
        if not _is_int(month):
            _add(errors, month_path, "must be an integer")
        elif not 1 <= month <= 12:
            _add(errors, month_path, "must be between 1 and 12")
        else:
            month_ok = True
    if year is not None:
        if not _is_int(year):
            _add(errors, year_path, "must be an integer")
        elif not 1000 <= year <= 9999:
            _add(errors, year_path, "must be a four-digit year")
        else:
            year_ok = True
    if month is not None and year is None:
        _add(errors, year_path, "is required when expiration_month is given")
    elif year is not None and month is None:
        _add(errors, month_path, "is required when expiration_year is given")
    elif month_ok and year_ok:
        if check_expiry and (year, month) < (today.year, today.month):
            message = f"card expired (valid through {month:02d}/{year})"
            _add(errors, month_path, message)
            _add(errors, year_path, message)
        else:
            result["expiration_month"] = month
            result["expiration_year"] = year

    cvc = data.get("cvc")
    if _is_int(cvc) and cvc >= 0:
        cvc = str(cvc)
    if cvc is not None and _check_digits(cvc, f"{prefix}.cvc", errors, min_len=3, max_len=4):
        result["cvc"] = cvc

    name = data.get("name")
    if name is not None:
        if not isinstance(name, str):
            _add(errors, f"{prefix}.name", "must be a string")
        elif len(name) > MAX_NAME_LENGTH:
            _add(errors, f"{prefix}.name", f"must be at most {MAX_NAME_LENGTH} characters")
        else:
            result["name"] = name

    if errors:
        return None, errors
    return result, errors


def aba_checksum_valid(routing_number: str) -> bool:
    """Return True when a 9-digit ABA routing number has a valid check digit.

    The weighted sum ``3*(d1+d4+d7) + 7*(d2+d5+d8) + (d3+d6+d9)`` must be a multiple of 10.
    Anything other than a string of exactly nine ASCII digits returns False.
    """
    if not _is_ascii_digits(routing_number) or len(routing_number) != 9:
        return False
    digits = [ord(c) - 48 for c in routing_number]
    weights = (3, 7, 1) * 3
    return sum(d * w for d, w in zip(digits, weights, strict=True)) % 10 == 0


def validate_bank(data: object, *, prefix: str = "data") -> tuple[dict | None, dict[str, list[str]]]:
    """Validate the data of a ``bank`` token.

    ``data`` must be an object with ``routing_number`` (required: a string of 9 digits with a
    valid ABA check digit) and ``account_number`` (required: a string of 4 to 17 digits); any
    other key is an error on ``<prefix>.<key>``.

    Returns ``(normalised, errors)`` with the same conventions as :func:`validate_card`:
    ``normalised`` is None when ``errors`` is not empty. Never raises for bad input.
    """
    errors: dict[str, list[str]] = {}
    if not isinstance(data, dict):
        _add(errors, prefix, "must be an object")
        return None, errors

    _unknown_keys(data, _BANK_KEYS, prefix, errors)
    result: dict = {}

    routing = data.get("routing_number")
    path = f"{prefix}.routing_number"
    if routing is None:
        _add(errors, path, "is required")
    elif _check_digits(routing, path, errors, min_len=9, max_len=9):
        if aba_checksum_valid(routing):
            result["routing_number"] = routing
        else:
            _add(errors, path, "is not a valid ABA routing number (check digit mismatch)")

    account = data.get("account_number")
    path = f"{prefix}.account_number"
    if account is None:
        _add(errors, path, "is required")
    elif _check_digits(account, path, errors, min_len=4, max_len=17):
        result["account_number"] = account

    if errors:
        return None, errors
    return result, errors
