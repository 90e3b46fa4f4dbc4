"""A worker killed mid-setup (the job, run again with the same key, sets each rail up once) and
mid-mint: before the provider call, and between the provider's answer and the commit. The stale
mint lease is settled by the beat sweep (the reservation becomes spent), the amounts add up at every
step, and the job the dead worker held, run again by another worker, changes nothing.

The stack runs as real processes on a Redis key prefix of its own (see ``tests/factories/kill_stack.py``):
``tessera api``, ``tessera beat`` and two ``tessera worker`` processes. Worker A reaches the sandbox
through a proxy that holds credential mints (the call itself, or its answer once the provider
minted); while the mint is held, worker A is SIGKILLed with its pool. The operation lease is set to
5 s (``TESSERA_OPERATION_LEASE_SECONDS``); a worker of the sweeps queue alone runs the sweep, and
worker B (the providers queue) starts once the sweep settled the reservation: the dead job, run
again, finds its mint settled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from decimal import Decimal

import pytest
from sqlmodel import select

from storage.db import session_scope
from storage.models import Job
from storage.models_allowances import Allowance, AllowanceRail, PaymentCredential
from tests.conftest import free_port, serve_in_thread
from tests.factories.agentic import AMEX, BASE, admin, card_token, fresh_visa
from tests.factories.kill_stack import TESSERA, HoldingProxy, stack
from tests.helpers import wait_until

pytestmark = pytest.mark.kill


def credential_mints(method: str, parts: list[str]) -> bool:
    return method == "POST" and parts[0] == "agentic" and parts[-1] == "credentials"


def _amounts(alw_id: str) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    with session_scope() as session:
        row = session.get(Allowance, alw_id)
        values = (row.amount, row.amount_available, row.amount_reserved, row.amount_spent)
    assert values[1] + values[2] + values[3] == values[0], values
    return values


@pytest.mark.parametrize("before", [True, False], ids=["before-the-call", "after-the-answer"])
def test_a_worker_killed_mid_mint_leaves_the_amounts_adding_up(database, sandbox, isolated_prefix, before):
    proxy = HoldingProxy(sandbox, credential_mints, before=before)
    proxy_port = free_port()
    stop_proxy = serve_in_thread(proxy.app, proxy_port)
    try:
        with stack(
            isolated_prefix, proxy_port, log_prefix="tessera-mint-kill-", TESSERA_OPERATION_LEASE_SECONDS="5"
        ) as (start, worker_a, client, _tenant, common):
            token_id = card_token(client, AMEX)
            answer = client.post(
                BASE,
                {"source": {"type": "svc_card_token", "token_id": token_id}, "consumer": {"email": "ada@example.com"}},
            )
            assert answer.status == 201, answer
            pm = answer.json
            wait_until(lambda: client.get(f"{BASE}/{pm['id']}").json["rails"][0]["status"] == "enabled", timeout=60)
            created = client.post(
                "/agentic/allowances", {"payment_method_id": pm["id"], "amount": {"value": "50.00", "currency": "USD"}}
            )
            assert created.status == 201, created
            alw = created.json
            wait_until(
                lambda: client.get(f"/agentic/allowances/{alw['id']}").json["rails"][0]["status"] == "active",
                timeout=60,
            )

            answers = []
            minting = threading.Thread(
                target=lambda: answers.append(
                    client.post(
                        f"/agentic/allowances/{alw['id']}/credentials",
                        {
                            "rail": "spt",
                            "provider": "psp",
                            "format": "identifier",
                            "amount": {"value": "10.00", "currency": "USD"},
                        },
                    )
                )
            )
            minting.start()
            wait_until(lambda: len(proxy.held) == 1, timeout=60)
            assert _amounts(alw["id"]) == (Decimal(50), Decimal(40), Decimal(10), Decimal(0))
            os.killpg(worker_a.pid, signal.SIGKILL)
            worker_a.wait(10)
            minting.join(30)
            assert answers and answers[0].status == 409, answers
            assert answers[0].json["type"] == "ALLOWANCE_CREDENTIAL_IN_PROGRESS"
            with session_scope() as session:
                [rail] = session.exec(select(AllowanceRail).where(AllowanceRail.allowance_id == alw["id"])).all()

            def minted() -> set[str]:
                return {
                    c["id"]
                    for c in admin(sandbox, "credentials", allowance_id=rail.provider_allowance_id)["credentials"]
                }

            at_the_kill = minted()
            assert len(at_the_kill) == (0 if before else 1)

            # the mint lease goes stale; the beat sweep (a worker of the sweeps queue alone, so that the dead
            # job is not run again yet) settles the reservation as spent
            start("worker-sweeps", [TESSERA, "worker", "-Q", "sweeps,default", "-n", "s@%h"], common)
            wait_until(lambda: _amounts(alw["id"])[2] == 0, timeout=90)
            assert _amounts(alw["id"]) == (Decimal(50), Decimal(40), Decimal(0), Decimal(10))
            with session_scope() as session:
                rows = session.exec(select(PaymentCredential).where(PaymentCredential.allowance_id == alw["id"])).all()
                assert rows == []  # no credential record exists

            start("worker-b", [TESSERA, "worker", "-Q", "providers", "-n", "b@%h"], common)
            with session_scope() as session:
                job_ids = [j.id for j in session.exec(select(Job).where(Job.kind == "agentic.mint_credential")).all()]

            def done():
                with session_scope() as session:
                    return all(session.get(Job, j).status in ("succeeded", "failed", "dead") for j in job_ids)

            wait_until(done, timeout=150)
            assert _amounts(alw["id"]) == (Decimal(50), Decimal(40), Decimal(0), Decimal(10))
            assert minted() == at_the_kill  # the job run again found its mint settled: no second call
            # the allowance goes on: the rest can be minted
            final = client.post(
                f"/agentic/allowances/{alw['id']}/credentials",
                {
                    "rail": "spt",
                    "provider": "psp",
                    "format": "identifier",
                    "amount": {"value": "40.00", "currency": "USD"},
                },
            )
            assert final.status == 201, final
            assert _amounts(alw["id"]) == (Decimal(50), Decimal(0), Decimal(0), Decimal(50))
    finally:
        proxy.released.set()
        time.sleep(0.2)
        stop_proxy()


def allowance_setups(method: str, parts: list[str]) -> bool:
    return method == "POST" and parts[0] == "agentic" and parts[-1] == "allowances"


def test_a_worker_killed_mid_setup_sets_the_rail_up_once(database, sandbox, isolated_prefix):
    proxy = HoldingProxy(sandbox, allowance_setups)
    proxy_port = free_port()
    stop_proxy = serve_in_thread(proxy.app, proxy_port)
    try:
        with stack(isolated_prefix, proxy_port, log_prefix="tessera-setup-kill-") as (
            start,
            worker_a,
            client,
            _tenant,
            common,
        ):
            number = fresh_visa()
            answer = client.post(
                BASE,
                {
                    "source": {"type": "svc_card_token", "token_id": card_token(client, number)},
                    "consumer": {"email": "ada@example.com"},
                },
            )
            assert answer.status == 201, answer
            pm = answer.json
            wait_until(
                lambda: all(r["status"] == "enabled" for r in client.get(f"{BASE}/{pm['id']}").json["rails"]),
                timeout=60,
            )
            created = client.post(
                "/agentic/allowances", {"payment_method_id": pm["id"], "amount": {"value": "50.00", "currency": "USD"}}
            )
            assert created.status == 201, created
            alw = created.json
            assert {r["status"] for r in alw["rails"]} == {"inactive"}  # both set-ups still running
            wait_until(lambda: len(proxy.held) == 2, timeout=60)  # both providers set up, answers held
            os.killpg(worker_a.pid, signal.SIGKILL)
            worker_a.wait(10)

            start("worker-b", [TESSERA, "worker", "--concurrency", "2", "-n", "b@%h"], common)

            def settled():
                now = client.get(f"/agentic/allowances/{alw['id']}").json
                return (
                    all(
                        r["status"] == "active" or (r["provider"] == "vic" and r["status"] == "inactive")
                        for r in now["rails"]
                    )
                    and now["status"] == "pending_verification"
                    and now
                )

            def set_up():
                with session_scope() as session:
                    rails = session.exec(select(AllowanceRail).where(AllowanceRail.allowance_id == alw["id"])).all()
                    return all(r.provider_allowance_id for r in rails) and rails

            rails = wait_until(set_up, timeout=150)
            assert settled()
            for rail in rails:  # the job run again asked with the same key: one allowance at each provider
                held = admin(sandbox, "allowances", provider=rail.provider, pan=number)["allowances"]
                assert [a["id"] for a in held] == [rail.provider_allowance_id]
            assert _amounts(alw["id"]) == (Decimal(50), Decimal(50), Decimal(0), Decimal(0))
    finally:
        proxy.released.set()
        time.sleep(0.2)
        stop_proxy()
