"""A worker killed mid-enrollment: the rails end enabled, never stuck pending, and each provider saw one
enrollment (its idempotency key made the second call a replay).

The stack runs as real processes on a Redis key prefix of its own, so the in-process test worker of
the other tests never takes these tasks: ``tessera api``, ``tessera beat`` (its stale-lease sweep
and outbox relay recover the killed jobs) and two ``tessera worker`` processes. Worker A reaches the
sandbox through a proxy that forwards each enrollment at once (the provider enrolls the card) but
holds the answer; while both rails' calls are held, worker A is SIGKILLed with its pool. Worker B,
started afterwards, gets the jobs back from the relay once their lease runs out and asks the
provider again with the same idempotency key.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from sqlmodel import select

from storage.db import session_scope
from storage.models import Job
from storage.models_agentic import OperationLease
from tests.conftest import free_port, serve_in_thread
from tests.factories.agentic import (
    BASE,
    card_token,
    fresh_visa,
    outcome,
    provider_enrollments,
    provider_requests,
    rail_events,
    rail_rows,
)
from tests.factories.kill_stack import TESSERA, HoldingProxy, stack
from tests.helpers import wait_until

pytestmark = pytest.mark.kill


def test_a_worker_killed_mid_enrollment_leaves_no_rail_pending_and_enrolls_once(database, sandbox, isolated_prefix):
    proxy = HoldingProxy(sandbox)
    proxy_port = free_port()
    stop_proxy = serve_in_thread(proxy.app, proxy_port)
    try:
        with stack(isolated_prefix, proxy_port, log_prefix="tessera-kill-") as (
            start,
            worker_a,
            client,
            tenant,
            common,
        ):
            number = fresh_visa()

            created = client.post(
                BASE,
                {
                    "source": {"type": "svc_card_token", "token_id": card_token(client, number)},
                    "consumer": {"email": "ada@example.com"},
                },
            )

            assert created.status == 201, created
            pm = created.json
            assert outcome(pm) == {"vic": "pending", "psp": "pending"}
            wait_until(lambda: len(proxy.held) == 2, timeout=60)
            assert sorted(provider for provider, _ in proxy.held) == ["psp", "vic"]
            assert proxy.answered == []  # both calls in flight at once: the rails enroll in parallel
            os.killpg(worker_a.pid, signal.SIGKILL)
            worker_a.wait(10)
            assert worker_a.returncode == -signal.SIGKILL

            start("worker-b", [TESSERA, "worker", "--concurrency", "2", "-n", "b@%h"], common)

            def settled():
                now = client.get(f"{BASE}/{pm['id']}").json
                return "pending" not in outcome(now).values() and now

            final = wait_until(settled, timeout=150)

            assert outcome(final) == {"vic": "enabled", "psp": "enabled"}
            for provider in ("vic", "psp"):
                enrollments = provider_enrollments(sandbox, provider, number)
                assert len(enrollments) == 1, enrollments
                assert provider_requests(sandbox, f"agentic.{provider}.enrollments.create", number) == 2
                rail = next(r for r in rail_rows(pm["id"]) if r.provider == provider)
                assert rail.enrollment_id == enrollments[0]["id"]
            jobs = _enroll_jobs(pm["id"])
            assert [(job.status, job.attempts) for job in jobs] == [("succeeded", 2), ("succeeded", 2)]
            assert sorted(e["rail"]["provider"] for e in rail_events(tenant.tenant_id, pm["id"])) == ["psp", "vic"]
            with session_scope() as session:
                assert session.get(OperationLease, pm["id"]) is None
            assert client.delete(f"{BASE}/{pm['id']}").status == 204
    finally:
        proxy.released.set()
        time.sleep(0.2)
        stop_proxy()


def _enroll_jobs(pm_id: str) -> list[Job]:
    subjects = {str(r.id) for r in rail_rows(pm_id)}
    with session_scope() as session:
        rows = session.exec(select(Job).where(Job.kind == "agentic.enroll_rail")).all()
    return [job for job in rows if job.subject_id in subjects]
