"""The production shape as three hosts that share only PostgreSQL, the broker, Redis and S3 (and reach the
sandbox providers, the webhook receiver and the SMTP server over the network): each host a network
namespace of its own with its own data dir and metrics folder (``tests/cluster/conftest.py``).

The whole flow runs with the two api hosts called alternately: tokenize and its signed webhook, a network
token, an agentic payment method, a reactor run, an account-updater batch through pre-signed S3 URLs, an
invitation mail. Then host 3 is killed (every process, SIGKILL) while deliveries and network-token
creates are in flight: every event is delivered (a delivery in flight at the kill may arrive again with the
same ``webhook-id``, as Standard Webhooks allows), every job ends, the card network holds exactly one
network token per create. Last, a host started without the master key refuses to start, naming the
setting, and makes no key file of its own."""

from __future__ import annotations

import json
import time
from collections import Counter
from urllib.parse import urlsplit

import pytest
import requests

from infra.signing import verify
from tests.cluster.conftest import VISA, YEAR, Cluster, card
from tests.conftest import free_port
from tests.factories.hosts import Host
from tests.helpers import wait_until

UPDATED = "4000000000001018"  # the sandbox network has a new number for it (SANDBOX.md)

pytestmark = [pytest.mark.kill, pytest.mark.timeout(600)]


