"""Flower as operators use it: ``tessera flower`` behind basic auth on the platform's Celery app, a
real headless Chromium reading its tasks page, where a Tessera task shows as succeeded with ids (and
nothing secret) for arguments. Chromium comes from Debian's ``chromium`` package
(``scripts/chromium.sh``); without it the browser test is skipped."""

from __future__ import annotations

import html
import os
import re
import subprocess
import tempfile
import time

import pytest
import urllib3
from sqlmodel import select

from storage.db import session_scope
from storage.models import WebhookDelivery
from tests.browser import CHROMIUM, CHROMIUM_FLAGS, SKIP_REASON
from tests.conftest import free_port
from tests.helpers import wait_until
from tests.ops.conftest import TESSERA
from tests.ops.scan import find_secrets

pytestmark = pytest.mark.timeout(180)

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}
USER, PASSWORD = "ops", "flower-test-password"


@pytest.fixture
def flower(api, tmp_path):
    """``tessera flower`` on the run's broker (the in-process worker's events), basic auth on."""
    port = free_port()
    env = {**os.environ, "TESSERA_FLOWER_USER": USER, "TESSERA_FLOWER_PASSWORD": PASSWORD}
    log = (tmp_path / "flower.log").open("wb")
    process = subprocess.Popen(
        [*TESSERA, "flower", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    headers = urllib3.make_headers(basic_auth=f"{USER}:{PASSWORD}")

    def up():
        assert process.poll() is None, (tmp_path / "flower.log").read_text()
        try:
            answer = urllib3.request("GET", base + "/api/workers", headers=headers, timeout=2, retries=False)
            return answer.status == 200
        except urllib3.exceptions.HTTPError:
            return False

    wait_until(up, timeout=60, interval=0.3)
    yield base, headers
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()


def _flower_tasks(base: str, headers: dict, delivery_ids: set[str]) -> dict | None:
    answer = urllib3.request("GET", base + "/api/tasks?taskname=webhooks.deliver", headers=headers, timeout=5)
    assert answer.status == 200, answer.data
    for task in answer.json().values():
        if task.get("state") == "SUCCESS" and any(d in (task.get("kwargs") or "") for d in delivery_ids):
            return task
    return None


def _render(url: str, tmp_path) -> str:
    """The DOM of ``url`` after its scripts ran (its data loaded through Flower's API)."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as profile:
        done = subprocess.run(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_flower_refuses_to_start_without_a_password():
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_FLOWER_PASSWORD"}
    done = subprocess.run([*TESSERA, "flower"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "TESSERA_FLOWER_PASSWORD" in done.stderr


def test_flower_on_the_embedded_broker_refuses_in_one_line_naming_the_setting(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_BROKER_URL"}
    env.update(TESSERA_FLOWER_PASSWORD=PASSWORD, TESSERA_DATA_DIR=str(tmp_path))
    done = subprocess.run([*TESSERA, "flower"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("error: the embedded SQLite broker carries no task events") and "TESSERA_BROKER_URL" in line


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
def test_flower_shows_a_tessera_task_succeeded_with_ids_for_arguments(flower, tenant, receiver, tmp_path):
    base, headers = flower
    assert urllib3.request("GET", base + "/api/tasks", timeout=5).status == 401  # the API is behind basic auth
    hook = tenant.client.post("/webhooks", {"name": "flower", "url": receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook

    def delivered_task():
        # Flower sees the events of tasks run after it connected: tokenize until one shows up.
        token = tenant.client.post("/tokenize", CARD)
        assert token.status == 201, token
        receiver.wait_for(lambda r: token.json["id"].encode() in r.body)
        with session_scope() as session:
            query = select(WebhookDelivery).where(WebhookDelivery.tenant_id == tenant.id)
            ids = {str(d.id) for d in session.exec(query)}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            task = _flower_tasks(base, headers, ids)
            if task:
                return task, ids
            time.sleep(0.3)
        return None

    task, delivery_ids = wait_until(delivered_task, timeout=60, interval=0.1)
    assert task["name"] == "webhooks.deliver" and task["state"] == "SUCCESS"
    assert task["args"] == "()" and "delivery_ids" in task["kwargs"]
    assert not find_secrets(task["kwargs"]) and "4242424242424242" not in str(task)

    credentials = f"http://{USER}:{PASSWORD}@{base.removeprefix('http://')}"
    page = _render(credentials + "/tasks", tmp_path)
    row = re.search(rf'<tr id="{task["uuid"]}"[^>]*>(.*?)</tr>', page, re.S)
    assert row, page[-3000:]
    assert "webhooks.deliver" in row.group(1)
    assert "SUCCESS" in row.group(1)

    detail = html.unescape(_render(credentials + f"/task/{task['uuid']}", tmp_path))
    assert "webhooks.deliver" in detail and "SUCCESS" in detail
    assert any(delivery_id in detail for delivery_id in delivery_ids)  # the arguments show ids
    assert "4242424242424242" not in detail and not find_secrets(detail)
