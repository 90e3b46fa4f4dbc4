"""Card numbers where none belongs: the Luhn check, and a test for a string that holds a card number
(a client-chosen id, a log value). The card rules themselves are :mod:`domain.tokens.cards`."""

from __future__ import annotations

import re

#: A run of 13 to 19 digits standing alone (not inside a word or a longer number): how a PAN appears.
_STANDALONE_DIGITS = re.compile(r"(?<![0-9A-Za-z])[0-9]{13,19}(?![0-9A-Za-z])")


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) check of a string of ASCII digits."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if index % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def holds_card_number(text: str) -> bool:
    """True when ``text`` holds a standalone Luhn-valid run of 13 to 19 digits (a UUID never does)."""
    return any(luhn_valid(match.group(0)) for match in _STANDALONE_DIGITS.finditer(text))
