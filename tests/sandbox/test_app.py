"""The sandbox application as a whole: health, JSON errors, admin endpoints, reset, ``run``."""

from __future__ import annotations

import signal
import time
from threading import Thread
from urllib.parse import urlencode

import pytest

from sandbox.app import settings_from_environment
from tests.sandbox import admin, card, post_with_timeout, sandbox_process

VISA = "4242424242424242"
SLOW = "4000000000002032"


def test_health_answers_ok(sandbox):
    answer = sandbox.get("/health")

    assert (answer.status, answer.json) == (200, {"status": "ok"})


def test_unknown_paths_and_methods_answer_json_errors(sandbox):
    missing = sandbox.get("/nowhere")
    wrong_method = sandbox.request("PUT", "/health")

    assert (missing.status, missing.json["code"]) == (404, "not_found")
    assert (wrong_method.status, wrong_method.json["code"]) == (405, "method_not_allowed")


def test_reset_forgets_tokens_enrollments_keys_and_counts(sandbox):
    headers = {"Idempotency-Key": "before-reset"}
    first = sandbox.post("/card-network/network-tokens", card(VISA), headers=headers).json
    enrollment = card(VISA, consumer={"id": "c", "email": "c@example.com"}, attempt="create")
    sandbox.post("/agentic/vic/enrollments", enrollment)

    assert sandbox.post("/_admin/reset").status == 204

    assert admin(sandbox, "network-tokens")["count"] == 0
    assert admin(sandbox, "enrollments")["count"] == 0
    assert admin(sandbox, "requests") == {"requests": [], "total": 0}
    again = sandbox.post("/card-network/network-tokens", card(VISA), headers=headers)
    assert again.status == 201 and again.json["id"] != first["id"]


def test_reset_aborts_a_running_operation(sandbox, sandbox_url):
    def reset_soon():
        time.sleep(0.2)
        sandbox.post("/_admin/reset")

    resetter = Thread(target=reset_soon)
    resetter.start()
    answer = post_with_timeout(sandbox_url, "/card-network/network-tokens", card(SLOW), 5.0)
    resetter.join()

    assert answer.status == 503 and answer.json()["code"] == "aborted"
    assert admin(sandbox, "network-tokens")["count"] == 0


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"pan_last4": "42"}, "pan_last4"),
        ({"pan_last4": "abcd"}, "pan_last4"),
        ({"pan": VISA, "par": "SBX1AAAAAAAAAAAAAAAAAAAAAAAAA"}, "pan"),
    ],
)
def test_admin_filters_are_validated(sandbox, query, field):
    answer = sandbox.get(f"/_admin/requests?{urlencode(query)}")

    assert answer.status == 400 and field in answer.json["errors"]


def test_run_reads_its_settings_from_the_environment_and_stops_on_sigterm():
    with sandbox_process(TESSERA_SANDBOX_SLOW_SECONDS="0.3") as (process, base_url):
        started = time.monotonic()
        answer = post_with_timeout(base_url, "/card-network/network-tokens", card(SLOW), 10.0)
        elapsed = time.monotonic() - started
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=10)

    assert answer.status == 201
    assert 0.3 <= elapsed < 5
    assert process.returncode == 0
    assert output.strip() == f"tessera sandbox: Running on {base_url}"


def test_settings_from_the_environment():
    environ = {"TESSERA_SANDBOX_HANG_SECONDS": "4.5", "TESSERA_SANDBOX_PENDING_SECONDS": "", "OTHER": "1"}

    assert settings_from_environment(environ) == {"hang_seconds": 4.5}
    with pytest.raises(ValueError, match="TESSERA_SANDBOX_SLOW_SECONDS"):
        settings_from_environment({"TESSERA_SANDBOX_SLOW_SECONDS": "soon"})
    with pytest.raises(ValueError, match="TESSERA_SANDBOX_PENDING_SECONDS"):
        settings_from_environment({"TESSERA_SANDBOX_PENDING_SECONDS": "-1"})
