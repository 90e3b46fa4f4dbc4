"""The simulated agentic payment providers ``vic``, ``agentpay`` and ``psp``: card enrollments.

Outcomes follow ``SANDBOX.md`` (agentic providers) and depend on the provider and the card number
only: see :data:`PROVIDER_BRANDS`, :data:`_VIC_BEHAVIOURS` and ``sandbox/README.md``.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web
from yarl import URL

from sandbox.cards import ISSUER_NAME, PROFILES, Card, CardFilter, CardRef, describe_card
from sandbox.replies import (
    Reply,
    SandboxError,
    not_found,
    optional_type_errors,
    read_json_object,
)
from sandbox.state import SANDBOX, Sandbox, respond_idempotently, sandbox_of

PROVIDER_BRANDS = {
    "vic": frozenset({"visa"}),
    "agentpay": frozenset({"mastercard"}),
    "psp": frozenset({"visa", "mastercard", "amex"}),
}
"""The card brands each provider enrolls."""

ATTEMPTS = ("create", "retry")
"""Values of an enrollment's ``attempt``."""

# provider -> names and prefixes of the identifiers it returns in provider_ids
_PROVIDER_IDS = {
    "vic": (("enrollment_reference", "vic_enr_"), ("token_reference", "vic_tkn_")),
    "agentpay": (("card_id", "ap_card_"),),
    "psp": (("payment_method", "psp_pm_"),),
}


class _Behaviour(Enum):
    """Special outcomes of the vic test cards."""

    REJECT = "422 CARD_REJECTED on every attempt"
    FAIL_ON_CREATE = "422 PROVIDER_ENROLLMENT_FAILED on create; retry enables"
    PENDING = "201 pending, enabled pending_seconds later"
    HANG = "no answer for hang_seconds"


_VIC_BEHAVIOURS = {
    "4000000000003014": _Behaviour.REJECT,
    "4000000000003022": _Behaviour.FAIL_ON_CREATE,
    "4000000000003030": _Behaviour.PENDING,
    "4000000000003048": _Behaviour.HANG,
}


@dataclass(frozen=True)
class EnrollmentRequest:
    """A validated enrollment call: the card, ``attempt`` (create or retry) and the callback URL."""

    card: Card
    attempt: str
    callback_url: str | None


@dataclass
class Enrollment:
    """A card enrolled with ``provider``; ``status`` is ``enabled`` or ``pending``."""

    id: str
    provider: str
    card: Card
    status: str
    art_url: str
    provider_ids: dict[str, str]

    def view(self) -> dict[str, Any]:
        """The enrollment as the provider returns it (see ``sandbox/README.md``)."""
        profile = PROFILES[self.card.brand]
        display = {
            "art_url": self.art_url,
            "background_color": profile.background_color,
            "foreground_color": profile.foreground_color,
            "description": f"{profile.name} {profile.funding} card",
            "issuer_name": ISSUER_NAME,
        }
        card = {
            **describe_card(self.card.pan, self.card.brand),
            "expiration_month": self.card.expiration_month,
            "expiration_year": self.card.expiration_year,
            "display": display,
        }
        return {
            "id": self.id,
            "provider": self.provider,
            "status": self.status,
            "card": card,
            "provider_ids": dict(self.provider_ids),
        }

    def admin_view(self) -> dict[str, Any]:
        """:meth:`view` plus ``pan_last4`` and ``par`` of the card."""
        return {**self.view(), "pan_last4": self.card.last4, "par": self.card.ref.par}


class Agentic:
    """State of the agentic providers: the enrollments they hold, by id."""

    def __init__(self) -> None:
        self.enrollments: dict[str, Enrollment] = {}

    def clear(self) -> None:
        """Forget every enrollment."""
        self.enrollments.clear()

    def enroll(self, provider: str, card: Card, status: str, origin: URL) -> Enrollment:
        """Store and return a new enrollment of ``card`` with ``provider``; ``origin``: the sandbox's."""
        enrollment_id = f"enr_{secrets.token_hex(12)}"
        enrollment = Enrollment(
            id=enrollment_id,
            provider=provider,
            card=card,
            status=status,
            art_url=str(origin.with_path(f"/card-art/{enrollment_id}/card-image.png")),
            provider_ids={name: prefix + secrets.token_hex(8) for name, prefix in _PROVIDER_IDS[provider]},
        )
        self.enrollments[enrollment_id] = enrollment
        return enrollment

    def find(self, provider: str, enrollment_id: str) -> Enrollment | None:
        """The enrollment ``enrollment_id`` if ``provider`` holds it."""
        return held_by(self.enrollments, provider, enrollment_id)


