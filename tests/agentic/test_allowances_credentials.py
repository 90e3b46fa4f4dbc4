"""Minting payment credentials over real HTTP with a real worker and the sandbox: formats, the
reservation and its outcomes, idempotency, concurrency, the MPP key set."""

from __future__ import annotations

import json
import re
import threading
from decimal import Decimal

import pytest
from aiohttp import web
from joserfc import jwe
from joserfc.jwk import OKPKey
from sqlmodel import select

from storage.db import session_scope
from storage.models_allowances import AllowanceRail
from tests.conftest import SANDBOX_PORT, free_port, serve_in_thread
from tests.factories.agentic import AMEX, admin, assert_problem
from tests.factories.allowances import (
    ALLOWANCES,
    MINT_FAILS,
    MINT_HANGS,
    allowance,
    amounts,
    credential_rows,
    events_of,
    mint,
    read,
    row,
    usd,
    verified,
)

pytestmark = pytest.mark.api


def test_an_identifier_mint_moves_the_amount_to_spent_and_returns_the_value_once(tenant):
    alw = allowance(tenant.client, AMEX, "50.00")
    answer = mint(tenant.client, alw["id"], "12.5", key="mint-1")
    assert answer.status == 201, answer
    credential = answer.json
    assert credential["id"].startswith("pcr_")
    assert credential["allowance_id"] == alw["id"]
    assert (credential["rail"], credential["provider"], credential["format"]) == ("spt", "psp", "identifier")
    assert credential["amount"] == usd("12.50")
    assert re.fullmatch(r"spt_[0-9a-f]{24}", credential["credential"]["id"]), credential
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(50), Decimal("37.5"), Decimal(0), Decimal("12.5"))

    shown = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/credentials/{credential['id']}")
    assert shown.status == 200, shown
    assert "credential" not in shown.json
    assert shown.json == {k: v for k, v in credential.items() if k != "credential"}
    [stored] = credential_rows(alw["id"])
    assert stored.sealed is None  # taken by its answer: never kept readable
    assert credential["credential"]["id"] not in json.dumps(stored.mpp or {})

    replay = mint(tenant.client, alw["id"], "12.5", key="mint-1")
    assert_problem(replay, 409, "CREDENTIAL_PAYLOAD_UNAVAILABLE")
    assert admin_count(tenant, alw["id"]) == 1  # no second provider call
    assert_problem(mint(tenant.client, alw["id"], "13", key="mint-1"), 409, "IDEMPOTENCY_CONFLICT")
    events = events_of(tenant.id, "agentic.credential.created")
    assert {"credential": {"id": credential["id"]}, "allowance": {"id": alw["id"], "status": "active"}} in events


def admin_count(tenant, alw_id: str) -> int:
    """How many credentials the sandbox minted for the allowance's provider allowances."""
    with session_scope() as session:
        ids = [
            r.provider_allowance_id
            for r in session.exec(select(AllowanceRail).where(AllowanceRail.allowance_id == alw_id)).all()
        ]
    sandbox = f"http://127.0.0.1:{SANDBOX_PORT}"
    return sum(admin(sandbox, "credentials", allowance_id=i)["count"] for i in ids if i)


def test_card_and_network_token_mints_on_a_verified_rail(tenant):
    alw = verified(tenant.client)
    for fmt in ("card", "network-token"):
        answer = mint(tenant.client, alw["id"], "5.00", rail="agentic-token", provider="vic", fmt=fmt)
        assert answer.status == 201, answer
        value = answer.json["credential"]
        assert set(value) == {"number", "expiration_month", "expiration_year", "cvc"}
        assert value["number"].startswith("400000100000")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(100), Decimal(90), Decimal(0), Decimal(10))


def test_mint_errors_before_any_provider_call(tenant):
    alw = allowance(tenant.client, "4242424242424242", "20.00")
    assert_problem(mint(tenant.client, alw["id"], fmt="card"), 400, "VALIDATION_ERROR")
    assert_problem(mint(tenant.client, alw["id"], provider="vic"), 400, "VALIDATION_ERROR")
    assert_problem(mint(tenant.client, alw["id"], fmt="mpp"), 400, "VALIDATION_ERROR")
    assert_problem(
        mint(tenant.client, alw["id"], rail="agentic-token", provider="agentpay", fmt="card"), 400, "RAIL_NOT_FOUND"
    )
    assert_problem(
        mint(tenant.client, alw["id"], rail="agentic-token", provider="vic", fmt="card"), 400, "RAIL_NOT_ACTIVE"
    )
    assert_problem(mint(tenant.client, alw["id"], "20.01"), 400, "ALLOWANCE_AMOUNT_EXCEEDED")
    other = tenant.client.post(
        f"{ALLOWANCES}/{alw['id']}/credentials",
        {"rail": "spt", "provider": "psp", "format": "identifier", "amount": {"value": "1", "currency": "EUR"}},
    )
    assert_problem(other, 400, "VALIDATION_ERROR")
    assert_problem(mint(tenant.client, "alw_nothing"), 404, "ALLOWANCE_NOT_FOUND")
    assert_problem(
        tenant.client.get(f"{ALLOWANCES}/{alw['id']}/credentials/pcr_nothing"), 404, "PAYMENT_CREDENTIAL_NOT_FOUND"
    )
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(20), Decimal(20), Decimal(0), Decimal(0))


