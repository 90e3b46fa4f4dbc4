"""What must never reach a log line: card numbers, CVCs, API keys, webhook signing secrets, private keys.

:func:`find_secrets` names each match (masked, so a failure report does not repeat the secret).
"""

from __future__ import annotations

import re

# A run of 13 to 19 digits standing alone (not part of a longer word or a decimal), starting like a
# card number does (2-6: Mastercard 2-series, Amex/Diners/JCB, Visa, Mastercard, Discover/UnionPay).
_PAN = re.compile(r"(?<![0-9A-Za-z.])[2-6][0-9]{12,18}(?![0-9A-Za-z])")
# The same, written in groups of four with spaces or dashes.
_GROUPED_PAN = re.compile(r"(?<![0-9A-Za-z.])[2-6][0-9]{3}([ -])[0-9]{4}\1[0-9]{4}\1[0-9]{1,7}(?![0-9A-Za-z])")
# Tessera API keys: "key_" and 32 random bytes in base64url (43 characters).
_API_KEY = re.compile(r"key_[A-Za-z0-9_-]{40,}")
# Standard Webhooks signing secrets.
_WEBHOOK_SECRET = re.compile(r"whsec_[A-Za-z0-9+/=]{16,}")
# A private key in PEM (RSA, EC, PKCS#8, encrypted or not).
_PRIVATE_KEY = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")
# A verification code next to its name: cvc=123, "cvv": "1234", card_verification_code: 321.
_CVC = re.compile(
    r"(?i)(?<![A-Za-z])(?:cvc2?|cvv2?|cid|card_?verification_?code|security_?code)(?![A-Za-z])"
    r"[\"'\s:=]{1,6}[0-9]{3,4}(?![0-9])"
)

#: The sandbox and test card numbers the suite uses (any Luhn-valid number is caught anyway).
TEST_CARDS = frozenset(
    {
        "4242424242424242",
        "5555555555554444",
        "378282246310005",
        "4012888888881881",
        "3566002020360505",
        "6011111111111117",
        "4000056655665556",
        "2223003122003222",
        "5105105105105100",
        "4000000000001018",
        "4000000000001026",
        "4000000000001010",
    }
)


def luhn_valid(digits: str) -> bool:
    """The Luhn check of a string of digits."""
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _mask(secret: str) -> str:
    return secret[:6] + "…" + secret[-2:] if len(secret) > 10 else secret[:2] + "…"


def redact(text: str) -> str:
    """``text`` with every secret :func:`find_secrets` would name masked (for failure reports)."""

    def card(match: re.Match) -> str:
        number = re.sub(r"[ -]", "", match.group(0))
        return _mask(number) if number in TEST_CARDS or luhn_valid(number) else match.group(0)

    text = _GROUPED_PAN.sub(card, _PAN.sub(card, text))
    text = _API_KEY.sub(lambda m: _mask(m.group(0)), text)
    text = _WEBHOOK_SECRET.sub(lambda m: _mask(m.group(0)), text)
    text = _PRIVATE_KEY.sub("-----BEGIN … PRIVATE KEY-----", text)
    return _CVC.sub(lambda m: m.group(0)[:4] + "…", text)


def find_secrets(text: str) -> list[str]:
    """Each secret found in ``text``, as ``"kind: masked value"``."""
    found = []
    for match in _PAN.finditer(text):
        number = match.group(0)
        if number in TEST_CARDS or luhn_valid(number):
            found.append(f"card number: {_mask(number)}")
    for match in _GROUPED_PAN.finditer(text):
        number = re.sub(r"[ -]", "", match.group(0))
        if 13 <= len(number) <= 19 and luhn_valid(number):
            found.append(f"card number: {_mask(number)}")
    found += [f"API key: {_mask(m.group(0))}" for m in _API_KEY.finditer(text)]
    found += [f"webhook secret: {_mask(m.group(0))}" for m in _WEBHOOK_SECRET.finditer(text)]
    found += [f"CVC: {m.group(0)[:4]}…" for m in _CVC.finditer(text)]
    found += ["private key: PEM" for _ in _PRIVATE_KEY.finditer(text)]
    return found
