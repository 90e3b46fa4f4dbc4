"""A worker SIGKILLed (its whole process group) while a tenant's data key rotation re-encrypts, then the
rotation resumed by another worker: nothing lost (every value opens, none left under the old
version), nothing sealed twice (the progress counts each value once), the old version destroyed.

Real processes on a Redis key prefix of their own (the in-process test worker never takes these
tasks): ``tessera beat`` (the stale-lease sweep and the outbox relay recover the killed pass) and two
``tessera worker`` processes, one after the other, on the test database.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from sqlalchemy import insert, update
from sqlmodel import col, select

from domain.keys import service
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import Job, KeyRotation, Token
from storage.sealed import version_head
from storage.types import table_of, utcnow
from tests.factories.kill_stack import TESSERA, _log_tail, broker_env, isolated_prefix, processes  # noqa: F401
from tests.helpers import wait_until

pytestmark = pytest.mark.kill

TOKENS = 60_000


def _rotation(rotation_id: uuid.UUID) -> KeyRotation:
    with session_scope() as session:
        rotation = session.get(KeyRotation, rotation_id)
        assert rotation is not None
        session.expunge(rotation)
        return rotation


def test_a_worker_killed_mid_rotation_leaves_nothing_lost_or_sealed_twice(
    database,
    isolated_prefix,  # noqa: F811 - the fixture imported above
):
    from domain.tenancy.tenants import create_tenant

    with session_scope() as session:
        tenant = create_tenant(session, name="rotate-kill", owner_email=f"rk-{os.urandom(4).hex()}@example.com")
    keyring = get_keyring()
    with session_scope() as session:
        rows = []
        for index in range(TOKENS):
            token_id = f"tok-{index}"
            rows.append(
                {
                    "tenant_id": tenant.tenant_id,
                    "id": token_id,
                    "type": "token",
                    "containers": ["/general/"],
                    "metadata": {},
                    "search_indexes": [],
                    "created_at": utcnow(),
                    "data_ct": keyring.encrypt(
                        session, tenant.tenant_id, "token", token_id, json.dumps({"n": index}).encode()
                    ),
                }
            )
        session.execute(insert(table_of(Token)), rows)
    env = {
        "TESSERA_REDIS_KEY_PREFIX": isolated_prefix,
        **broker_env(isolated_prefix),
        "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "1",
        "TESSERA_LOG_LEVEL": "WARNING",
    }
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-rotate-kill-"))
    try:
        with processes(log_dir) as start:
            start("beat", [TESSERA, "beat"], env)
            worker_a = start("worker-a", [TESSERA, "worker", "--concurrency", "1", "-n", "a@%h"], env)
            with session_scope() as session:
                rotation = service.start_rotation(session, tenant.tenant_id)
                rotation_id, total = rotation.id, rotation.total
            assert total == TOKENS + 1  # and the tenant's webhook signing secret
            wait_until(lambda: 0 < _rotation(rotation_id).done, timeout=120, interval=0.02)
            os.killpg(worker_a.pid, signal.SIGKILL)  # mid-pass: some chunks committed, one maybe half-done
            worker_a.wait(10)
            killed_at = _rotation(rotation_id)
            assert killed_at.status == "running" and killed_at.done < total, killed_at
            with session_scope() as session:  # its lease ran out (without waiting the 2 minutes)
                session.execute(
                    update(Job)
                    .where(col(Job.id) == killed_at.job_id)
                    .values(lease_expires_at=utcnow() - dt.timedelta(seconds=1))
                )
            start("worker-b", [TESSERA, "worker", "--concurrency", "1", "-n", "b@%h"], env)
            done = wait_until(
                lambda: (r := _rotation(rotation_id)).status == "completed" and r, timeout=240, interval=0.2
            )
    except BaseException:
        print(_log_tail(log_dir), file=sys.stderr)
        raise
    assert done.done == total  # each value counted (and sealed) once, across the kill
    with session_scope() as session:
        report = service.tenant_status(session, tenant.tenant_id)
        heads = {
            bytes(ct[:5])
            for ct in session.exec(select(Token.data_ct).where(col(Token.tenant_id) == tenant.tenant_id)).all()
        }
    assert heads == {version_head(done.version)}
    assert [(v["version"], v["state"], v["values"]) for v in report["versions"]] == [
        (1, "destroyed", 0),
        (2, "active", TOKENS + 1),
    ]
    keyring.forget(tenant.tenant_id)
    with session_scope() as session:
        sample = session.exec(
            select(Token).where(
                col(Token.tenant_id) == tenant.tenant_id, col(Token.id).in_([f"tok-{i}" for i in range(0, TOKENS, 997)])
            )
        ).all()
        opened = {
            row.id: json.loads(keyring.decrypt(session, tenant.tenant_id, "token", row.id, row.data_ct))
            for row in sample
        }
    assert opened == {f"tok-{i}": {"n": i} for i in range(0, TOKENS, 997)}
