"""Cards as the simulated providers see them: validation, PAR, network token numbers, profiles.

Brand rules are the platform's own (:func:`domain.tokens.cards.card_brand`), so the sandbox and Tessera
agree on which card is which. The Luhn check is a faster equivalent of
:func:`domain.tokens.cards.luhn_valid` (0.4 us instead of 1 us a number), since the account updater runs it
on every row of its batches. Everything a provider says about a card beyond its number (funding,
issuer, colours) comes from the brand profile: the sandbox has one issuer, in the United States.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeGuard

from domain.tokens.cards import card_brand
from sandbox.replies import require_valid

MIN_PAN_LENGTH = 12
MAX_PAN_LENGTH = 19

_PAR_KEY = b"tessera-sandbox/payment-account-reference/v1"
_PAR_PREFIX = "SBX1"
_PAR_LENGTH = 29

_NETWORK_TOKEN_PREFIXES = {"visa": "489537", "mastercard": "520473"}
_NETWORK_TOKEN_LENGTH = 16

# Each digit's contribution when doubled by the Luhn check (2*d, minus 9 above 9), as a digit.
_LUHN_DOUBLED = str.maketrans("0123456789", "0246813579")


def luhn_valid(digits: str) -> bool:
    """True when ``digits`` (a string of ASCII digits, unchecked) passes the Luhn check."""
    # sum() over the ASCII codes adds 48 per digit, hence the correction.
    undoubled = digits[-1::-2].encode()
    doubled = digits[-2::-2].translate(_LUHN_DOUBLED).encode()
    return (sum(undoubled) + sum(doubled) - 48 * len(digits)) % 10 == 0


def is_pan(value: object) -> bool:
    """True for a string of 12 to 19 ASCII digits that passes the Luhn check."""
    return (
        isinstance(value, str)
        and MIN_PAN_LENGTH <= len(value) <= MAX_PAN_LENGTH
        and _is_digits(value)
        and luhn_valid(value)
    )


def brand_of(pan: str) -> str:
    """The brand of a card number (``visa``, ``mastercard``, ``amex``, ``jcb`` ...), ``unknown`` if none."""
    return card_brand(pan) or "unknown"


def card_bin(number: str) -> str:
    """The bank identification number: the first 8 digits of a 16+ digit number, else the first 6."""
    return number[:8] if len(number) >= 16 else number[:6]


def payment_account_reference(pan: str) -> str:
    """The 29-character payment account reference of a card number.

    Derived from the number alone (HMAC-SHA256 under a fixed sandbox key, base32), so the same
    card always has the same PAR, across network tokens and server restarts; it never contains
    the number. Format: ``SBX1`` followed by 25 characters of ``A-Z2-7``.
    """
    digest = hmac.new(_PAR_KEY, pan.encode(), hashlib.sha256).digest()
    return (_PAR_PREFIX + base64.b32encode(digest).decode())[:_PAR_LENGTH]


def network_token_number(pan: str, brand: str) -> str:
    """A fresh random DPAN for a ``visa`` or ``mastercard`` card: 16 Luhn-valid digits, not ``pan``.

    Raises KeyError for any other brand.
    """
    prefix = _NETWORK_TOKEN_PREFIXES[brand]
    free = _NETWORK_TOKEN_LENGTH - len(prefix) - 1
    while True:
        body = prefix + f"{secrets.randbelow(10**free):0{free}d}"
        number = body + luhn_check_digit(body)
        if number != pan:
            return number


def luhn_check_digit(body: str) -> str:
    """The digit that makes ``body`` + digit pass the Luhn check."""
    return next(digit for digit in "0123456789" if luhn_valid(body + digit))


class CardRef(NamedTuple):
    """How the sandbox files requests and resources by card: its PAR and the number's last four."""

    par: str
    last4: str

    @classmethod
    def of(cls, pan: object) -> CardRef | None:
        """The reference of a card number; None unless ``pan`` is a string of ASCII digits."""
        if not (isinstance(pan, str) and _is_digits(pan)):
            return None
        return cls(payment_account_reference(pan), pan[-4:])


class CardFilter(NamedTuple):
    """Admin query filter on cards: every given criterion must hold (no criterion: all match)."""

    par: str | None
    last4: str | None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> CardFilter:
        """Read the query parameters ``par``, ``pan_last4`` and ``pan`` (a number, turned into its PAR).

        Raises :class:`~sandbox.replies.SandboxError` 400 when ``pan_last4`` is not four digits,
        or when ``par`` and ``pan`` are both given and disagree.
        """
        par, last4, pan = query.get("par"), query.get("pan_last4"), query.get("pan")
        errors = {}
        if last4 is not None and not (len(last4) == 4 and _is_digits(last4)):
            errors["pan_last4"] = "must be four digits"
        if pan is not None:
            pan_par = payment_account_reference(pan)
            if par not in (None, pan_par):
                errors["pan"] = "names another card than par"
            par = pan_par
        require_valid(errors)
        return cls(par, last4)

    def matches(self, card: CardRef | None) -> bool:
        """True when ``card`` meets every criterion; a None card meets only the empty filter."""
        if card is None:
            return self.par is None and self.last4 is None
        return self.par in (None, card.par) and self.last4 in (None, card.last4)


