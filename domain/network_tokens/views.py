"""The network token object as the API shows it (spec, core document section 2 "Network token").

``data`` (the network token's own number and expiration) is sealed at rest under :data:`DATA_PURPOSE`;
it is shown complete to a caller holding :data:`REVEAL`, else masked to its last four digits.
"""

from __future__ import annotations

import json

from sqlmodel import Session

from domain.tenancy.caller import Caller
from domain.tokens.cards import card_brand
from domain.tokens.filters import reveal_last_filter
from storage.crypto import get_keyring
from storage.models_network_tokens import NetworkToken

READ, REVEAL = "network-token:read", "network-token:reveal"
#: The purpose the network token's data (DPAN and expiration) is sealed under (``storage.crypto``).
DATA_PURPOSE = "network-token"


def mask_number(number: str) -> str:
    """The network token number with only its last four digits visible (``XXXXXXXXXXXX7892``)."""
    return reveal_last_filter(number, 4) or ""


def open_data(session: Session, token: NetworkToken) -> dict | None:
    """The plain ``{number, expiration_month, expiration_year}`` of ``token``; None while inactive."""
    if token.data_ct is None:
        return None
    plain = get_keyring().decrypt(session, token.tenant_id, DATA_PURPOSE, str(token.id), token.data_ct)
    return json.loads(plain)


def network_token_view(token: NetworkToken, data: dict | None, *, reveal: bool) -> dict:
    """The network token object (spec section 2).

    ``data`` (the plain ``{number, expiration_month, expiration_year}``, None while inactive) is shown
    with ``number`` complete when ``reveal``, else masked to its last four digits. ``network_token``
    is None while inactive. ``token_id`` / ``token_intent_id`` are null unless the network token was
    made from a token / an intent. ``_extras``: ``merchant_id`` (as sent), ``network_reference`` (the
    card network's own id of the token, null while inactive).
    """
    shown = None
    if data is not None:
        shown = {
            "number": data["number"] if reveal else mask_number(data["number"]),
            "expiration_month": data["expiration_month"],
            "expiration_year": data["expiration_year"],
        }
    return {
        "id": token.id,
        "tenant_id": token.tenant_id,
        "data": shown,
        "network_token": token.details,
        "card": dict(token.card or {}),
        "status": token.status,
        "par": token.par,
        "token_id": token.token_id,
        "token_intent_id": token.token_intent_id,
        "created_by": token.created_by,
        "created_at": token.created_at,
        "modified_by": token.modified_by,
        "modified_at": token.modified_at,
        "_extras": {"merchant_id": token.merchant_id, "network_reference": token.network_reference},
    }


def caller_view(session: Session, caller: Caller, token: NetworkToken) -> dict:
    """The object as ``caller`` sees it: ``data.number`` complete only with :data:`REVEAL` (reveal wins
    over read)."""
    return network_token_view(token, open_data(session, token), reveal=caller.has(REVEAL))


def card_view(card: dict) -> dict:
    """The ``card`` object: brand, first six digits, last four, expiration (overrides applied)."""
    number = card["number"]
    return {
        "brand": card_brand(number),
        "bin": number[:6],
        "last4": number[-4:],
        "expiration_month": card["expiration_month"],
        "expiration_year": card["expiration_year"],
    }
