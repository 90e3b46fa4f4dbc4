"""Structured logs: JSON lines with trace, tenant, job and task on every line; a human format for
``tessera dev``; and no card number, CVC, API key or secret in any line of the whole test run."""

from __future__ import annotations

import io
import json
import logging
import uuid

from infra import logs
from tests.helpers import wait_until
from tests.ops import probe
from tests.ops.conftest import CAPTURE
from tests.ops.scan import find_secrets, redact


def _logger_to(buffer: io.StringIO, log_format: str) -> logging.Logger:
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logs.formatter(log_format))
    logger = logging.getLogger(f"tessera.test.{uuid.uuid4().hex}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_a_json_line_carries_the_context_fields():
    buffer = io.StringIO()
    logger = _logger_to(buffer, "json")
    job_id = uuid.uuid4()
    with logs.bound(trace_id="trace-1", job_id=job_id, task="webhooks.deliver"):
        logs.bind_lazy(lambda: {"tenant_id": uuid.UUID(int=7)})
        logger.info("delivered %s of %s", 1, 2, extra={"webhook_id": "w-1"})
        logs.get_logger(logger.name).warning("structlog event", attempt=2)
    logs.clear()
    logger.info("outside any unit of work")
    first, second, third = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert first["message"] == "delivered 1 of 2"
    assert first["level"] == "info" and first["logger"] == logger.name and first["time"].endswith("Z")
    assert first["trace_id"] == "trace-1"
    assert first["tenant_id"] == str(uuid.UUID(int=7))
    assert first["job_id"] == str(job_id)
    assert first["task"] == "webhooks.deliver"
    assert first["webhook_id"] == "w-1"
    assert second["message"] == "structlog event" and second["attempt"] == 2 and second["trace_id"] == "trace-1"
    assert {k: third[k] for k in logs.CONTEXT_FIELDS} == dict.fromkeys(logs.CONTEXT_FIELDS)


def test_the_console_format_is_one_readable_line():
    buffer = io.StringIO()
    logger = _logger_to(buffer, "console")
    with logs.bound(trace_id="trace-2"):
        logger.warning("webhook disabled")
    line = buffer.getvalue().strip()
    assert not line.startswith("{")
    assert "webhook disabled" in line and "trace_id=trace-2" in line and "warning" in line
    assert "tenant_id" not in line  # unset context is left out of the human format


def test_api_lines_carry_the_trace_and_the_tenant(api, tenant, receiver):
    trace = f"ops-{uuid.uuid4().hex[:12]}"
    answer = tenant.client.post(
        "/webhooks",
        {"name": "logs", "url": receiver.url, "events": ["token.created"]},
        headers={"TS-TRACE-ID": trace},
    )
    assert answer.status == 201, answer
    line = wait_until(
        lambda: next((x for x in CAPTURE.json_lines() if x.get("trace_id") == trace and x.get("route")), None)
    )
    assert line["logger"] == "tessera.api.access"
    assert line["tenant_id"] == str(tenant.id)
    assert (line["method"], line["route"], line["status"]) == ("POST", "/webhooks", 201)
    assert line["duration_ms"] >= 0


def test_task_lines_carry_the_task_the_job_and_its_trace(worker, tenant):
    trace = f"ops-{uuid.uuid4().hex[:12]}"
    probe.MODE["value"] = "transient"
    job = probe.record(max_attempts=1, tenant_id=tenant.id, trace_id=trace)
    wait_until(lambda: probe.read(job.id).status == "dead")
    line = wait_until(
        lambda: next(
            (x for x in CAPTURE.json_lines() if x.get("job_id") == str(job.id) and "dead letter" in x["message"]), None
        )
    )
    assert line["task"] == probe.KIND
    assert line["trace_id"] == trace
    assert line["tenant_id"] == str(tenant.id)
    assert line["level"] == "warning"


def test_the_scanner_finds_each_kind_of_secret():
    assert find_secrets("card 4242424242424242 declined") == ["card number: 424242…42"]
    assert find_secrets('{"number": "5555 5555 5555 4444"}') == ["card number: 555555…44"]
    assert find_secrets("key=key_" + "A" * 43)[0].startswith("API key: key_AA")
    assert find_secrets("secret whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")[0].startswith("webhook secret")
    assert find_secrets('{"cvc": "123"}') == ['CVC: cvc"…']
    assert find_secrets("cvv=4321")
    # Ids, durations and timestamps are not card numbers.
    assert find_secrets(f"job {uuid.uuid4()} took 0.2857597529998202 s at 1795239729354 pid 31350") == []
    assert find_secrets("4242424242424241") == []  # fails the Luhn check
    assert redact("GET /x?pan=4242424242424242&cvc=123 key_" + "B" * 43) == "GET /x?pan=424242…42&cvc=… key_BB…BB"


def test_no_secret_reaches_a_log_line():
    """Runs last (``tests/ops/conftest.py`` moves it): every record of the run was scanned."""
    assert CAPTURE in logging.getLogger().handlers
    assert CAPTURE.count > 0
    assert any(line.get("logger") == "tessera.api.access" for line in CAPTURE.json_lines())
    report = "\n".join(f"{test} [{logger}] {found}: {line}" for test, logger, found, line in CAPTURE.findings[:50])
    assert not CAPTURE.findings, f"{len(CAPTURE.findings)} log records hold secrets:\n{report}"
