"""The agentic providers vic, agentpay and psp: SANDBOX.md's agentic table, idempotency, callbacks."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ApiClient, WebhookReceiver, wait_until
from tests.sandbox import HANG_SECONDS, PENDING_SECONDS, admin, card, future_year, idempotent, post_with_timeout

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
AMEX = "378282246310005"
REJECTED = "4000000000003014"
FAILS_ON_CREATE = "4000000000003022"
PENDING = "4000000000003030"
HANGS = "4000000000003048"
CONSUMER = {"id": "consumer-1", "email": "ada@example.com", "country_code": "GB", "language_code": "en-GB"}

ENABLED = (201, "enabled")
UNSUPPORTED = (422, "UNSUPPORTED_CARD_NETWORK")


def enrollment(pan: str, attempt: str = "create", **fields) -> dict:
    """An enrollment request body for ``pan``."""
    return card(pan, cvc="123", consumer=CONSUMER, attempt=attempt, **fields)


def enroll(client: ApiClient, provider: str, pan: str, attempt: str = "create", key: str | None = None, **fields):
    """POST an enrollment of ``pan`` with ``provider``."""
    headers = idempotent(key) if key else None
    return client.post(f"/agentic/{provider}/enrollments", enrollment(pan, attempt, **fields), headers=headers)


def outcome(answer) -> tuple[int, str]:
    """``(status, enrollment status or error code)`` of an enrollment answer."""
    return answer.status, answer.json.get("status") or answer.json["code"]


@pytest.mark.parametrize(
    ("pan", "vic", "agentpay", "psp"),
    [
        (VISA, ENABLED, UNSUPPORTED, ENABLED),
        (MASTERCARD, UNSUPPORTED, ENABLED, ENABLED),
        (AMEX, UNSUPPORTED, UNSUPPORTED, ENABLED),
        (REJECTED, (422, "CARD_REJECTED"), UNSUPPORTED, ENABLED),
        (FAILS_ON_CREATE, (422, "PROVIDER_ENROLLMENT_FAILED"), UNSUPPORTED, ENABLED),
        (PENDING, (201, "pending"), UNSUPPORTED, ENABLED),
        ("4000056655665556", ENABLED, UNSUPPORTED, ENABLED),
        ("2223003122003222", UNSUPPORTED, ENABLED, ENABLED),
        ("6011111111111117", UNSUPPORTED, UNSUPPORTED, UNSUPPORTED),
    ],
)
def test_each_provider_answers_the_create_per_the_table(sandbox, pan, vic, agentpay, psp):
    answers = {provider: outcome(enroll(sandbox, provider, pan)) for provider in ("vic", "agentpay", "psp")}

    assert answers == {"vic": vic, "agentpay": agentpay, "psp": psp}
    held = admin(sandbox, "enrollments", pan_last4=pan[-4:])["enrollments"]
    assert sorted(item["provider"] for item in held) == sorted(
        provider for provider, (status, _) in answers.items() if status == 201
    )


@pytest.mark.parametrize(
    ("provider", "pan", "brand", "background"),
    [
        ("vic", VISA, "visa", "#1A1F71"),
        ("agentpay", MASTERCARD, "mastercard", "#000000"),
        ("psp", AMEX, "amex", "#2E77BB"),
    ],
)
def test_an_enabled_enrollment_describes_the_card_with_display_data(sandbox, provider, pan, brand, background):
    answer = enroll(sandbox, provider, pan)

    assert answer.status == 201
    enrolled = answer.json
    assert enrolled["id"].startswith("enr_") and enrolled["provider"] == provider
    assert enrolled["provider_ids"] and all(enrolled["provider_ids"].values())
    details = enrolled["card"]
    assert (details["brand"], details["bin"], details["last4"]) == (
        brand,
        pan[:8] if len(pan) >= 16 else pan[:6],
        pan[-4:],
    )
    assert (details["expiration_month"], details["expiration_year"]) == (12, future_year())
    assert details["funding"] == "credit"
    display = details["display"]
    assert display["background_color"] == background and display["foreground_color"] == "#FFFFFF"
    assert display["issuer_name"] == "Tessera Sandbox Bank" and display["description"]
    assert ApiClient("").get(display["art_url"]).headers["Content-Type"] == "image/png"
    assert pan not in str(enrolled)
    assert sandbox.get(f"/agentic/{provider}/enrollments/{enrolled['id']}").json == enrolled


def test_vic_rejects_the_rejected_card_on_create_and_on_retry(sandbox):
    create = enroll(sandbox, "vic", REJECTED)
    retry = enroll(sandbox, "vic", REJECTED, "retry")

    assert outcome(create) == outcome(retry) == (422, "CARD_REJECTED")
    assert retry.json["provider_correlation_id"].startswith("corr_")
    assert admin(sandbox, "enrollments", provider="vic", pan_last4="3014")["count"] == 0


def test_vic_fails_the_create_of_the_failing_card_and_a_retry_enables_it(sandbox):
    create = enroll(sandbox, "vic", FAILS_ON_CREATE, key="rail-create")
    replayed = enroll(sandbox, "vic", FAILS_ON_CREATE, key="rail-create")
    retry = enroll(sandbox, "vic", FAILS_ON_CREATE, "retry", key="rail-create")

    assert outcome(create) == (422, "PROVIDER_ENROLLMENT_FAILED")
    assert create.json["provider_correlation_id"].startswith("corr_") and create.json["message"]
    assert (replayed.status, replayed.json) == (422, create.json)
    assert outcome(retry) == ENABLED
    assert admin(sandbox, "enrollments", provider="vic", pan_last4="3022")["count"] == 1


def test_a_pending_enrollment_turns_enabled_on_its_own_and_calls_back(sandbox):
    receiver = WebhookReceiver().start()
    try:
        answer = enroll(sandbox, "vic", PENDING, key="pending-1", callback_url=receiver.url)
        path = f"/agentic/vic/enrollments/{answer.json['id']}"
        pending_now = sandbox.get(path).json["status"]
        started = time.monotonic()
        enabled = wait_until(lambda: sandbox.get(path).json["status"] == "enabled", timeout=10)
        elapsed = time.monotonic() - started
        callbacks = receiver.wait_for(lambda received: True, timeout=10)
    finally:
        receiver.stop()

    assert outcome(answer) == (201, "pending") and pending_now == "pending" and enabled
    assert elapsed <= PENDING_SECONDS + 2
    assert len(callbacks) == 1
    assert callbacks[0].json == {**answer.json, "status": "enabled"}
    replayed = enroll(sandbox, "vic", PENDING, key="pending-1")
    assert (replayed.status, replayed.json) == (201, answer.json)


def test_a_pending_enrollment_deleted_before_it_completes_stays_deleted(sandbox):
    enrolled = enroll(sandbox, "vic", PENDING).json
    path = f"/agentic/vic/enrollments/{enrolled['id']}"

    assert sandbox.delete(path).status == 204
    time.sleep(PENDING_SECONDS + 0.3)

    assert sandbox.get(path).status == 404
    assert admin(sandbox, "enrollments", provider="vic")["count"] == 0


def test_a_callback_that_cannot_be_delivered_is_ignored(sandbox):
    enrolled = enroll(sandbox, "vic", PENDING, callback_url="http://127.0.0.1:9/unreachable").json
    path = f"/agentic/vic/enrollments/{enrolled['id']}"

    assert wait_until(lambda: sandbox.get(path).json["status"] == "enabled", timeout=10)


def test_vic_never_answers_for_the_hanging_card_while_other_requests_are_served(sandbox, sandbox_url):
    path = "/agentic/vic/enrollments"
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        patient = pool.submit(post_with_timeout, sandbox_url, path, enrollment(HANGS), HANG_SECONDS + 5)
        impatient = post_with_timeout(sandbox_url, path, enrollment(HANGS), 1.0)
        meanwhile = enroll(sandbox, "psp", HANGS)
        last = patient.result()
        elapsed = time.monotonic() - started

    assert impatient is None
    assert outcome(meanwhile) == ENABLED
    assert elapsed >= HANG_SECONDS
    assert last.status == 504 and last.json()["code"] == "PROVIDER_TIMEOUT"
    assert admin(sandbox, "enrollments", provider="vic", pan_last4="3048")["count"] == 0


def test_the_same_key_returns_the_same_enrollment_and_a_new_key_another(sandbox):
    first = enroll(sandbox, "vic", VISA, key="rail-1")
    again = enroll(sandbox, "vic", VISA, key="rail-1")
    other = enroll(sandbox, "vic", VISA, key="rail-2")
    psp = enroll(sandbox, "psp", VISA, key="rail-1")

    assert (again.status, again.json) == (201, first.json)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert other.json["id"] != first.json["id"] and psp.json["id"] != first.json["id"]
    assert admin(sandbox, "enrollments", provider="vic", pan_last4="4242")["count"] == 2
    assert admin(sandbox, "requests", endpoint="agentic.vic.enrollments.create", pan=VISA)["total"] == 3


def test_concurrent_calls_with_one_key_make_one_enrollment(sandbox):
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda _: enroll(sandbox, "agentpay", MASTERCARD, key="same"), range(4)))

    assert {answer.json["id"] for answer in answers} == {answers[0].json["id"]}
    assert admin(sandbox, "enrollments", provider="agentpay", pan_last4="4444")["count"] == 1
    assert admin(sandbox, "requests", endpoint="agentic.agentpay.enrollments.create")["total"] == 4


def test_delete_removes_the_enrollment_and_is_idempotent(sandbox):
    enrolled = enroll(sandbox, "psp", VISA).json
    path = f"/agentic/psp/enrollments/{enrolled['id']}"

    assert sandbox.get(f"/agentic/vic/enrollments/{enrolled['id']}").status == 404
    assert sandbox.delete(f"/agentic/vic/enrollments/{enrolled['id']}").status == 204
    assert sandbox.get(path).status == 200
    assert [sandbox.delete(path).status for _ in range(2)] == [204, 204]
    assert sandbox.get(path).status == 404
    assert admin(sandbox, "enrollments", provider="psp")["count"] == 0
    assert admin(sandbox, "requests", endpoint="agentic.psp.enrollments.delete", pan_last4="4242")["total"] == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (enrollment("4000000000003010"), "pan"),
        ({**enrollment(VISA), "consumer": None}, "consumer"),
        ({**enrollment(VISA), "consumer": {"email": "ada@example.com"}}, "consumer.id"),
        ({**enrollment(VISA), "consumer": {"id": "c", "email": "nope"}}, "consumer.email"),
        ({**enrollment(VISA), "consumer": {**CONSUMER, "country_code": 44}}, "consumer.country_code"),
        ({**enrollment(VISA), "attempt": "again"}, "attempt"),
        ({key: value for key, value in enrollment(VISA).items() if key != "attempt"}, "attempt"),
        (enrollment(VISA, callback_url="ftp://example.com/x"), "callback_url"),
        (enrollment(VISA, callback_url=7), "callback_url"),
        (enrollment(VISA, expiration_month=0), "expiration_month"),
    ],
)
def test_malformed_enrollments_answer_400_naming_the_field(sandbox, body, field):
    answer = sandbox.post("/agentic/vic/enrollments", body)

    assert answer.status == 400
    assert answer.json["code"] == "invalid_request" and field in answer.json["errors"]


def test_an_unknown_provider_answers_404(sandbox):
    assert sandbox.post("/agentic/other/enrollments", enrollment(VISA)).status == 404
    assert sandbox.get("/agentic/other/enrollments/enr_1").status == 404
