"""Rolling restarts: under a steady load of 50 requests/s mixing tokenize, token reads and network-token
creates, sent through a load balancer in front of the two api hosts, every role is restarted one host at a
time with SIGTERM to its main process, as ``docker stop`` and Kubernetes send it (the api on host 1, then
on host 2, the worker on host 2, then on host 3, beat). No request fails, every job ends, nothing is done
twice: each event is delivered once (the platform's own attempt log shows one attempt each), the card
network holds one network token per create.

The balancer (``tests/factories/hosts.py``) sends each connection to the api hosts in turn and skips one
that refuses the connection, as a load balancer's passive health check does; the clients open a connection
per request. What the test asks of the platform: an api that gets SIGTERM stops listening, then finishes the
requests it holds; a worker finishes or hands back its tasks; beat's restart leaves nothing behind."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

from tests.cluster.conftest import Cluster, card
from tests.helpers import wait_until

pytestmark = [pytest.mark.kill, pytest.mark.timeout(600)]

RATE = 50.0  # requests per second, all clients together
CLIENTS = 10


@dataclass
class Load:
    """Clients sending a mix of requests at ``RATE`` through ``base_url`` until :meth:`stop`."""

    base_url: str
    key: str
    seeds: list[str]
    answers: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    network_tokens: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(CLIENTS)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        parts = urlsplit(self.base_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        try:
            headers = {"TS-API-KEY": self.key, "Connection": "close", "content-type": "application/json"}
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read() or b"{}")
        finally:
            conn.close()

    def _client(self, number: int) -> None:
        pace = CLIENTS / RATE
        chooser = random.Random(number)
        next_at = time.monotonic() + chooser.random() * pace
        while not self._stop.is_set():
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += pace
            roll = chooser.random()
            with self._lock:
                known = list(self.tokens[-50:]) or self.seeds
            if roll < 0.5:
                kind, method, path, body, ok = "tokenize", "POST", "/tokenize", card(), (201,)
            elif roll < 0.8:
                kind, method, path, body, ok = "read", "GET", f"/tokens/{chooser.choice(known)}", None, (200,)
            else:
                token = chooser.choice(self.seeds)
                kind, method, path, body, ok = (
                    "network token",
                    "POST",
                    "/network-tokens",
                    {"token_id": token},
                    (201, 202),
                )
            try:
                status, answer = self._request(method, path, body)
            except (OSError, http.client.HTTPException) as error:
                with self._lock:
                    self.failures.append(f"{kind}: {type(error).__name__}: {error}")
                continue
            with self._lock:
                self.answers[kind] += 1
                if status not in ok:
                    self.failures.append(f"{kind}: {status} {answer}")
                elif kind == "tokenize":
                    self.tokens.append(answer["id"])
                elif kind == "network token":
                    self.network_tokens.append(answer["id"])


def test_each_role_restarts_one_host_at_a_time_under_load_without_a_failed_request(cluster: Cluster):
    net, receiver = cluster.net, cluster.receiver
    one, two, three = net.hosts
    hook = cluster.client().post(
        "/webhooks", {"name": "rolling", "url": net.reach(receiver.url), "events": ["token.created"]}
    )
    assert hook.status == 201, hook
    seeds = [cluster.client().post("/tokenize", card()).json["id"] for _ in range(4)]
    balancer = net.balancer(cluster.api_port, cluster.api_hosts)

    load = Load(balancer, cluster.key or "", seeds).start()
    stopped_within: dict[str, float] = {}
    try:
        time.sleep(3)
        for host, role in ((one, "api"), (two, "api"), (two, "worker"), (three, "worker"), (one, "beat")):
            stopped_within[f"{role} on {host.name}"] = cluster.restart(host, role)
            if role == "api":
                wait_until(lambda h=host: cluster.serving(h), timeout=60, interval=0.2)
            time.sleep(3)
    finally:
        load.stop()
    print(f"answers {dict(load.answers)}; stopped within (s) {stopped_within}")

    assert load.failures == [], [f[:60] for f in load.failures]
    assert sum(load.answers.values()) >= RATE * 15  # the load ran all along
    assert load.answers["network token"] and load.answers["tokenize"] and load.answers["read"]

    # every job ends; every create's network token turns active, provisioned once at the card network
    cluster.settle(180)
    created = set(load.network_tokens)
    for network_token in created:
        assert cluster.client().get(f"/network-tokens/{network_token}").json["status"] == "active"
    assert cluster.held("network-tokens") == len(created)

    # each token's event delivered, once
    tokens = set(seeds) | set(load.tokens)
    wait_until(lambda: tokens <= _delivered(receiver), timeout=120, interval=0.5)
    ids = Counter(r.headers["webhook-id"] for r in receiver.received)
    again = [webhook_id for webhook_id, count in ids.items() if count > 1]
    outcomes = cluster.sql("SELECT outcome, error, count(*) AS attempts FROM webhook_attempts GROUP BY 1, 2")
    assert again == [], f"{len(again)} deliveries sent more than once; attempts: {outcomes}"
    assert len(ids) == len(tokens)


def _delivered(receiver) -> set[str]:
    return {json.loads(r.body)["event"]["data"]["token"]["id"] for r in list(receiver.received)}
