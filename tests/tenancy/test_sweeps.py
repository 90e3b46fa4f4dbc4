"""The invitation expiry sweep, run by the real worker and concurrently (core document section 3:
PENDING --time--> EXPIRED). The client key sweep is in ``tests/client_keys/test_sweeps.py``."""

from __future__ import annotations

import datetime as dt
import os
import threading
import uuid

import pytest
from sqlmodel import func, select

from domain.tenancy import invitations
from storage.db import session_scope
from storage.models import AuditLog
from storage.models_tenancy import TenantInvitation
from tasks import tenancy
from tests.helpers import wait_until

pytestmark = pytest.mark.worker


def _pending(tenant, count: int, *, expires_in: dt.timedelta) -> list[uuid.UUID]:
    """Invitations written directly (no mail), expiring ``expires_in`` from now."""
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        rows = [
            TenantInvitation(
                tenant_id=tenant.id,
                email=f"s{n}-{os.urandom(3).hex()}@example.com",
                role="ADMIN",
                expires_at=now + expires_in,
            )
            for n in range(count)
        ]
        session.add_all(rows)
        return [row.id for row in rows]


def _statuses(ids: list[uuid.UUID]) -> list[str]:
    with session_scope() as session:
        return [session.get(TenantInvitation, i).status for i in ids]


def _expiry_logs(tenant) -> int:
    with session_scope() as session:
        return session.exec(
            select(func.count())
            .select_from(AuditLog)
            .where(
                AuditLog.tenant_id == tenant.id,
                AuditLog.entity_type == "tenant_invitation",
                AuditLog.actor_type == "system",
            )
        ).one()


def test_the_sweep_expires_what_is_due_and_nothing_else(api, tenant):
    due = _pending(tenant, 3, expires_in=dt.timedelta(seconds=1))
    later = _pending(tenant, 2, expires_in=dt.timedelta(hours=72))
    # reads never show PENDING once the time has passed, before any sweep
    wait_until(
        lambda: all(
            i["status"] == "EXPIRED"
            for i in tenant.client.get("/tenants/self/invitations").json["data"]
            if uuid.UUID(i["id"]) in due
        ),
        timeout=5,
    )
    assert _statuses(due) == ["PENDING"] * 3  # stored state: not swept yet

    tenancy.expire_invitations.delay()  # beat's message, run by the real worker
    wait_until(lambda: _statuses(due) == ["EXPIRED"] * 3, timeout=20)
    assert _statuses(later) == ["PENDING"] * 2
    assert _expiry_logs(tenant) == 3
    listed = {i["id"]: i["status"] for i in tenant.client.get("/tenants/self/invitations").json["data"]}
    assert sorted(listed.values()) == ["EXPIRED"] * 3 + ["PENDING"] * 2


def test_two_sweeps_at_once_change_each_invitation_once(api, tenant):
    with session_scope() as session:  # nothing left over from other tests
        while invitations.expire_invitations(session, batch=1000):
            pass
    ids = _pending(tenant, 60, expires_in=dt.timedelta(seconds=-1))
    start = threading.Barrier(2)
    counts: list[int] = []

    def sweep() -> None:
        start.wait()
        total = 0
        while True:
            with session_scope() as session:
                done = invitations.expire_invitations(session, batch=7)
            total += done
            if done == 0:
                break
        counts.append(total)

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sum(counts) == 60
    assert _statuses(ids) == ["EXPIRED"] * 60
    assert _expiry_logs(tenant) == 60  # each change logged once
    # a third run finds nothing
    with session_scope() as session:
        assert invitations.expire_invitations(session) == 0
