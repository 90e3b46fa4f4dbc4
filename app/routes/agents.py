"""The deprecated agents resource: ``/agentic/agents...`` (spec 001 sections 2 and 4).

Deprecated, still available, no removal date: every answer carries the ``Deprecation`` header (RFC
9745) and problems take the agentic form (:func:`app.routes.agentic_common.agents_form`). The
routes join the ``/agentic/`` registry of :mod:`app.routes.agentic`, ahead of its catch-all route.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from typing import Literal

from pydantic import Field, field_validator

from app.api import Api, Call
from app.routes.agentic_common import DEPRECATION, agents_form
from app.schemas import RequestModel, ResponseModel
from domain.agentic import agents as agent_service
from domain.agentic.errors import validation_error

api = Api()

AGENTS_TAG = "Agents (deprecated)"


# ---- models --------------------------------------------------------------------------------------


class InstanceDetailsIn(RequestModel):
    """An agent's instance details (all optional)."""

    ip_address: str | None = Field(None, description="An IPv4 address.")
    brand: str | None = Field(None, max_length=255)
    type: Literal[agent_service.INSTANCE_TYPES] | None = None  # type: ignore[valid-type]

    @field_validator("ip_address")
    @classmethod
    def _ipv4(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise ValueError("must be an IPv4 address, like 192.0.2.10") from None


def _enrollment_ids(value: list[str] | None) -> list[str] | None:
    if value is not None and any(not 1 <= len(item) <= 255 for item in value):
        raise ValueError("each enrollment id must be 1 to 255 characters")
    return value


class AgentIn(RequestModel):
    """The body of ``POST /agentic/agents``."""

    name: str = Field(min_length=1, max_length=agent_service.MAX_NAME)
    enrollment_ids: list[str] = Field(default_factory=list, max_length=agent_service.MAX_ENROLLMENT_IDS)
    instance_details: InstanceDetailsIn | None = None

    _ids = field_validator("enrollment_ids")(_enrollment_ids)


class AgentPatch(RequestModel):
    """The body of ``PATCH /agentic/agents/{agent_id}`` (every field optional)."""

    name: str | None = Field(None, min_length=1, max_length=agent_service.MAX_NAME)
    enrollment_ids: list[str] | None = Field(None, max_length=agent_service.MAX_ENROLLMENT_IDS)
    instance_details: InstanceDetailsIn | None = None

    _ids = field_validator("enrollment_ids")(_enrollment_ids)


class InstanceDetailsOut(ResponseModel):
    """An agent's instance details."""

    ip_address: str | None = None
    brand: str | None = None
    type: str | None = None


class AgentOut(ResponseModel):
    """An agent (deprecated resource)."""

    id: str = Field(description="`agt_` + 32 hex characters.")
    name: str
    enrollment_ids: list[str]
    status: Literal["active"]
    instance_details: InstanceDetailsOut | None
    created_at: dt.datetime


# ---- agents (deprecated) -------------------------------------------------------------------------

_AGENTS_TEXT = (
    "Deprecated, still available, no removal date: every answer carries `Deprecation: {deprecation}` "
    "(RFC 9745; deprecated since January 1, 2026) and no `Sunset`. New "
    "integrations use payment methods. Problems use the agentic form; 404 AGENT_NOT_FOUND."
).format(deprecation=DEPRECATION["Deprecation"])


def _agent_id(call: Call) -> str:
    return call.params["agent_id"]


@api.route(
    "POST",
    "/agentic/agents",
    permission="agent:create",
    body=AgentIn,
    status=201,
    response=AgentOut,
    problems=agents_form,
    tag=AGENTS_TAG,
    summary="Create an agent",
    errors=(400, 413, 415),
    deprecated=True,
    extra_headers=DEPRECATION,
    description=_AGENTS_TEXT + " `name` 1 to 255 characters; `enrollment_ids` at most 50; `instance_details` "
    "{ip_address (IPv4), brand, type (mobile-phone, tablet, laptop, personal-assistant, connected-auto, "
    "home-appliance, wearable, stationary-computer, e-reader, handheld-gaming-device, other)}, all optional.",
)
async def create_agent(call: Call):
    """``POST /agentic/agents``: 201 with the agent."""
    body: AgentIn = call.body
    details = body.instance_details.model_dump(exclude_none=True) if body.instance_details else None
    return await call.db(
        agent_service.create_agent,
        call.caller,
        name=body.name,
        enrollment_ids=body.enrollment_ids,
        instance_details=details,
    )


@api.route(
    "GET",
    "/agentic/agents/{agent_id}",
    permission="agent:get",
    response=AgentOut,
    problems=agents_form,
    tag=AGENTS_TAG,
    summary="Get an agent",
    errors=(404,),
    deprecated=True,
    extra_headers=DEPRECATION,
    description=_AGENTS_TEXT,
)
async def get_agent(call: Call):
    """``GET /agentic/agents/{agent_id}``."""
    return await call.db(agent_service.read_agent, call.caller, _agent_id(call))


@api.route(
    "PATCH",
    "/agentic/agents/{agent_id}",
    permission="agent:update",
    body=AgentPatch,
    response=AgentOut,
    problems=agents_form,
    tag=AGENTS_TAG,
    summary="Update an agent",
    errors=(400, 404, 413, 415),
    deprecated=True,
    extra_headers=DEPRECATION,
    description=_AGENTS_TEXT + " Each field present replaces the stored one (`name` and `enrollment_ids` "
    "cannot be null; `instance_details: null` clears the details); fields absent are kept.",
)
async def update_agent(call: Call):
    """``PATCH /agentic/agents/{agent_id}``."""
    body: AgentPatch = call.body
    changes = {}
    nulls = {}
    for name in body.model_fields_set:
        value = getattr(body, name)
        if value is None and name in ("name", "enrollment_ids"):
            nulls[name] = ["may not be null"]
        elif name == "instance_details":
            changes[name] = value.model_dump(exclude_none=True) if value is not None else None
        else:
            changes[name] = value
    if nulls:
        raise validation_error(nulls)
    return await call.db(agent_service.update_agent, call.caller, _agent_id(call), changes)


@api.route(
    "DELETE",
    "/agentic/agents/{agent_id}",
    permission="agent:delete",
    status=204,
    problems=agents_form,
    tag=AGENTS_TAG,
    summary="Delete an agent",
    errors=(404,),
    deprecated=True,
    extra_headers=DEPRECATION,
    description=_AGENTS_TEXT,
)
async def delete_agent(call: Call):
    """``DELETE /agentic/agents/{agent_id}``: 204."""
    await call.db(agent_service.delete_agent, call.caller, _agent_id(call))
