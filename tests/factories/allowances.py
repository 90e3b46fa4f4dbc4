"""Shared builders and checks for the allowance tests (this module holds no tests)."""

from __future__ import annotations

from decimal import Decimal

from sqlmodel import select

from storage.db import session_scope
from storage.models import Event
from storage.models_allowances import Allowance, PaymentCredential
from tests.factories.agentic import VISA, created, key_header

ALLOWANCES = "/agentic/allowances"
REJECTS_SETUP = "4000000000004012"
MINT_FAILS = "4000000000004020"
MINT_HANGS = "4000000000004038"
CANCEL_FAILS_ONCE = "4000000000004046"
NO_VERIFICATION = "4000000000004053"
OTP = "000000"


def usd(value: str) -> dict:
    return {"value": value, "currency": "USD"}


def new_allowance(client, number: str = VISA, amount: str = "100.00", *, key: str | None = None, **extra):
    """A payment method of ``number`` and a POST /agentic/allowances on it; the answer."""
    pm = created(client, number)
    return client.post(
        ALLOWANCES,
        {"payment_method_id": pm["id"], "amount": usd(amount), **extra},
        headers=key_header(key) if key else None,
    )


def allowance(client, number: str = VISA, amount: str = "100.00", **extra) -> dict:
    """A created allowance (asserting 201)."""
    answer = new_allowance(client, number, amount, **extra)
    assert answer.status == 201, answer
    return answer.json


def rails(alw: dict) -> dict[str, dict]:
    """provider -> rail object."""
    return {r["provider"]: r for r in alw["rails"]}


def verify(
    client, alw_id: str, action: str, otp: str | None = None, rail: str = "agentic-token", provider: str = "vic"
):
    body = {"rail": rail, "provider": provider, "action": action}
    if otp is not None:
        body["otp"] = otp
    return client.post(f"{ALLOWANCES}/{alw_id}/rails/verify", body)


def verified(client, number: str = VISA, amount: str = "100.00") -> dict:
    """An allowance whose vic rail is verified (status active)."""
    alw = allowance(client, number, amount)
    assert verify(client, alw["id"], "start").status == 200
    answer = verify(client, alw["id"], "submit_otp", OTP)
    assert answer.status == 200, answer
    return read(client, alw["id"])


def mint(
    client,
    alw_id: str,
    value: str = "10.00",
    *,
    rail: str = "spt",
    provider: str = "psp",
    fmt: str = "identifier",
    key: str | None = None,
    **extra,
):
    body = {"rail": rail, "provider": provider, "format": fmt, "amount": usd(value), **extra}
    return client.post(f"{ALLOWANCES}/{alw_id}/credentials", body, headers=key_header(key) if key else None)


def read(client, alw_id: str) -> dict:
    answer = client.get(f"{ALLOWANCES}/{alw_id}")
    assert answer.status == 200, answer
    return answer.json


def amounts(alw: dict) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    """``(amount, available, reserved, spent)`` as Decimals, asserting they add up."""
    total, available, reserved, spent = (
        Decimal(alw[name]["value"]) for name in ("amount", "amount_available", "amount_reserved", "amount_spent")
    )
    assert available + reserved + spent == total, alw
    return total, available, reserved, spent


def row(alw_id: str) -> Allowance:
    with session_scope() as session:
        return session.get(Allowance, alw_id)


def credential_rows(alw_id: str) -> list[PaymentCredential]:
    with session_scope() as session:
        return list(session.exec(select(PaymentCredential).where(PaymentCredential.allowance_id == alw_id)).all())


def events_of(tenant_id, event_type: str) -> list[dict]:
    with session_scope() as session:
        rows = session.exec(
            select(Event).where(Event.tenant_id == tenant_id, Event.type == event_type).order_by(Event.created_at)
        ).all()
    return [e.data for e in rows]
