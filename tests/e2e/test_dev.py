"""``tessera dev`` on the embedded defaults (SQLite database and broker in a data dir), driven like a
newcomer: tenant from the CLI, a webhook, a tokenized card, the signed webhook, a network token; then
SIGTERM stops every child process (the worker's providers node too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from infra.signing import verify
from tests.conftest import free_port
from tests.helpers import ApiClient, WebhookReceiver, wait_until

pytestmark = pytest.mark.timeout(180)


def _clean_env(data_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update(TESSERA_DATA_DIR=str(data_dir), TESSERA_API_PORT=str(port))
    return env


def test_dev_runs_on_embedded_defaults_and_stops_cleanly(tmp_path):
    port = free_port()
    env = _clean_env(tmp_path / "data", port)
    tessera = [sys.executable, "-m", "tessera.cli"]
    log = open(tmp_path / "dev.log", "wb")
    dev = subprocess.Popen([*tessera, "dev"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    receiver = WebhookReceiver().start()
    try:
        client = ApiClient(f"http://127.0.0.1:{port}")
        wait_until(lambda: _status_ok(client), timeout=90, interval=0.5)
        assert (tmp_path / "data" / "tessera.db").exists()
        wait_until(lambda: (tmp_path / "data" / "broker.db").exists(), timeout=30)

        out = subprocess.run(
            [*tessera, "tenants", "create", "--name", "dev", "--owner-email", "dev@example.com", "--json"],
            env=env,
            capture_output=True,
            check=True,
            timeout=60,
        )
        created = json.loads(out.stdout.decode().strip().splitlines()[-1])
        assert set(created) == {"tenant_id", "application_id", "api_key"}
        client = client.with_key(created["api_key"])

        hook = client.post("/webhooks", {"name": "dev", "url": receiver.url, "events": ["token.created"]})
        assert hook.status == 201, hook
        secret = client.get("/webhooks/signing-key").json["key"]
        token = client.post(
            "/tokenize",
            {"type": "card", "data": {"number": "5555555555554444", "expiration_month": 1, "expiration_year": 2032}},
        )
        assert token.status == 201, token
        hit = receiver.wait_for(lambda r: token.json["id"].encode() in r.body, timeout=60)[0]
        verify(secret, hit.headers, hit.body)

        # a provider job: the worker's thread pool of the providers queue takes it from the SQLite broker,
        # and the create's wait, without Redis, ends by polling the database
        card = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2032}
        network_token = client.post("/network-tokens", {"data": card})
        assert network_token.status == 201 and network_token.json["status"] == "active", network_token
    finally:
        receiver.stop()
        children = psutil.Process(dev.pid).children(recursive=True)
        dev.send_signal(signal.SIGTERM)
        dev.wait(timeout=40)
        log.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.2)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], (
        tmp_path / "dev.log"
    ).read_text()[-3000:]
    assert dev.returncode == 0, (tmp_path / "dev.log").read_text()[-3000:]


def _status_ok(client: ApiClient) -> bool:
    try:
        return client.get("/status").status == 200
    except Exception:
        return False
