"""The simulated card networks' network-token service, under ``/card-network/network-tokens``.

Outcomes follow ``SANDBOX.md`` (network token provisioning) and depend on the card number only:
see :data:`_BEHAVIOURS` and ``sandbox/README.md``.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import uuid
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

from aiohttp import web

from sandbox.cards import PROFILES, Card, CardFilter, CardRef, describe_card, network_token_number
from sandbox.replies import (
    Reply,
    SandboxError,
    not_found,
    optional_type_errors,
    read_json_object,
)
from sandbox.state import SANDBOX, idempotency_key, respond_idempotently, sandbox_of

PROVISION = "card-network.provision"
READ = "card-network.read"
CARD_ART = "card-network.card-art"
CRYPTOGRAM = "card-network.cryptogram"
SUSPEND = "card-network.suspend"
RESUME = "card-network.resume"
DELETE = "card-network.delete"

NETWORK_BRANDS = frozenset({"visa", "mastercard"})
"""Brands whose networks issue network tokens."""

TOKEN_LIFETIME_YEARS = 3
"""A network token expires this many years after the card, in the card's month."""

FLAKY_FAILURES = 2
"""How many 503 answers the flaky card gives per idempotency key before it succeeds."""

ECI = {"visa": "05", "mastercard": "02"}
"""Electronic commerce indicator of the cryptograms, per brand."""

_FULL_ART_BRANDS = frozenset({"visa"})
_LOGO_SIZE = (100, 100)
_CARD_IMAGE_SIZE = (969, 1536)
_CRYPTOGRAM_BYTES = 20


class _Behaviour(Enum):
    """Special provisioning outcomes of the test cards."""

    NOT_ELIGIBLE = "not eligible"
    FLAKY = "503 twice per idempotency key, then success"
    SLOW = "success after slow_seconds"


_BEHAVIOURS = {
    "4000000000002016": _Behaviour.NOT_ELIGIBLE,
    "4000000000002024": _Behaviour.FLAKY,
    "4000000000002032": _Behaviour.SLOW,
}

# Status changes: endpoint -> (statuses it applies to, status it sets). Anything else is 409.
_TRANSITIONS = {
    SUSPEND: (frozenset({"active", "suspended"}), "suspended"),
    RESUME: (frozenset({"active", "suspended"}), "active"),
    DELETE: (frozenset({"active", "suspended", "deleted"}), "deleted"),
}


@dataclass
class NetworkToken:
    """A network token the simulated network issued for ``card``; ``number`` is its DPAN."""

    id: str
    card: Card
    number: str
    status: str = "active"

    def view(self) -> dict[str, Any]:
        """The network token as the network returns it (see ``sandbox/README.md``)."""
        return {
            "id": self.id,
            "number": self.number,
            "expiration_month": self.card.expiration_month,
            "expiration_year": self.card.expiration_year + TOKEN_LIFETIME_YEARS,
            "par": self.card.ref.par,
            "status": self.status,
            **describe_card(self.number, self.card.brand),
        }

    def admin_view(self) -> dict[str, Any]:
        """:meth:`view` plus ``pan_last4``, the last four digits of the card (not of the DPAN)."""
        return {**self.view(), "pan_last4": self.card.last4}


class CardNetwork:
    """State of the simulated networks: issued tokens and the flaky card's attempt counts."""

    def __init__(self) -> None:
        self.tokens: dict[str, NetworkToken] = {}
        self.attempts: Counter[tuple[str, str]] = Counter()

    def clear(self) -> None:
        """Forget every token and attempt."""
        self.tokens.clear()
        self.attempts.clear()

    def issue(self, card: Card) -> NetworkToken:
        """Store and return a new active network token for ``card`` (visa or mastercard)."""
        token = NetworkToken(str(uuid.uuid4()), card, network_token_number(card.pan, card.brand))
        self.tokens[token.id] = token
        return token

    def note_attempt(self, attempt_key: tuple[str, str]) -> int:
        """Count one more provisioning attempt under ``attempt_key``; returns the attempt number."""
        self.attempts[attempt_key] += 1
        return self.attempts[attempt_key]


CARD_NETWORK = web.AppKey("card_network", CardNetwork)
"""Application key of the :class:`CardNetwork` state."""

routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the card network's state and routes (API and admin) to ``app``."""
    app[CARD_NETWORK] = app[SANDBOX].register(CardNetwork())
    app.add_routes(routes)


@routes.post("/card-network/network-tokens")
async def provision(request: web.Request) -> web.Response:
    """Provision a network token; see ``sandbox/README.md`` for the body and every outcome."""
    body = await read_json_object(request)
    sandbox_of(request).requests.count(PROVISION, CardRef.of(body.get("pan")))
    card = Card.from_body(body, _provision_extras_errors(body))
    key = idempotency_key(request)
    attempt_key = ("key", key) if key is not None else ("par", card.ref.par)
    return await respond_idempotently(request, (PROVISION,), partial(_provision, request.app, card, attempt_key))


def _provision_extras_errors(body: dict[str, Any]) -> dict[str, str]:
    """Field path -> message for the optional ``cardholder`` and ``merchant_id`` fields."""
    cardholder = body.get("cardholder")
    fields: dict[str, tuple[object, type]] = {
        "cardholder": (cardholder, dict),
        "merchant_id": (body.get("merchant_id"), str),
    }
    if isinstance(cardholder, dict):
        fields["cardholder.name"] = (cardholder.get("name"), str)
        fields["cardholder.address"] = (cardholder.get("address"), dict)
    return optional_type_errors(fields)