class Held(Protocol):
    """Something a provider holds: an enrollment, an allowance."""

    provider: str


HeldT = TypeVar("HeldT", bound=Held)


def held_by(items: dict[str, HeldT], provider: str, item_id: str) -> HeldT | None:
    """``items[item_id]`` if it exists and ``provider`` holds it, else None."""
    item = items.get(item_id)
    return item if item is not None and item.provider == provider else None


AGENTIC = web.AppKey("agentic", Agentic)
"""Application key of the :class:`Agentic` state."""

routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """Add the agentic providers' state and routes (API and admin) to ``app``."""
    app[AGENTIC] = app[SANDBOX].register(Agentic())
    app.add_routes(routes)


def provider_in_path(request: web.Request) -> str:
    """The provider named in the path; 404 ``not_found`` if it is not vic, agentpay or psp."""
    provider = request.match_info["provider"]
    if provider not in PROVIDER_BRANDS:
        raise not_found("provider")
    return provider


def endpoint_name(provider: str, resource: str, operation: str) -> str:
    """The request-counter name of an agentic endpoint, e.g. ``agentic.vic.enrollments.create``."""
    return f"agentic.{provider}.{resource}.{operation}"


@routes.post("/agentic/{provider}/enrollments")
async def create_enrollment(request: web.Request) -> web.Response:
    """Enroll a card; 201 with the enrollment or 422 ``{code, message, provider_correlation_id}``.

    See ``sandbox/README.md`` for the body and every outcome.
    """
    provider = provider_in_path(request)
    body = await read_json_object(request)
    sandbox_of(request).requests.count(endpoint_name(provider, "enrollments", "create"), CardRef.of(body.get("pan")))
    ask = _enrollment_request(body)
    operation = partial(_enroll, request.app, provider, ask, request.url.origin())
    return await respond_idempotently(request, ("enroll", provider, ask.attempt), operation)


def _enrollment_request(body: dict[str, Any]) -> EnrollmentRequest:
    """The validated enrollment call in ``body``; 400 ``invalid_request`` listing every bad field."""
    consumer, callback_url = body.get("consumer"), body.get("callback_url")
    errors = _consumer_errors(consumer) if isinstance(consumer, dict) else {"consumer": "must be an object"}
    if body.get("attempt") not in ATTEMPTS:
        errors["attempt"] = "must be create or retry"
    if callback_url is not None and not _is_http_url(callback_url):
        errors["callback_url"] = "must be an absolute http or https URL"
    return EnrollmentRequest(Card.from_body(body, errors), body["attempt"], callback_url)


def _consumer_errors(consumer: dict[str, Any]) -> dict[str, str]:
    """Field path -> message for ``consumer``: ``id`` and ``email`` required, codes optional strings."""
    errors = optional_type_errors(
        {
            "consumer.country_code": (consumer.get("country_code"), str),
            "consumer.language_code": (consumer.get("language_code"), str),
        }
    )
    if not (isinstance(consumer.get("id"), str) and consumer["id"]):
        errors["consumer.id"] = "must be a non-empty string"
    if not (isinstance(consumer.get("email"), str) and "@" in consumer["email"]):
        errors["consumer.email"] = "must be an email address"
    return errors


def _is_http_url(value: object) -> bool:
    """True for a string holding an absolute ``http`` or ``https`` URL with a host."""
    if not isinstance(value, str):
        return False
    try:
        url = URL(value)
    except (TypeError, ValueError):
        return False
    return url.scheme in ("http", "https") and bool(url.host)


def rejection(code: str, message: str) -> SandboxError:
    """A 422 provider rejection carrying a fresh ``provider_correlation_id``."""
    return SandboxError(422, code, message, provider_correlation_id=f"corr_{secrets.token_hex(8)}")


