"""Agents (deprecated; still available, no removal date): spec 001 sections 2 and 4.

An agent is a named AI assistant: ``id`` (``agt_``), ``name`` (1 to 255 characters),
``enrollment_ids`` (at most 50 strings), ``status`` (``active``), ``instance_details``
(``ip_address`` IPv4, ``brand``, ``type`` from :data:`INSTANCE_TYPES`; all optional) and
``created_at``. Validation of those shapes happens in the API's request models; these functions
store and read. A deleted agent is removed; payment methods that named it keep its id
(``agent_id`` is informational).
"""

from __future__ import annotations

from sqlmodel import Session

from domain.agentic.errors import agentic_error
from domain.agentic.payment_methods import new_id
from domain.agentic.views import agent_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from storage.models_agentic import Agent

INSTANCE_TYPES: tuple[str, ...] = (
    "mobile-phone",
    "tablet",
    "laptop",
    "personal-assistant",
    "connected-auto",
    "home-appliance",
    "wearable",
    "stationary-computer",
    "e-reader",
    "handheld-gaming-device",
    "other",
)
MAX_NAME = 255
MAX_ENROLLMENT_IDS = 50
ENTITY_TYPE = "agent"


def _get(session: Session, caller: Caller, agent_id: str) -> Agent:
    agent = session.get(Agent, agent_id, populate_existing=True)
    if agent is None or agent.tenant_id != caller.tenant_id:
        raise agentic_error("AGENT_NOT_FOUND")
    return agent


def create_agent(
    session: Session, caller: Caller, *, name: str, enrollment_ids: list[str], instance_details: dict | None
) -> dict:
    """``POST /agentic/agents``: a new active agent."""
    agent = Agent(
        id=new_id("agt_"),
        tenant_id=caller.tenant_id,
        name=name,
        enrollment_ids=list(enrollment_ids),
        instance_details=instance_details,
        created_by=caller.application_id,
    )
    session.add(agent)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=agent.id, operation="create")
    return agent_view(agent)


def read_agent(session: Session, caller: Caller, agent_id: str) -> dict:
    """``GET /agentic/agents/{id}``: 404 ``AGENT_NOT_FOUND`` when absent in the tenant."""
    agent = _get(session, caller, agent_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=agent.id, operation="read")
    return agent_view(agent)


def update_agent(session: Session, caller: Caller, agent_id: str, changes: dict) -> dict:
    """``PATCH /agentic/agents/{id}``: replaces each field present in ``changes`` (``name``,
    ``enrollment_ids``, ``instance_details``; ``instance_details: null`` clears it)."""
    agent = _get(session, caller, agent_id)
    if "name" in changes:
        agent.name = changes["name"]
    if "enrollment_ids" in changes:
        agent.enrollment_ids = list(changes["enrollment_ids"])
    if "instance_details" in changes:
        agent.instance_details = changes["instance_details"]
    session.add(agent)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=agent.id, operation="update")
    return agent_view(agent)


def delete_agent(session: Session, caller: Caller, agent_id: str) -> None:
    """``DELETE /agentic/agents/{id}``: 404 ``AGENT_NOT_FOUND`` when absent."""
    agent = _get(session, caller, agent_id)
    session.delete(agent)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=agent.id, operation="delete")