def test_three_hosts_run_the_whole_flow_and_lose_nothing_when_a_worker_host_dies(cluster: Cluster):
    net, receiver, smtp = cluster.net, cluster.receiver, cluster.smtp
    receiver_port = urlsplit(receiver.url).port or 80
    hook_url = net.reach(receiver.url, watch=True)

    # ---- the whole flow, the api hosts in turn
    hook = cluster.client().post(
        "/webhooks",
        {"name": "hosts", "url": hook_url, "events": ["token.created", "account-updater.job.completed"]},
    )
    assert hook.status == 201, hook
    secret = cluster.client().get("/webhooks/signing-key").json["key"]

    token = cluster.client().post("/tokenize", card())
    assert token.status == 201, token
    delivered = receiver.wait_for(lambda r: token.json["id"].encode() in r.body, timeout=60)[0]
    verify(secret, delivered.headers, delivered.body)

    network_token = cluster.client().post("/network-tokens", {"token_id": token.json["id"]})
    assert network_token.status in (201, 202), network_token  # 202: still provisioning past the short wait
    wait_until(lambda: cluster.client().get(f"/network-tokens/{network_token.json['id']}").json["status"] == "active")

    method = cluster.client().post(
        "/agentic/payment-methods",
        {"source": {"type": "svc_card_token", "token_id": token.json["id"]}, "consumer": {"email": "a@example.com"}},
    )
    assert method.status == 201, method
    wait_until(lambda: cluster.client().get(f"/agentic/payment-methods/{method.json['id']}").json["status"] == "active")
    rails = cluster.client().get(f"/agentic/payment-methods/{method.json['id']}").json["rails"]
    assert rails and all(rail["status"] == "enabled" for rail in rails), rails

    reactor = cluster.client().post(
        "/reactors",
        {
            "name": "card-check",
            "runtime": {"image": "node22"},
            "code": "module.exports = async ({ args }) => ({ raw: { last4: args.number.slice(-4) } });",
        },
    )
    assert reactor.status == 201, reactor
    wait_until(lambda: cluster.client().get(f"/reactors/{reactor.json['id']}").json["state"] != "creating", timeout=120)
    assert cluster.client().get(f"/reactors/{reactor.json['id']}").json["state"] == "active"
    reacted = cluster.client().post(
        f"/reactors/{reactor.json['id']}/react",
        {"args": {"number": "{{ " + token.json["id"] + " | json: '$.number' }}"}},
    )
    assert reacted.status == 200 and reacted.json["raw"] == {"last4": VISA[-4:]}, reacted

    old = cluster.client().post("/tokenize", card(UPDATED))
    job = cluster.client().post("/account-updater/jobs")
    assert job.status == 201, job
    csv = f"token,expiration_year,expiration_month,merchant_id\n{old.json['id']},{YEAR % 100},12,\n"
    assert requests.put(job.json["upload_url"], data=csv.encode(), timeout=30).status_code == 200
    wait_until(
        lambda: cluster.client().get(f"/account-updater/jobs/{job.json['id']}").json["status"] == "completed",
        timeout=120,
        interval=0.5,
    )
    finished = cluster.client().get(f"/account-updater/jobs/{job.json['id']}").json
    result = requests.get(finished["download_url"], timeout=30)
    assert result.status_code == 200 and old.json["id"] in result.text and "UPD_PAN" in result.text, result.text
    receiver.wait_for(lambda r: b"account-updater.job.completed" in r.body and job.json["id"].encode() in r.body)

    invited = cluster.client().post("/tenants/self/invitations", {"email": "new@example.com"})
    assert invited.status == 201, invited
    wait_until(lambda: any("new@example.com" in mail.rcpt_tos for mail in smtp.handler.messages), timeout=60)

    if net.namespaces:  # the hosts reached what they share over the bridge, each from its own address
        addresses = {host.address for host in net.hosts}
        assert net.callers(receiver_port) <= addresses and net.callers(receiver_port)
        assert net.callers(urlsplit(cluster.sandbox).port or 80) - {net.hosts[0].address} <= addresses
        database_port = urlsplit(cluster.env["TESSERA_DATABASE_URL"]).port or 5432
        assert net.callers(database_port) == addresses  # every host's processes, none with a local copy
        for host in net.hosts:  # no key file: the hosts share the master key, the database checks it
            assert not list(host.data_dir.rglob("*.key")), list(host.data_dir.rglob("*"))

    # ---- host 3 dies while deliveries and provider calls are in flight
    _one, _two, three = net.hosts
    before = len(receiver.received)
    receiver.hold_next = 6  # the first deliveries' answers wait: their senders are mid-delivery
    tokens = [cluster.client().post("/tokenize", card()) for _ in range(30)]
    assert all(answer.status == 201 for answer in tokens), [a for a in tokens if a.status != 201]
    creates = [cluster.client().post("/network-tokens", {"token_id": t.json["id"]}) for t in tokens[:8]]
    assert all(answer.status in (201, 202) for answer in creates), creates
    wait_until(lambda: receiver.held.is_set(), timeout=60)
    if net.namespaces:  # host 3 is mid-delivery: a request of its own waits for the receiver's answer
        wait_until(lambda: net.in_flight(receiver_port, three) > 0, timeout=60)
    three.kill()
    assert not three.pids()
    receiver.release.set()

    expected = {answer.json["id"] for answer in tokens}
    deadline = time.monotonic() + 240  # a killed delivery's lease runs out (25 s), the relay re-sends it
    while time.monotonic() < deadline:
        arrived = [json.loads(r.body)["event"] for r in receiver.received[before:] if b'"token.created"' in r.body]
        if expected <= {event["data"]["token"]["id"] for event in arrived}:
            break
        time.sleep(0.5)
    received = receiver.received[before:]
    by_token = {json.loads(r.body)["event"]["data"]["token"]["id"]: r for r in received if b'"token.created"' in r.body}
    assert expected <= set(by_token), f"{len(expected - set(by_token))} token.created deliveries lost"

    created_ids = [answer.json["id"] for answer in creates]
    wait_until(
        lambda: all(cluster.client().get(f"/network-tokens/{i}").json["status"] == "active" for i in created_ids),
        timeout=180,
        interval=1,
    )
    # the card network holds one network token per create: none provisioned twice by the retry
    assert cluster.held("network-tokens") == 1 + len(created_ids)
    assert cluster.held("enrollments") == len(rails)

    cluster.settle(120)
    received = receiver.received[before:]  # with the deliveries sent again once the killed leases ran out
    # again only with the same webhook-id (a delivery in flight at the kill); never two ids for one event
    ids_per_event: dict[str, set[str]] = {}
    for request in received:
        verify(secret, request.headers, request.body)
        ids_per_event.setdefault(json.loads(request.body)["event"]["id"], set()).add(request.headers["webhook-id"])
    assert all(len(ids) == 1 for ids in ids_per_event.values()), ids_per_event
    attempts = Counter(r.headers["webhook-id"] for r in received)
    repeated = sum(count - 1 for count in attempts.values())
    # sent again: only what was in flight at the kill (at most the held six; at least the one of host 3's)
    assert repeated <= 6
    if net.namespaces:
        assert repeated >= 1

    # ---- a host started without the master key refuses to start and makes no key file
    blank = Host("host-blank", three.address, net.root / "host-blank", three.netns if net.namespaces else None)
    blank.data_dir.mkdir()
    keyless = {k: v for k, v in cluster.env.items() if k not in ("TESSERA_MASTER_KEY", "TESSERA_MASTER_KEY_FILE")}
    refused = blank.start("api", ["api", "--host", "127.0.0.1", "--port", str(free_port())], keyless)
    assert refused.wait(60) != 0
    output = (blank.data_dir / "api.log").read_text()
    assert "TESSERA_MASTER_KEY" in output, output
    assert not [p for p in blank.data_dir.rglob("*") if p.name != "api.log"], list(blank.data_dir.rglob("*"))
