"""No card number, CVC, API key, private key or webhook signing secret in the logs, problem details,
webhook payloads, stored events or Celery task arguments of the whole test run.

The scanner (``tests/security/leaks.py``) watches every test of the run; the final test here runs a
workload that hands the platform each kind of secret (cards with CVCs in tokens, intents, network
tokens and agentic payment methods, refused requests that carry card numbers in the wrong places,
webhooks signed with the tenant's secret, API keys shown once) and then fails on anything found
anywhere in the run.
"""

from __future__ import annotations

import time

from tests.conftest import TEST_DATABASE_URL
from tests.factories.agentic import created, settled
from tests.helpers import wait_until
from tests.ops.conftest import CAPTURE
from tests.ops.scan import find_secrets
from tests.security.leaks import LEAKS, observe, scan_database

PAN = "4242424242424242"
CARD = {"number": PAN, "expiration_month": 12, "expiration_year": time.gmtime().tm_year + 2, "cvc": "123"}


def test_the_scanner_sees_a_private_key_and_each_channel_records_findings():
    pem = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEI...\n-----END EC PRIVATE KEY-----"
    assert find_secrets(pem) == ["private key: PEM"]
    assert find_secrets("-----BEGIN PUBLIC KEY-----") == []
    before = len(LEAKS.findings)
    probe = type(LEAKS)()
    probe.observe("task arguments", b'{"pan": "4242424242424242"}')
    assert [f[1:3] for f in probe.findings] == [("task arguments", "card number: 424242…42")]
    assert len(LEAKS.findings) == before  # a probe of its own: the run's findings are untouched


def _workload(tenant, receiver) -> None:
    client = tenant.client
    hook = client.post(
        "/webhooks", {"name": "scan", "url": receiver.url, "events": ["token.created", "network-token.created"]}
    )
    assert hook.status == 201, hook
    assert client.get("/webhooks/signing-key").json["key"].startswith("whsec_")
    token = client.post("/tokens", {"type": "card", "data": CARD, "metadata": {"note": "scan"}})
    assert token.status == 201, token
    assert client.post("/token-intents", {"type": "card", "data": CARD}).status == 201
    network = client.post("/network-tokens", {"data": {k: v for k, v in CARD.items() if k != "cvc"}})
    assert network.status in (201, 202), network
    settled(client, created(client)["id"])
    application = client.post(
        "/applications", {"name": "scan", "type": "server_to_server", "permissions": ["token:create"]}
    )
    assert application.status == 201, application
    # refused requests that carry secrets where they do not belong: the problems must not repeat them
    refusals = [
        client.post("/tokens", {"type": "card", "data": {**CARD, "number": "4242424242424241"}}),
        client.post("/tokens", {"type": "card", "data": {**CARD, "expiration_month": 13}}),
        client.post("/tokens", {"type": "bank", "data": {"account_number": PAN, "cvc": "123"}}),
        client.post("/tokens", {"type": PAN, "data": CARD}),
        client.post("/webhooks", {"name": PAN, "url": f"https://{PAN}.invalid/x?cvc=123", "events": [PAN]}),
        client.get(f"/tokens/{PAN}"),
        client.with_key(application.json["key"] + "x").get("/tokens"),
        client.with_key(application.json["key"]).get(f"/tokens?number={PAN}"),
    ]
    assert all(answer.status >= 400 for answer in refusals), refusals
    receiver.wait_for(lambda r: r.json["event"]["type"] == "network-token.created")
    wait_until(lambda: client.get(f"/network-tokens/{network.json['id']}").json["status"] != "pending", timeout=30)


def test_no_secret_leaks_anywhere(api, tenant, receiver):
    """Runs last (``tests/security/leaks.py`` moves it): every channel of the whole run was scanned."""
    _workload(tenant, receiver)
    rows = scan_database(TEST_DATABASE_URL)
    observe("logs", "")  # the logs are scanned by their capture as they are written
    scanned = dict(LEAKS.scanned)
    print(f"secrets scan: {CAPTURE.count} log records, {rows} database rows, {scanned}")
    assert scanned.get("problem details", 0) >= 8 and scanned.get("task arguments", 0) >= 3
    assert scanned.get("webhook deliveries", 0) >= 1 and scanned.get("event payloads", 0) >= 1
    assert CAPTURE.count > 0
    report = "\n".join(f"{test} [{channel}] {kinds}: {text}" for test, channel, kinds, text in LEAKS.findings[:50])
    logs = "\n".join(f"{test} [{logger}] {kinds}: {line}" for test, logger, kinds, line in CAPTURE.findings[:50])
    assert not LEAKS.findings, f"{len(LEAKS.findings)} secrets seen:\n{report}"
    assert not CAPTURE.findings, f"{len(CAPTURE.findings)} log records hold secrets:\n{logs}"


def test_a_logged_traceback_never_shows_the_frames_local_variables():
    """The console format's rich tracebacks showed every frame's locals: a request body with its card
    number reached the log of an api whose database went away. Both formats leave locals out."""
    import io
    import logging
    import uuid

    from infra import logs

    for log_format in ("console", "json"):
        buffer = io.StringIO()
        handler = logging.StreamHandler(buffer)
        handler.setFormatter(logs.formatter(log_format))
        logger = logging.getLogger(f"tessera.test.{uuid.uuid4().hex}")
        logger.handlers[:] = [handler]
        logger.propagate = False

        def handle(body: dict):
            raise RuntimeError("the database went away")

        try:
            handle({"data": CARD})
        except RuntimeError:
            logger.exception("unhandled error")
        text = buffer.getvalue()
        assert "the database went away" in text and "handle" in text  # the traceback is there ...
        assert find_secrets(text) == [], (log_format, find_secrets(text))  # ... without the body
