"""Fairness between tenants: one tenant flooding webhook deliveries to a slow receiver does not delay
another tenant's webhook deliveries or network-token provisioning beyond :data:`BOUND_SECONDS`.

On a platform of its own (real api, beat and a worker with two prefork processes, as a small machine
runs it). Tenant A queues ``TESSERA_FAIRNESS_FLOOD`` (default 200) events for a receiver that answers
in :data:`SLOW_SECONDS`; one FIFO for everyone would keep tenant B's delivery behind A's, about
``flood * SLOW_SECONDS / 2`` seconds (200 s here). With the per-tenant slot cap
(``TESSERA_WEBHOOK_TENANT_SLOTS``, ``domain/webhooks/service.py``) A holds one worker process and
B's delivery and provisioning go through within the bound; A's deliveries all arrive afterwards.
On demand: ``TESSERA_FAIRNESS_FLOOD=10000`` and ``TESSERA_FAIRNESS_SLOW_SECONDS=5`` (the issue's figures).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from tests.api.test_agentic_support import fresh_visa
from tests.chaos.platform import platform
from tests.chaos.test_worker_kill import _card, _provision
from tests.helpers import ApiClient, WebhookReceiver, wait_until

FLOOD = int(os.environ.get("TESSERA_FAIRNESS_FLOOD", "200"))
SLOW_SECONDS = float(os.environ.get("TESSERA_FAIRNESS_SLOW_SECONDS", "2"))
#: How long tenant B may wait for its webhook delivery and its network token while A floods.
BOUND_SECONDS = 15.0


def test_a_tenant_flooding_a_slow_receiver_does_not_delay_another_tenant(redis_flushed, s3_server):
    slow, fast = WebhookReceiver(delay=SLOW_SECONDS).start(), WebhookReceiver().start()
    try:
        with platform("chaos-fair") as p:
            flooder = p.client
            other = ApiClient(p.api_url, json.loads(p.processes.run(
                "tenants", "create", "--name", "patient", "--owner-email", "patient@example.com",
                "--json"))["api_key"])
            for client, receiver in ((flooder, slow), (other, fast)):
                hook = client.post("/webhooks", {"name": "fair", "url": receiver.url, "events": ["token.created"]})
                assert hook.status == 201, hook
            flood = [_card(flooder, fresh_visa()) for _ in range(FLOOD)]  # queued before any worker runs
            p.start_worker(concurrency=2)
            wait_until(lambda: slow.received, timeout=60)  # the flood is being delivered

            started = time.monotonic()
            token_id = _card(other, fresh_visa())
            network = _provision(dataclasses.replace(p, client=other))
            fast.wait_for(lambda r: token_id.encode() in r.body, timeout=BOUND_SECONDS)
            delivered_in = time.monotonic() - started
            wait_until(lambda: other.get(f"/network-tokens/{network['id']}").json["status"] != "inactive",
                       timeout=BOUND_SECONDS, interval=0.2)
            provisioned_in = time.monotonic() - started
            flooded_by_then = len(slow.received)

            # the flood is not lost, only paced: every event reaches the slow receiver once
            wait_until(lambda: len({r.json["event"]["data"]["token"]["id"] for r in list(slow.received)})
                       >= FLOOD, timeout=60 + FLOOD * SLOW_SECONDS / 20, interval=1)
            ids = [r.json["event"]["data"]["token"]["id"] for r in list(slow.received)]
            assert sorted(set(ids)) == sorted(flood) and len(ids) == len(set(ids))
            assert not p.unfinished_work()
            print(f"fairness: tenant B delivered in {delivered_in:.1f} s and provisioned in {provisioned_in:.1f} s "
                  f"(bound {BOUND_SECONDS} s) while A had {flooded_by_then} of {FLOOD} slow deliveries done; "
                  f"A's all done {time.monotonic() - started:.1f} s after B started")
    finally:
        slow.stop()
        fast.stop()
