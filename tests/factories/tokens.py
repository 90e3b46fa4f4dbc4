"""Builders of token requests and checks of token rows, shared by the tests of tokens and of other
packages (admin ...); no tests here."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import update
from sqlmodel import select

from storage.db import session_scope
from storage.models import AuditLog, Event, Token

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
ROUTING = "021000021"
EXPIRY_YEAR = dt.date.today().year + 3
READ_ALL = ["token:general:read:high", "token:pci:read:high", "token:bank:read:high"]


def card(number: str = VISA, **extra) -> dict:
    """A card token request object."""
    data = {"number": number, "expiration_month": 12, "expiration_year": EXPIRY_YEAR, "cvc": "123"}
    return {"type": "card", "data": data, **extra}


def bank(account: str = "123456789", **extra) -> dict:
    """A bank token request object."""
    return {"type": "bank", "data": {"routing_number": ROUTING, "account_number": account}, **extra}


def create(client, body: dict) -> dict:
    """POST /tokens, asserting 201; the token object."""
    answer = client.post("/tokens", body)
    assert answer.status == 201, answer
    return answer.json


def listed_ids(client, query: str = "") -> list[str]:
    """The ids on the first page of GET /v2/tokens."""
    answer = client.get(f"/v2/tokens{query}")
    assert answer.status == 200, answer
    return [token["id"] for token in answer.json["data"]]


def set_settings(tenant, **settings: str) -> None:
    """Change tenant settings (fingerprint_tokens, deduplicate_tokens, token_deduplication_behavior)."""
    answer = tenant.client.put("/tenants/self", {"name": "acme", "settings": settings})
    assert answer.status == 200, answer


def expire_now(tenant_id, token_id: str) -> None:
    """Move a token's expires_at into the past (as if time had passed)."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with session_scope() as session:
        session.execute(update(Token).where(Token.tenant_id == tenant_id, Token.id == token_id).values(expires_at=past))


def stored(tenant_id, token_id: str) -> Token | None:
    """The token row, or None."""
    with session_scope() as session:
        return session.exec(select(Token).where(Token.tenant_id == tenant_id, Token.id == token_id)).first()


TOKEN_EVENTS = ["token.created", "token.updated", "token.deleted"]


def subscribe(tenant, url: str, events: list[str] = TOKEN_EVENTS) -> dict:
    """A webhook of ``tenant`` subscribed to ``events`` (events are recorded only when one subscribes)."""
    answer = tenant.client.post("/webhooks", {"name": "token events", "url": url, "events": events})
    assert answer.status == 201, answer
    return answer.json


def events_of(tenant_id, token_id: str) -> list[tuple[str, dict]]:
    """(type, data) of the events about one token, oldest first."""
    with session_scope() as session:
        rows = session.exec(select(Event).where(Event.tenant_id == tenant_id).order_by(Event.created_at)).all()
    return [(e.type, e.data) for e in rows if e.data.get("token", {}).get("id") == token_id]


def log_operations(tenant_id, token_id: str) -> list[str]:
    """The operations of the log rows about one token, oldest first."""
    with session_scope() as session:
        rows = session.exec(
            select(AuditLog)
            .where(AuditLog.tenant_id == tenant_id, AuditLog.entity_id == token_id)
            .order_by(AuditLog.created_at)
        ).all()
    return [row.operation for row in rows]
