"""The public dict shapes of the agentic API (spec 001 section 2; the allowance contract is the
platform's, written in the OpenAPI descriptions): one function per shape, reused by the verbs, the
workers' events and the routes. Timestamps stay ``datetime`` (the API serialises them); amounts are
``{value, currency}`` with exact decimal strings (:func:`domain.agentic.money.money`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Protocol

from domain.agentic.allowance_state import effective_status
from domain.agentic.money import money
from storage.models_agentic import Agent, PaymentMethod, PaymentMethodRail, ProviderError
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from storage.states import AllowanceRailStatus, RailStatus

# ---- payment methods -----------------------------------------------------------------------------


class RailFields(Protocol):
    """What :func:`rail_view` reads of a rail: a :class:`PaymentMethodRail` or a row read without
    the ORM (``domain.agentic.service.settled_view``)."""

    @property
    def position(self) -> int: ...
    @property
    def rail(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def error_code(self) -> str | None: ...
    @property
    def provider_ids(self) -> dict | None: ...


class PaymentMethodFields(Protocol):
    """What :func:`payment_method_view` reads of a payment method: a :class:`PaymentMethod` or a row
    read without the ORM."""

    @property
    def id(self) -> str: ...
    @property
    def source(self) -> dict: ...
    @property
    def status(self) -> str: ...
    @property
    def consumer(self) -> dict: ...
    @property
    def card(self) -> dict | None: ...
    @property
    def agent_id(self) -> str | None: ...
    @property
    def created_at(self) -> dt.datetime: ...
    @property
    def updated_at(self) -> dt.datetime: ...


def rail_view(rail: RailFields) -> dict:
    """``{rail, provider, status, provider_ids, error?: {code}}``; error only when status is error."""
    view: dict[str, Any] = {
        "rail": rail.rail,
        "provider": rail.provider,
        "status": rail.status,
        "provider_ids": dict(rail.provider_ids or {}),
    }
    if rail.status == RailStatus.ERROR:
        view["error"] = {"code": rail.error_code or "PROVIDER_ENROLLMENT_FAILED"}
    return view


def payment_method_view(pm: PaymentMethodFields, rails: Sequence[RailFields]) -> dict:
    """The payment method object (spec 001 section 2); ``agent_id`` only when supplied."""
    view: dict[str, Any] = {
        "id": pm.id,
        "source": dict(pm.source),
        "status": pm.status,
        "consumer": dict(pm.consumer),
        "card": pm.card,
        "rails": [rail_view(r) for r in sorted(rails, key=lambda r: r.position)],
    }
    if pm.agent_id is not None:
        view["agent_id"] = pm.agent_id
    view["created_at"] = pm.created_at
    view["updated_at"] = pm.updated_at
    return view


def rail_event_data(pm: PaymentMethod, rail: PaymentMethodRail) -> dict:
    """The data of ``agentic.payment-method.rail.retried``: ``{payment_method: {id, status},
    rail: {rail, provider, status, provider_ids, error?}}`` (ids and states only)."""
    return {"payment_method": {"id": pm.id, "status": pm.status}, "rail": rail_view(rail)}


def provider_error_view(error: ProviderError) -> dict:
    """The provider error object (spec 001 section 2)."""
    return {
        "id": error.id,
        "code": error.code,
        "title": error.title,
        "detail": error.detail,
        "provider": error.provider,
        "operation": error.operation,
        "rail": error.rail,
        "provider_code": error.provider_code,
        "provider_correlation_id": error.provider_correlation_id,
        "payment_method_id": error.payment_method_id,
        "allowance_id": error.allowance_id,
        "payment_credential_id": error.payment_credential_id,
        "occurred_at": error.occurred_at,
    }


# ---- allowances and credentials -----------------------------------------------------------------


def allowance_rail_view(rail: AllowanceRail) -> dict:
    """``{rail, provider, status: active | inactive | error, error?: {code}, provider_ids}``; a rail
    still being set up shows ``inactive``."""
    view: dict[str, Any] = {
        "rail": rail.rail,
        "provider": rail.provider,
        "status": AllowanceRailStatus.INACTIVE if rail.status == AllowanceRailStatus.SETTING_UP else rail.status,
        "provider_ids": dict(rail.provider_ids or {}),
    }
    if rail.status == AllowanceRailStatus.ERROR:
        view["error"] = {"code": rail.error_code or "PROVIDER_ALLOWANCE_FAILED"}
    return view


def allowance_view(allowance: Allowance, rails: list[AllowanceRail]) -> dict:
    """The allowance object (see the OpenAPI description of ``POST /agentic/allowances``)."""
    currency = allowance.currency
    return {
        "id": allowance.id,
        "payment_method_id": allowance.payment_method_id,
        "status": effective_status(allowance),
        "amount": money(allowance.amount, currency),
        "amount_available": money(allowance.amount_available, currency),
        "amount_reserved": money(allowance.amount_reserved, currency),
        "amount_spent": money(allowance.amount_spent, currency),
        "description": allowance.description,
        "expires_at": allowance.expires_at,
        "rails": [allowance_rail_view(r) for r in sorted(rails, key=lambda r: r.position)],
        "created_at": allowance.created_at,
        "updated_at": allowance.updated_at,
    }


def verification_view(status: str, rail: AllowanceRail) -> dict:
    """The answer of a verification step: ``{status: otp_sent | verified, rail}`` (the rail object)."""
    return {"status": status, "rail": allowance_rail_view(rail)}


def credential_view(row: PaymentCredential, credential: dict | None = None) -> dict:
    """The payment credential object; ``credential`` (the value) only in the mint's own answer."""
    view: dict[str, Any] = {
        "id": row.id,
        "allowance_id": row.allowance_id,
        "rail": row.rail,
        "provider": row.provider,
        "format": row.format,
        "amount": money(row.amount, row.currency),
    }
    if credential is not None:
        view["credential"] = credential
    view["expires_at"] = row.expires_at
    view["created_at"] = row.created_at
    return view


# ---- agents (deprecated) ------------------------------------------------------------------------


def agent_view(agent: Agent) -> dict:
    """The agent object."""
    return {
        "id": agent.id,
        "name": agent.name,
        "enrollment_ids": list(agent.enrollment_ids or []),
        "status": agent.status,
        "instance_details": agent.instance_details,
        "created_at": agent.created_at,
    }