async def _enroll(app: web.Application, provider: str, ask: EnrollmentRequest, origin: URL) -> Reply:
    """The provider's answer to ``ask``; stores the enrollment when it succeeds."""
    card, sandbox = ask.card, app[SANDBOX]
    if card.brand not in PROVIDER_BRANDS[provider]:
        raise rejection("UNSUPPORTED_CARD_NETWORK", f"{provider} does not enroll {card.brand} cards")
    behaviour = _VIC_BEHAVIOURS.get(card.pan) if provider == "vic" else None
    if behaviour is _Behaviour.REJECT:
        raise rejection("CARD_REJECTED", "the issuer rejected the card")
    if behaviour is _Behaviour.FAIL_ON_CREATE and ask.attempt == "create":
        raise rejection("PROVIDER_ENROLLMENT_FAILED", "the enrollment failed at the provider; retry")
    if behaviour is _Behaviour.HANG:
        await hang(sandbox)
    pending = behaviour is _Behaviour.PENDING
    enrollment = app[AGENTIC].enroll(provider, card, "pending" if pending else "enabled", origin)
    if pending:
        sandbox.background.spawn(_complete_later(sandbox, app[AGENTIC], enrollment, ask.callback_url))
    return Reply(201, enrollment.view())


async def hang(sandbox: Sandbox) -> None:
    """Answer nothing for ``hang_seconds``, then raise a 504 ``PROVIDER_TIMEOUT`` (5xx: never stored)."""
    await asyncio.sleep(sandbox.settings.hang_seconds)
    raise SandboxError(504, "PROVIDER_TIMEOUT", "the provider did not answer in time")


async def _complete_later(sandbox: Sandbox, agentic: Agentic, enrollment: Enrollment, callback_url: str | None) -> None:
    """After ``pending_seconds`` enable ``enrollment`` (unless deleted meanwhile) and notify the callback."""
    await asyncio.sleep(sandbox.settings.pending_seconds)
    if agentic.enrollments.get(enrollment.id) is not enrollment:
        return
    enrollment.status = "enabled"
    if callback_url is not None and sandbox.http is not None:
        await _notify(sandbox.http, callback_url, enrollment.view())


async def _notify(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST ``body`` as JSON to ``url``, best effort: any failure or status is ignored."""
    try:
        async with http.post(url, json=body) as response:
            await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return


@routes.get("/agentic/{provider}/enrollments/{enrollment_id}")
async def read_enrollment(request: web.Request) -> web.Response:
    """200 with the enrollment's current state; 404 if the provider does not hold it."""
    provider = provider_in_path(request)
    enrollment = request.app[AGENTIC].find(provider, request.match_info["enrollment_id"])
    sandbox_of(request).requests.count(
        endpoint_name(provider, "enrollments", "read"), enrollment.card.ref if enrollment else None
    )
    if enrollment is None:
        raise not_found("enrollment")
    return web.json_response(enrollment.view())


@routes.delete("/agentic/{provider}/enrollments/{enrollment_id}")
async def delete_enrollment(request: web.Request) -> web.Response:
    """204 after removing the enrollment; also 204 when the provider does not hold it."""
    provider = provider_in_path(request)
    agentic = request.app[AGENTIC]
    enrollment = agentic.find(provider, request.match_info["enrollment_id"])
    sandbox_of(request).requests.count(
        endpoint_name(provider, "enrollments", "delete"), enrollment.card.ref if enrollment else None
    )
    if enrollment is not None:
        del agentic.enrollments[enrollment.id]
    return web.Response(status=204)


@routes.get("/_admin/enrollments")
async def admin_enrollments(request: web.Request) -> web.Response:
    """200 ``{enrollments: [...], count}``: enrollments held, filtered by ``provider``, card
    (``pan_last4``, ``par``, ``pan``) and ``status``, oldest first."""
    cards = CardFilter.from_query(request.query)
    provider, status = request.query.get("provider"), request.query.get("status")
    enrollments = [
        enrollment.admin_view()
        for enrollment in request.app[AGENTIC].enrollments.values()
        if provider in (None, enrollment.provider)
        and status in (None, enrollment.status)
        and cards.matches(enrollment.card.ref)
    ]
    return web.json_response({"enrollments": enrollments, "count": len(enrollments)})
