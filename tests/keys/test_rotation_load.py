"""Key rotations under a steady request load: while ``keys.rewrap`` moves the wrapped keys of many
tenants under a new master key (the old one previous), and while a tenant's data key is rotated, a
few clients keep tokenizing and reading tokens back; every answer is a 2xx, and afterwards nothing
is left under the previous key or version and every value reads back."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from domain.keys import service
from storage.crypto import get_keyring
from storage.db import session_scope
from tests.conftest import TenantFixture, make_tenant
from tests.helpers import wait_until

pytestmark = pytest.mark.worker

CLIENTS = 3
TENANTS = 24
CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}


@dataclass
class Load:
    """What the clients did: ``made`` (token id -> the data it was made with, per tenant), every
    answer's status, and the answers that were not 2xx (call, status, body)."""

    made: dict[str, tuple[TenantFixture, dict]] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    failed: list[tuple[str, int, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        """Stop the clients and wait for their last requests."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)


def _client(tenants: list[TenantFixture], offset: int, load: Load) -> None:
    """Round the tenants until ``load.stop()``: tokenize a card, read it back, and read a token of
    the tenant made earlier."""
    turn = offset
    while not load.stopping.is_set():
        tenant = tenants[turn % len(tenants)]
        data = {**CARD, "expiration_month": 1 + turn % 12}
        made = tenant.client.post("/tokenize", {"type": "card", "data": data})
        answers = [("POST /tokenize", made)]
        if 200 <= made.status < 300:
            answers.append(("GET /tokens/{id}", tenant.client.get(f"/tokens/{made.json['id']}")))
        with load.lock:
            earlier = [token_id for token_id, (owner, _) in load.made.items() if owner is tenant]
            if 200 <= made.status < 300:
                load.made[made.json["id"]] = (tenant, data)
        if earlier:
            answers.append(("GET /tokens/{id} (earlier)", tenant.client.get(f"/tokens/{random.choice(earlier)}")))
        with load.lock:
            for call, got in answers:
                load.statuses.append(got.status)
                if not 200 <= got.status < 300:
                    load.failed.append((call, got.status, got.raw[:300]))
        turn += CLIENTS


@pytest.fixture
def steady_load(api) -> Iterator[tuple[list[TenantFixture], Load]]:
    """:data:`TENANTS` tenants and :data:`CLIENTS` client threads tokenizing and reading their tokens
    until the test calls ``load.stop()`` (or ends)."""
    tenants = [make_tenant(api, name=f"load-{n}") for n in range(TENANTS)]
    load = Load()
    load.threads = [threading.Thread(target=_client, args=(tenants, n, load), daemon=True) for n in range(CLIENTS)]
    for thread in load.threads:
        thread.start()
    yield tenants, load
    load.stop()


def _read_back(load: Load) -> None:
    for token_id, (tenant, data) in load.made.items():
        answer = tenant.client.get(f"/tokens/{token_id}")
        assert answer.status == 200, (token_id, answer)
        assert answer.json["data"] == data


def _requests_until(load: Load, count: int) -> None:
    wait_until(lambda: len(load.statuses) >= count, timeout=30, interval=0.05)


def test_a_rewrap_under_load_fails_no_request(steady_load, new_master_key, rewrap, monkeypatch):
    _, load = steady_load
    use, old, new = new_master_key
    monkeypatch.setattr(service, "REWRAP_CHUNK", 2)  # many short transactions among the requests
    _requests_until(load, 30)  # the clients are under way with the new key current, the old one previous
    with session_scope() as session:
        assert service.status(session)["data_keys_under_previous"] >= 2 * TENANTS
    before = len(load.statuses)
    report = rewrap(timeout=60)
    assert len(load.statuses) > before  # answered while the rewrap ran
    _requests_until(load, len(load.statuses) + 10)  # and still after it
    load.stop()
    assert load.failed == []
    assert report["data_keys_under_previous"] == 0 and report["key_check"] == "ok"
    use(new, None)  # the previous key gone: every value opens with the new one alone
    _read_back(load)
    use(new, old)  # for the fixture's way back


def test_a_data_key_rotation_under_load_fails_no_request(steady_load, monkeypatch):
    tenants, load = steady_load
    monkeypatch.setattr(service, "CHUNK", 7)  # many chunks among the requests
    _requests_until(load, 60)
    rotated = tenants[:4]
    with session_scope() as session:
        for tenant in rotated:
            service.start_rotation(session, tenant.id)

    def completed() -> bool:
        with session_scope() as session:
            return all(
                service.tenant_status(session, tenant.id)["rotation"]["status"] == "completed" for tenant in rotated
            )

    wait_until(completed, timeout=60, interval=0.2)
    load.stop()
    assert load.failed == []
    with session_scope() as session:
        for tenant in rotated:
            versions = service.tenant_status(session, tenant.id)["versions"]
            assert [(v["version"], v["state"], v["values"] == 0) for v in versions] == [
                (1, "destroyed", True),
                (2, "active", False),
            ]
    for tenant in rotated:
        get_keyring().forget(tenant.id)
    _read_back(load)