async def _provision(app: web.Application, card: Card, attempt_key: tuple[str, str]) -> Reply:
    """The network's answer to provisioning ``card``; ``attempt_key`` counts the flaky card's tries."""
    if card.brand not in NETWORK_BRANDS:
        raise SandboxError(422, "network_not_supported", f"{card.brand} cards cannot get network tokens")
    network = app[CARD_NETWORK]
    behaviour = _BEHAVIOURS.get(card.pan)
    if behaviour is _Behaviour.NOT_ELIGIBLE:
        raise SandboxError(422, "card_not_eligible", "the issuer declined: the card is not eligible")
    if behaviour is _Behaviour.FLAKY and network.note_attempt(attempt_key) <= FLAKY_FAILURES:
        raise SandboxError(503, "network_unavailable", "the network is temporarily unavailable; retry")
    if behaviour is _Behaviour.SLOW:
        await asyncio.sleep(app[SANDBOX].settings.slow_seconds)
    return Reply(201, network.issue(card).view())


def _token(request: web.Request, endpoint: str) -> NetworkToken:
    """The network token named in the path, counting the request to ``endpoint``; 404 if unknown."""
    token = request.app[CARD_NETWORK].tokens.get(request.match_info["token_id"])
    sandbox_of(request).requests.count(endpoint, token.card.ref if token else None)
    if token is None:
        raise not_found("network token")
    return token


@routes.get("/card-network/network-tokens/{token_id}")
async def read_token(request: web.Request) -> web.Response:
    """200 with the network token (any status, including deleted); 404 if unknown."""
    return web.json_response(_token(request, READ).view())


@routes.get("/card-network/network-tokens/{token_id}/card-art")
async def card_art(request: web.Request) -> web.Response:
    """200 ``{card_art: {background_color, logo, card_image}}``; 404 if the token is unknown."""
    token = _token(request, CARD_ART)
    return web.json_response({"card_art": _card_art(token, request)})


def _card_art(token: NetworkToken, request: web.Request) -> dict[str, Any]:
    """Visa: logo, card image and background colour; mastercard: logo only (the others null)."""
    brand = token.card.brand
    name = PROFILES[brand].name
    logo = _image(request, token, "logo.png", f"{name} logo", _LOGO_SIZE)
    if brand not in _FULL_ART_BRANDS:
        return {"background_color": None, "logo": logo, "card_image": None}
    return {
        "background_color": PROFILES[brand].background_color,
        "logo": logo,
        "card_image": _image(request, token, "card-image.png", f"{name} card", _CARD_IMAGE_SIZE),
    }


def _image(
    request: web.Request, token: NetworkToken, file: str, description: str, size: tuple[int, int]
) -> dict[str, Any]:
    """``{url, description, height, width}`` of a placeholder image served at ``/card-art/...``."""
    url = request.url.origin().with_path(f"/card-art/{token.id}/{file}")
    height, width = size
    return {"url": str(url), "description": description, "height": height, "width": width}


@routes.post("/card-network/network-tokens/{token_id}/cryptograms")
async def cryptogram(request: web.Request) -> web.Response:
    """200 ``{cryptogram, eci}``; 404 if unknown; 409 ``token_not_active`` if suspended or deleted."""
    token = _token(request, CRYPTOGRAM)
    return await respond_idempotently(request, (CRYPTOGRAM, token.id), partial(_cryptogram, token))


async def _cryptogram(token: NetworkToken) -> Reply:
    """A fresh random base64 cryptogram with the brand's ECI, for an active token."""
    if token.status != "active":
        raise SandboxError(409, "token_not_active", f"the network token is {token.status}")
    value = base64.b64encode(secrets.token_bytes(_CRYPTOGRAM_BYTES)).decode()
    return Reply(200, {"cryptogram": value, "eci": ECI[token.card.brand]})


@routes.post("/card-network/network-tokens/{token_id}/suspend")
async def suspend(request: web.Request) -> web.Response:
    """200 with the token, now (or still) ``suspended``; 404 if unknown; 409 if deleted."""
    return await _transition(request, SUSPEND)


@routes.post("/card-network/network-tokens/{token_id}/resume")
async def resume(request: web.Request) -> web.Response:
    """200 with the token, now (or still) ``active``; 404 if unknown; 409 if deleted."""
    return await _transition(request, RESUME)


@routes.delete("/card-network/network-tokens/{token_id}")
async def delete(request: web.Request) -> web.Response:
    """200 with the token, now (or still) ``deleted``; 404 if unknown."""
    return await _transition(request, DELETE)


async def _transition(request: web.Request, endpoint: str) -> web.Response:
    """Apply the status change of ``endpoint`` to the token in the path, idempotently."""
    token = _token(request, endpoint)
    return await respond_idempotently(request, (endpoint, token.id), partial(_change_status, token, endpoint))


async def _change_status(token: NetworkToken, endpoint: str) -> Reply:
    """Apply ``endpoint``'s transition to ``token``; 409 ``token_deleted`` when it does not apply."""
    applies_to, status = _TRANSITIONS[endpoint]
    if token.status not in applies_to:
        raise SandboxError(409, "token_deleted", "the network token is deleted")
    token.status = status
    return Reply(200, token.view())


@routes.get("/_admin/network-tokens")
async def admin_tokens(request: web.Request) -> web.Response:
    """200 ``{network_tokens: [...], count}``: tokens held, filtered by card (``pan_last4``, ``par``,
    ``pan``) and ``status``, oldest first."""
    cards = CardFilter.from_query(request.query)
    status = request.query.get("status")
    tokens = [
        token.admin_view()
        for token in request.app[CARD_NETWORK].tokens.values()
        if cards.matches(token.card.ref) and status in (None, token.status)
    ]
    return web.json_response({"network_tokens": tokens, "count": len(tokens)})
