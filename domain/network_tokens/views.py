"""The network token object as the API shows it (spec, core document section 2 "Network token").

``data`` (the network token's own number and expiration) is sealed at rest under :data:`DATA_PURPOSE`;
it is shown complete to a caller holding :data:`REVEAL`, else masked to its last four digits.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
import uuid
from typing import Any

from sqlmodel import Session

from domain.tenancy.caller import Caller
from domain.tokens.cards import card_brand
from domain.tokens.filters import reveal_last_filter
from storage.crypto import get_keyring
from storage.models_network_tokens import NetworkToken

READ, REVEAL = "network-token:read", "network-token:reveal"
#: The purpose the network token's data (DPAN and expiration) is sealed under (``storage.crypto``).
DATA_PURPOSE = "network-token"


@dataclasses.dataclass(frozen=True, slots=True)
class TokenRow:
    """The columns of a network token that its object shows, without an ORM object: what a create
    recorded (:func:`created_row`), completed with what its provisioning wrote (:meth:`provisioned`).
    ``data_ct`` is the sealed ``{number, expiration_month, expiration_year}`` (None while inactive)."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    status: str
    data_ct: bytes | None
    details: dict | None
    card: dict
    par: str | None
    network_reference: str | None
    token_id: str | None
    token_intent_id: uuid.UUID | None
    merchant_id: str | None
    created_by: uuid.UUID | None
    created_at: dt.datetime
    modified_by: uuid.UUID | None
    modified_at: dt.datetime | None

    def provisioned(self, written: dict[str, Any]) -> TokenRow:
        """This row with the values a provisioning's outcome statement wrote (``written``: ``status``,
        ``details``, ``par``, ``network_reference``, ``modified_at`` and ``data_ct``, as
        :func:`provisioned_values` gives them, JSON values). Raises KeyError / ValueError / TypeError
        for a value missing or of another form."""
        return dataclasses.replace(
            self,
            status=str(written["status"]),
            details=written["details"],
            par=written["par"],
            network_reference=written["network_reference"],
            modified_at=dt.datetime.fromisoformat(written["modified_at"]),
            data_ct=base64.b64decode(written["data_ct"], validate=True),
        )


def created_row(values: dict[str, Any]) -> TokenRow:
    """The :class:`TokenRow` of the columns a create inserts (``values``: column -> value)."""
    return TokenRow(**{field.name: values[field.name] for field in dataclasses.fields(TokenRow)})


def provisioned_values(
    *, status: str, details: dict | None, par: str | None, reference: str, modified_at: dt.datetime, data_ct: bytes
) -> dict[str, Any]:
    """What a provisioning's outcome statement wrote as JSON values (sealed data in base64): the
    ``answer`` of its outcome message (``infra.jobs.OutcomeWrite``), read by :meth:`TokenRow.provisioned`."""
    return {
        "status": str(status),
        "details": details,
        "par": par,
        "network_reference": reference,
        "modified_at": modified_at.isoformat(),
        "data_ct": base64.b64encode(data_ct).decode("ascii"),
    }


def mask_number(number: str) -> str:
    """The network token number with only its last four digits visible (``XXXXXXXXXXXX7892``)."""
    return reveal_last_filter(number, 4) or ""


def open_data(session: Session | None, token: NetworkToken | TokenRow) -> dict | None:
    """The plain ``{number, expiration_month, expiration_year}`` of ``token``; None while inactive.
    ``session`` None: the tenant's key from the keyring's cache only (``KeyNotCached`` otherwise)."""
    if token.data_ct is None:
        return None
    plain = get_keyring().decrypt(session, token.tenant_id, DATA_PURPOSE, str(token.id), token.data_ct)
    return json.loads(plain)


def network_token_view(token: NetworkToken | TokenRow, data: dict | None, *, reveal: bool) -> dict:
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


def caller_view(session: Session | None, caller: Caller, token: NetworkToken | TokenRow) -> dict:
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