def test_a_conclusive_failure_clears_the_reservation_and_replays(tenant):
    alw = allowance(tenant.client, MINT_FAILS, "40.00")
    first = mint(tenant.client, alw["id"], "15.00", key="fails-1")
    assert_problem(first, 422, "PROVIDER_CREDENTIALS_FAILED")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(40), Decimal(40), Decimal(0), Decimal(0))
    assert credential_rows(alw["id"]) == []
    again = mint(tenant.client, alw["id"], "15.00", key="fails-1")
    assert_problem(again, 422, "PROVIDER_CREDENTIALS_FAILED")
    errors = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/errors").json["data"]
    assert [(e["code"], e["operation"]) for e in errors] == [("PROVIDER_CREDENTIALS_FAILED", "credentials")]
    assert errors[0]["payment_credential_id"].startswith("pcr_")


def test_an_unknown_outcome_moves_the_amount_to_spent_and_keeps_the_key_terminal(tenant):
    alw = allowance(tenant.client, MINT_HANGS, "40.00")
    answer = mint(tenant.client, alw["id"], "15.00", key="hangs-1")
    assert_problem(answer, 409, "CREDENTIAL_OUTCOME_UNKNOWN")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(40), Decimal(25), Decimal(0), Decimal(15))
    assert credential_rows(alw["id"]) == []
    assert_problem(mint(tenant.client, alw["id"], "15.00", key="hangs-1"), 409, "CREDENTIAL_OUTCOME_UNKNOWN")
    assert amounts(read(tenant.client, alw["id"]))[3] == Decimal(15)


def test_twenty_concurrent_mints_reserve_one_at_a_time(tenant):
    alw = allowance(tenant.client, AMEX, "50.00")
    answers = []
    lock = threading.Lock()

    def one():
        answer = mint(tenant.client, alw["id"], "10.00")
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    statuses = sorted(a.status for a in answers)
    assert len(answers) == 20
    created = [a for a in answers if a.status == 201]
    others = [a for a in answers if a.status != 201]
    assert created, statuses
    for answer in others:
        assert answer.status in (409, 400), answer
        assert answer.json["type"] in ("ALLOWANCE_CREDENTIAL_IN_PROGRESS", "ALLOWANCE_AMOUNT_EXCEEDED"), answer
    assert any(a.json["type"] == "ALLOWANCE_CREDENTIAL_IN_PROGRESS" for a in others), statuses
    total, _available, reserved, spent = amounts(read(tenant.client, alw["id"]))
    minted = sum(Decimal(a.json["amount"]["value"]) for a in created)
    assert minted == spent <= total
    assert reserved == 0
    assert admin_count(tenant, alw["id"]) == len(created)


# ---- mpp -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merchant():
    """A merchant serving its JWK set (public key only) on loopback; yields (url, private key)."""
    key = OKPKey.generate_key("X25519", parameters={"kid": "merchant-1", "use": "enc"})
    public = key.as_dict(private=False)

    async def keys(request):
        return web.json_response({"keys": [public]})

    def make():
        app = web.Application()
        app.router.add_get("/.well-known/jwks.json", keys)
        return app

    port = free_port()
    stop = serve_in_thread(make, port)
    yield f"http://127.0.0.1:{port}/.well-known/jwks.json", key
    stop()


def test_an_mpp_mint_is_sealed_for_the_merchant(tenant, merchant):
    url, key = merchant
    alw = allowance(tenant.client, AMEX, "30.00")
    answer = mint(tenant.client, alw["id"], "7.00", fmt="mpp", mpp={"key_set_url": url, "challenge": "c-123"})
    assert answer.status == 201, answer
    opened = jwe.decrypt_compact(answer.json["credential"]["token"], key)
    payload = json.loads(opened.plaintext)
    assert payload["challenge"] == "c-123"
    assert payload["credential"]["id"].startswith("spt_")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(23), Decimal(0), Decimal(7))


def test_an_unreachable_or_unsafe_key_set_clears_the_amount_without_a_provider_call(tenant):
    alw = allowance(tenant.client, AMEX, "30.00")
    closed = f"http://127.0.0.1:{free_port()}/jwks.json"
    answer = mint(tenant.client, alw["id"], "7.00", fmt="mpp", mpp={"key_set_url": closed, "challenge": "c"})
    assert_problem(answer, 502, "MPP_KEY_UNAVAILABLE")
    unsafe = mint(
        tenant.client,
        alw["id"],
        "7.00",
        fmt="mpp",
        mpp={"key_set_url": "ftp://merchant.example/jwks.json", "challenge": "c"},
    )
    assert "mpp.key_set_url" in assert_problem(unsafe, 400, "VALIDATION_ERROR")["errors"]
    userinfo = mint(
        tenant.client,
        alw["id"],
        "7.00",
        fmt="mpp",
        mpp={"key_set_url": "http://user@merchant.example/jwks.json", "challenge": "c"},
    )
    assert_problem(userinfo, 400, "VALIDATION_ERROR")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(30), Decimal(0), Decimal(0))
    assert admin_count(tenant, alw["id"]) == 0
    assert row(alw["id"]).amount_reserved == 0
