"""Shared builders and checks for the agentic tests (this module holds no tests)."""

from __future__ import annotations

import datetime as dt
import json
import random
import uuid

import urllib3
from sqlmodel import select

from storage.db import session_scope
from storage.models import Event, Job
from storage.models_agentic import PaymentMethod, PaymentMethodRail
from tests.helpers import wait_until

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
AMEX = "378282246310005"
DISCOVER = "6011111111111117"
REJECTED = "4000000000003014"
FAILS_ON_CREATE = "4000000000003022"
PENDING = "4000000000003030"
HANGS = "4000000000003048"
EXPIRY_YEAR = dt.date.today().year + 3
BASE = "/agentic/payment-methods"
RAIL_EVENT = "agentic.payment-method.rail.retried"
PROBLEM = "application/problem+json"

_HTTP = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(30))


def luhn_complete(prefix: str, length: int = 16) -> str:
    """``prefix`` + random digits + the Luhn check digit: a fresh valid card number."""
    body = prefix + "".join(random.choice("0123456789") for _ in range(length - len(prefix) - 1))
    total = 0
    for position, char in enumerate(reversed(body)):
        digit = int(char)
        if position % 2 == 0:
            digit *= 2
            digit -= 9 if digit > 9 else 0
        total += digit
    return body + str((10 - total % 10) % 10)


def fresh_visa() -> str:
    """A visa number no other test uses (the sandbox's admin counters can then be exact)."""
    return luhn_complete("4000009")


def card_token(client, number: str = VISA, **extra) -> str:
    """POST /tokens for a card; its id."""
    data = {"number": number, "expiration_month": 12, "expiration_year": EXPIRY_YEAR, "cvc": "123"}
    data.update(extra.pop("data", {}))
    answer = client.post("/tokens", {"type": "card", "data": data, **extra})
    assert answer.status == 201, answer
    return answer.json["id"]


def body(token_id: str, **extra) -> dict:
    """A create body for the card token ``token_id``."""
    consumer = extra.pop("consumer", {"email": "ada@example.com"})
    return {"source": {"type": "svc_card_token", "token_id": token_id}, "consumer": consumer, **extra}


def key_header(key: str, prefix: str = "TS") -> dict:
    """The idempotency key header."""
    return {f"{prefix}-IDEMPOTENCY-KEY": key}


def create(client, token_id: str, *, key: str | None = None, **extra):
    """POST /agentic/payment-methods; the answer."""
    return client.post(BASE, body(token_id, **extra), headers=key_header(key) if key else None)


def created(client, number: str = VISA, **extra) -> dict:
    """A payment method for a new card token of ``number`` (asserting 201)."""
    answer = create(client, card_token(client, number), **extra)
    assert answer.status == 201, answer
    return answer.json


def rails(pm: dict) -> dict[tuple[str, str], dict]:
    """``(rail, provider) -> rail object``."""
    return {(r["rail"], r["provider"]): r for r in pm["rails"]}


def outcome(pm: dict) -> dict[str, str]:
    """``provider -> status or error code``."""
    return {r["provider"]: r["error"]["code"] if r["status"] == "error" else r["status"] for r in pm["rails"]}


def later(after: dict, before: dict) -> bool:
    """True when ``after``'s updated_at is later than ``before``'s."""
    return dt.datetime.fromisoformat(after["updated_at"]) > dt.datetime.fromisoformat(before["updated_at"])


def get(client, pm_id: str) -> dict:
    answer = client.get(f"{BASE}/{pm_id}")
    assert answer.status == 200, answer
    return answer.json


def settled(client, pm_id: str, timeout: float = 30) -> dict:
    """The payment method once no rail is pending."""
    return wait_until(
        lambda: (pm := get(client, pm_id)) and all(r["status"] != "pending" for r in pm["rails"]) and pm,
        timeout=timeout,
    )


def assert_problem(answer, status: int, code: str) -> dict:
    """An agentic problem with ``status`` and ``type`` ``code``; its body."""
    assert answer.status == status, answer
    assert answer.headers["Content-Type"].startswith(PROBLEM), answer.headers
    problem = answer.json
    assert problem["type"] == code, problem
    assert problem["status"] == status
    assert problem["title"]
    return problem


def admin(sandbox: str, what: str, **query) -> dict:
    """GET the sandbox's ``/_admin/<what>`` with ``query``."""
    answer = _HTTP.request("GET", f"{sandbox}/_admin/{what}", fields=query)
    assert answer.status == 200, answer.data
    return json.loads(answer.data)


def provider_enrollments(sandbox: str, provider: str, pan: str) -> list[dict]:
    """The enrollments ``provider`` holds for the card ``pan``."""
    return admin(sandbox, "enrollments", provider=provider, pan=pan)["enrollments"]


def provider_requests(sandbox: str, endpoint: str, pan: str) -> int:
    """How many requests of ``endpoint`` the sandbox counted for the card ``pan``."""
    return admin(sandbox, "requests", endpoint=endpoint, pan=pan)["total"]


def rail_rows(pm_id: str) -> list[PaymentMethodRail]:
    with session_scope() as session:
        return list(
            session.exec(
                select(PaymentMethodRail)
                .where(PaymentMethodRail.payment_method_id == pm_id)
                .order_by(PaymentMethodRail.position)
            ).all()
        )


def pm_row(pm_id: str) -> PaymentMethod:
    with session_scope() as session:
        return session.get(PaymentMethod, pm_id)


def jobs_of(pm_id: str) -> list[Job]:
    """Every job that worked on the payment method's rails or its deletion, oldest first."""
    subjects = [str(r.id) for r in rail_rows(pm_id)]
    with session_scope() as session:
        rows = session.exec(select(Job).order_by(Job.created_at)).all()
    return [
        j
        for j in rows
        if (j.subject_type == "rail" and j.subject_id in subjects)
        or (j.subject_type == "payment_method" and j.subject_id == pm_id)
    ]


def rail_events(tenant_id, pm_id: str) -> list[dict]:
    """The data of the rail events about one payment method, oldest first."""
    with session_scope() as session:
        rows = session.exec(
            select(Event).where(Event.tenant_id == tenant_id, Event.type == RAIL_EVENT).order_by(Event.created_at)
        ).all()
    return [e.data for e in rows if e.data["payment_method"]["id"] == pm_id]


def subscribe(tenant, url: str) -> None:
    """A webhook for the rail event."""
    answer = tenant.client.post("/webhooks", {"name": "rails", "url": url, "events": [RAIL_EVENT]})
    assert answer.status == 201, answer


def a_uuid() -> str:
    return str(uuid.uuid4())