@dataclass(frozen=True)
class Card:
    """A validated card of a request: number, expiration and the facts derived from the number."""

    pan: str
    expiration_month: int
    expiration_year: int

    @property
    def brand(self) -> str:
        """See :func:`brand_of`."""
        return brand_of(self.pan)

    @property
    def last4(self) -> str:
        """The last four digits of the number."""
        return self.pan[-4:]

    @property
    def ref(self) -> CardRef:
        """See :class:`CardRef`."""
        return CardRef(payment_account_reference(self.pan), self.last4)

    @classmethod
    def from_body(cls, body: Mapping[str, Any], other_errors: Mapping[str, str] | None = None) -> Card:
        """The card of a request body ``{pan, expiration_month, expiration_year, cvc?}``.

        ``pan``: string of 12 to 19 digits passing the Luhn check; ``expiration_month``: integer
        1-12; ``expiration_year``: four-digit integer, the month not before the current UTC month;
        ``cvc``: optional string of 3 or 4 digits. Booleans are not integers. Raises
        :class:`~sandbox.replies.SandboxError` 400 ``invalid_request`` listing every failing
        field, the card's and those of ``other_errors`` (field path -> message) of the caller.
        """
        today = datetime.datetime.now(datetime.UTC).date()
        require_valid({**card_errors(body, today), **(other_errors or {})})
        return cls(body["pan"], body["expiration_month"], body["expiration_year"])


def card_errors(body: Mapping[str, Any], today: datetime.date) -> dict[str, str]:
    """Field path -> message for each card field of ``body`` breaking :meth:`Card.from_body`'s rules."""
    errors = {}
    pan, month, year, cvc = (body.get(name) for name in ("pan", "expiration_month", "expiration_year", "cvc"))
    if not (isinstance(pan, str) and MIN_PAN_LENGTH <= len(pan) <= MAX_PAN_LENGTH and _is_digits(pan)):
        errors["pan"] = f"must be a string of {MIN_PAN_LENGTH} to {MAX_PAN_LENGTH} digits"
    elif not is_pan(pan):
        errors["pan"] = "is not a valid card number (Luhn check failed)"
    if not (_is_int(month) and 1 <= month <= 12):
        errors["expiration_month"] = "must be an integer from 1 to 12"
    if not (_is_int(year) and 1000 <= year <= 9999):
        errors["expiration_year"] = "must be a four-digit integer"
    elif "expiration_month" not in errors and (year, month) < (today.year, today.month):
        errors["expiration_year"] = "the card has expired"
    if cvc is not None and not (isinstance(cvc, str) and len(cvc) in (3, 4) and _is_digits(cvc)):
        errors["cvc"] = "must be a string of 3 or 4 digits"
    return errors


def _is_digits(text: str) -> bool:
    """True when ``text`` is non-empty and all ASCII digits (``str.isdigit`` alone accepts ``²``)."""
    return text.isascii() and text.isdigit()


def _is_int(value: object) -> TypeGuard[int]:
    """True for integers other than booleans."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BrandProfile:
    """What the simulated networks tell about every card of a brand."""

    name: str
    funding: str
    segment: str
    product_code: str
    background_color: str
    foreground_color: str


ISSUER_NAME = "Tessera Sandbox Bank"
_ISSUER = {"name": ISSUER_NAME, "country": "US"}
_ISSUER_COUNTRY = {"alpha2": "US", "name": "United States of America", "numeric": "840"}

PROFILES = {
    "visa": BrandProfile("Visa", "credit", "Consumer", "A", "#1A1F71", "#FFFFFF"),
    "mastercard": BrandProfile("Mastercard", "credit", "Consumer", "MCS", "#000000", "#FFFFFF"),
    "amex": BrandProfile("American Express", "credit", "Consumer", "AX", "#2E77BB", "#FFFFFF"),
}
"""Profiles of the brands some simulated provider accepts (visa, mastercard, amex)."""


def describe_card(number: str, brand: str) -> dict[str, Any]:
    """The card details a provider returns for ``number`` of ``brand`` (a key of :data:`PROFILES`).

    ``{brand, bin, last4, funding, segment, product: {code}, issuer: {name, country},
    issuer_country: {alpha2, name, numeric}}``.
    """
    profile = PROFILES[brand]
    return {
        "brand": brand,
        "bin": card_bin(number),
        "last4": number[-4:],
        "funding": profile.funding,
        "segment": profile.segment,
        "product": {"code": profile.product_code},
        "issuer": dict(_ISSUER),
        "issuer_country": dict(_ISSUER_COUNTRY),
    }
