"""Customer code's isolation over real HTTP, with the real worker, PostgreSQL and Redis: no right its
creator lacks, deleted code's processes ended on every worker by a broadcast, fair slots between
tenants (a flood by one does not starve another's synchronous ``react``), and 503 where the sandbox
cannot be made."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
from sqlmodel import func, select

from config.settings import reload_settings
from domain.reactors.runtime import reactor_runtime
from infra.celery import celery_app
from infra.node_runtime.owners import END_CODE_COMMAND, REACTOR, owner_prefix
from storage.db import session_scope
from storage.models import Job
from storage.models_reactors import Reactor
from tests.conftest import app_with_permissions
from tests.helpers import wait_until

from .test_api import active, react

SLEEP = (
    "module.exports = async (req) => { await new Promise((r) => setTimeout(r, req.args.ms)); "
    "return { raw: 'slept' }; };"
)


def _keys(tenant_id, reactor_id) -> list[str]:
    prefix = owner_prefix(tenant_id, REACTOR, reactor_id)
    return [key for key in reactor_runtime().pool.keys() if key.startswith(prefix)]


def test_a_reactor_cannot_be_given_permissions_its_creator_lacks(tenant):
    limited = app_with_permissions(tenant, ["reactor:create", "reactor:read", "reactor:update", "reactor:invoke"])
    asked = {"image": "node22", "permissions": ["token:pci:create", "token:pci:read:high"]}
    refused = limited.post(
        "/reactors", {"name": "grab", "code": "module.exports = async () => ({});", "runtime": asked}
    )
    assert refused.status == 403, refused
    assert "token:pci:create" in refused.json["detail"] and "token:pci:read:high" in refused.json["detail"]
    assert set(refused.json["errors"]) == {"runtime.permissions"}
    with session_scope() as session:
        assert session.exec(select(func.count()).select_from(Reactor).where(Reactor.tenant_id == tenant.id)).one() == 0

    # the creator may give what it holds; an update asking for more is refused the same way
    reactor = active(limited, "module.exports = async () => ({ raw: 1 });")
    update = limited.put(
        f"/reactors/{reactor['id']}", {"name": "grab", "code": "module.exports = async () => ({});", "runtime": asked}
    )
    assert update.status == 403, update
    # the management key holds both: it may give them
    held = active(tenant.client, "module.exports = async () => ({ raw: 1 });", runtime=asked)
    assert held["runtime"]["permissions"] == ["token:pci:create", "token:pci:read:high"]


def test_a_proxy_code_transform_cannot_be_given_permissions_its_creator_lacks(tenant):
    limited = app_with_permissions(tenant, ["proxy:create"])
    transform = {
        "type": "code",
        "code": "module.exports = async (r) => r.args;",
        "runtime": {"image": "node22", "permissions": ["token:pci:read:high"]},
    }
    refused = limited.post(
        "/proxies", {"name": "p", "destination_url": "https://api.example.com", "request_transforms": [transform]}
    )
    assert refused.status == 403, refused
    assert "token:pci:read:high" in refused.json["detail"]


def test_the_end_code_broadcast_reaches_the_worker():
    replies = celery_app.control.broadcast(
        END_CODE_COMMAND, arguments={"prefix": "nobody:reactor:none:"}, reply=True, timeout=3
    )
    assert replies and all(next(iter(r.values())) == {"ok": "0 ended"} for r in replies), replies


def test_deleting_a_reactor_ends_its_processes_on_the_worker_within_seconds(tenant):
    c = tenant.client
    reactor = active(c, "const keep = Buffer.alloc(32 << 20, 1); module.exports = async () => ({ raw: keep.length });")
    assert react(c, reactor["id"]).json["raw"] == 32 << 20
    keys = _keys(tenant.id, reactor["id"])
    assert len(keys) == 1
    pids = reactor_runtime().pool.pids(keys[0])
    assert pids
    assert c.delete(f"/reactors/{reactor['id']}").status == 204
    wait_until(lambda: not _keys(tenant.id, reactor["id"]), timeout=5, interval=0.05)
    assert wait_until(lambda: all(_ended(pid) for pid in pids), timeout=5)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` ended: gone, or a zombie its parent has not reaped yet (it may end
    between two looks: then it is gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def two_slots():
    """Reactor slots of the test worker: two (it has four threads, shared with the other queues)."""
    os.environ["TESSERA_REACTOR_SLOTS"] = "2"
    reload_settings()
    yield 2
    del os.environ["TESSERA_REACTOR_SLOTS"]
    reload_settings()


def _running(tenant_id) -> int:
    with session_scope() as session:
        return session.exec(
            select(func.count())
            .select_from(Job)
            .where(Job.kind == "reactors.run", Job.tenant_id == tenant_id, Job.status == "running")
        ).one()


def test_a_tenant_alone_uses_every_slot_and_another_tenant_is_not_starved(tenant, other_tenant, two_slots):
    a, b = tenant.client, other_tenant.client
    sleeper = active(a, SLEEP)
    quick = active(b, "module.exports = async () => ({ raw: 'quick' });")
    run_ms = 6000
    started = [a.post(f"/reactors/{sleeper['id']}/react-async", {"args": {"ms": run_ms}}) for _ in range(5)]
    assert all(s.status == 202 for s in started)
    # alone, tenant A holds both slots at once
    assert wait_until(lambda: _running(tenant.id) == 2, timeout=20, interval=0.05)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _running(tenant.id))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        began = time.monotonic()
        answer = react(b, quick["id"])
        waited = time.monotonic() - began
    finally:
        stop.set()
        watcher.join()
    assert answer.status == 200 and answer.json["raw"] == "quick", answer
    # B did not wait for one of A's runs to end (each takes 6 s): it had a slot at once
    assert waited < run_ms / 1000 - 2, waited
    assert peak[0] <= 2  # A never held more than the slots
    for s in started:  # A's backlog drains in full (nothing dropped by the fair picking)
        request_id = s.json["async_reactor_request_id"]
        assert wait_until(
            lambda rid=request_id: a.get(f"/reactors/{sleeper['id']}/results/{rid}").status == 200,
            timeout=60,
            interval=0.2,
        )


def test_without_the_sandbox_reactors_answer_503_and_nothing_runs(tenant):
    c = tenant.client
    reactor = active(c, "module.exports = async () => ({ raw: 1 });")
    os.environ["TESSERA_REACTOR_BWRAP"] = "/nonexistent/bwrap"
    reload_settings()
    try:
        created = c.post(
            "/reactors", {"name": "n", "code": "module.exports = async () => ({});", "runtime": {"image": "node22"}}
        )
        invoked = react(c, reactor["id"])
        later = c.post(f"/reactors/{reactor['id']}/react-async", {"args": {}})
    finally:
        del os.environ["TESSERA_REACTOR_BWRAP"]
        reload_settings()
    for answer in (created, invoked, later):
        assert answer.status == 503, answer
        assert answer.headers["content-type"].startswith("application/problem+json")
        assert "bubblewrap (/nonexistent/bwrap) is not installed" in answer.json["detail"]
    assert react(c, reactor["id"]).json["raw"] == 1  # with the sandbox back, it runs
