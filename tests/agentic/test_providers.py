"""The agentic provider adapter (classification of answers, timeouts, sandbox vs live selection), the
card merge, consumer codes; and the worker paths the sandbox cannot produce on demand (transient
failures, dead letters, RAIL_ALREADY_ENROLLED), through the API with the adapter scripted."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.api import Call
from config.settings import Settings
from domain.agentic.consumers import canonical_language_code, normalize_country_code
from domain.agentic.payment_methods import merge_card, rails_for_brand
from infra.jobs import TransientError
from providers import agentic_http as providers
from providers.agentic import EnrollmentCard, EnrollmentFailed
from providers.agentic_http import HttpAgenticProvider, display_card, provider_for
from tests.factories.agentic import (
    BASE,
    FAILS_ON_CREATE,
    assert_problem,
    card_token,
    create,
    created,
    get,
    jobs_of,
    later,
    outcome,
    rail_events,
    settled,
    subscribe,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.api

CARD = EnrollmentCard("4242424242424242", 12, 2031, "123")
CONSUMER = {"id": "c1", "email": "a@example.com", "country_code": None}


class Scripted:
    """A provider on loopback answering each request with the next (status, body, delay) of a script."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.requests: list[dict] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                scripted.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": json.loads(body) if body else None,
                    }
                )
                status, payload, delay = scripted.answers.pop(0)
                if delay:
                    threading.Event().wait(delay)
                data = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(status)
                self.send_header("content-length", str(len(data)))
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def adapter(self, read_timeout: float = 2.0) -> HttpAgenticProvider:
        return HttpAgenticProvider(
            "vic", f"http://127.0.0.1:{self.server.server_port}/vic", connect_timeout=1, read_timeout=read_timeout
        )

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(*answers):
        made.append(Scripted(*answers))
        return made[-1]

    yield make
    for server in made:
        server.close()


ENROLLED = {
    "id": "enr_1",
    "provider": "vic",
    "status": "enabled",
    "provider_ids": {"a": "b", "n": 1},
    "card": {
        "brand": "visa",
        "bin": "42424242",
        "pan": "4242424242424242",
        "product": {"code": "A"},
        "display": {"art_url": "x", "evil": "y"},
    },
}


def test_an_enrollment_is_sent_with_the_key_and_read_back_reduced(scripted):
    server = scripted((201, ENROLLED, 0))
    enrollment = server.adapter().enroll(CARD, CONSUMER, attempt="retry", idempotency_key="job-1")
    sent = server.requests[0]
    assert sent["path"] == "/vic/enrollments" and sent["headers"]["idempotency-key"] == "job-1"
    assert sent["body"]["attempt"] == "retry" and sent["body"]["cvc"] == "123"
    assert sent["body"]["consumer"] == {"id": "c1", "email": "a@example.com"}
    assert enrollment.id == "enr_1" and enrollment.status == "enabled"
    assert enrollment.provider_ids == {"a": "b"}
    assert enrollment.card == {
        "brand": "visa",
        "bin": "42424242",
        "type": "card",
        "display": {
            "art_url": "x",
            "background_color": None,
            "foreground_color": None,
            "description": None,
            "issuer_name": None,
        },
    }
    assert "4242424242424242" not in repr(CARD)


@pytest.mark.parametrize(
    ("status", "payload", "code", "provider_code", "http"),
    [
        (
            422,
            {"code": "CARD_REJECTED", "message": "secret text", "provider_correlation_id": "corr_1"},
            "CARD_REJECTED",
            "CARD_REJECTED",
            422,
        ),
        (422, {"code": "UNSUPPORTED_CARD_NETWORK"}, "PROVIDER_ENROLLMENT_FAILED", "UNSUPPORTED_CARD_NETWORK", 422),
        (409, {"code": "RAIL_ALREADY_ENROLLED"}, "RAIL_ALREADY_ENROLLED", "RAIL_ALREADY_ENROLLED", 409),
        (422, {"code": "RAIL_ENROLLMENT_INVALID"}, "RAIL_ENROLLMENT_INVALID", "RAIL_ENROLLMENT_INVALID", 422),
        (400, {"code": "invalid_request"}, "PROVIDER_ENROLLMENT_FAILED", "invalid_request", 422),
        (404, None, "PROVIDER_ENROLLMENT_FAILED", "HTTP_404", 422),
        (201, {"id": 1}, "PROVIDER_ENROLLMENT_FAILED", None, 422),
    ],
)
def test_rejections_are_classified_by_the_catalogue(scripted, status, payload, code, provider_code, http):
    server = scripted((status, payload, 0))
    with pytest.raises(EnrollmentFailed) as failure:
        server.adapter().enroll(CARD, CONSUMER, attempt="create", idempotency_key="k")
    assert (failure.value.code, failure.value.provider_code, failure.value.status) == (code, provider_code, http)
    assert "secret text" not in str(failure.value)
    if payload and payload.get("provider_correlation_id"):
        assert failure.value.correlation_id == "corr_1"


def test_5xx_and_unreachable_are_transient_but_a_read_timeout_is_conclusive(scripted):
    server = scripted((503, {"code": "down"}, 0), (200, ENROLLED, 3))
    with pytest.raises(TransientError):
        server.adapter().enroll(CARD, CONSUMER, attempt="create", idempotency_key="k")
    with pytest.raises(EnrollmentFailed) as failure:
        server.adapter(read_timeout=0.5).enroll(CARD, CONSUMER, attempt="create", idempotency_key="k")
    assert failure.value.code == "PROVIDER_ENROLLMENT_FAILED" and failure.value.provider_code is None
    unreachable = HttpAgenticProvider("vic", "http://127.0.0.1:1", connect_timeout=0.5, read_timeout=0.5)
    with pytest.raises(TransientError):
        unreachable.enroll(CARD, CONSUMER, attempt="create", idempotency_key="k")


def test_delete_treats_404_as_removed(scripted):
    server = scripted((204, None, 0), (404, {"code": "not_found"}, 0), (500, None, 0))
    adapter = server.adapter()
    adapter.delete_enrollment("enr_1")
    adapter.delete_enrollment("enr_2")
    with pytest.raises(TransientError):
        adapter.delete_enrollment("enr_3")
    assert [r["method"] for r in server.requests] == ["DELETE"] * 3


def test_test_tenants_use_the_sandbox_and_production_the_live_urls():
    settings = Settings(sandbox_url="http://sandbox:1/", vic_url="https://vic.example/v1", psp_url=None)
    assert provider_for("vic", "test", settings).http.base_url == "http://sandbox:1/agentic/vic"
    assert provider_for("vic", "production", settings).http.base_url == "https://vic.example/v1"
    assert provider_for("psp", "production", settings) is None
    assert provider_for("agentpay", "production", settings) is None
    assert provider_for("psp", "test", settings).read_timeout == settings.agentic_provider_timeout_seconds
    with pytest.raises(ValueError):
        provider_for("other", "test", settings)


def test_rails_follow_the_brand():
    assert rails_for_brand("visa") == [("agentic-token", "vic"), ("spt", "psp")]
    assert rails_for_brand("mastercard") == [("agentic-token", "agentpay"), ("spt", "psp")]
    assert rails_for_brand("amex") == [("spt", "psp")]
    assert rails_for_brand("discover") == [] and rails_for_brand(None) == []


def test_merge_card_fills_gaps_and_backfills_display_only():
    current = {"type": "card", "brand": "visa", "last4": "4242", "display": {"art_url": None, "description": "old"}}
    merged, changed = merge_card(
        current,
        display_card({"brand": "mastercard", "bin": "4242", "display": {"art_url": "new", "description": "new"}}),
    )
    assert changed
    assert merged["brand"] == "visa" and merged["bin"] == "4242"
    assert merged["display"]["art_url"] == "new" and merged["display"]["description"] == "old"
    assert merge_card(merged, display_card({"bin": "4242", "display": {"art_url": "other"}})) == (merged, False)
    assert merge_card(current, None) == (current, False)


@pytest.mark.parametrize(("value", "expected"), [("gb", "GB"), ("Us", "US"), ("GB", "GB")])
def test_country_codes(value, expected):
    assert normalize_country_code(value) == expected


@pytest.mark.parametrize("value", ["XX", "EU", "ZZ", "G", "GBR", "1A"])
def test_unassigned_country_codes_are_refused(value):
    with pytest.raises(ValueError):
        normalize_country_code(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("en", "en"), ("en-gb", "en-GB"), ("iw", "he"), ("zh-hant-tw", "zh-Hant-TW"), ("de-DE-1996", "de-DE-1996")],
)
def test_language_codes_are_canonicalised(value, expected):
    assert canonical_language_code(value) == expected


@pytest.mark.parametrize("value", ["e", "en_US", "english", "123", "zz", "x" * 36, "en--gb"])
def test_invalid_language_codes_are_refused(value):
    with pytest.raises(ValueError):
        canonical_language_code(value)


# ---- worker paths with the adapter scripted -----------------------------------------------------------


def _vic_enroll(monkeypatch, behaviour):
    real = HttpAgenticProvider.enroll
    calls = []

    def enroll(self, card, consumer, *, attempt, idempotency_key):
        if self.name == "vic":
            calls.append(idempotency_key)
            return behaviour(
                len(calls), lambda: real(self, card, consumer, attempt=attempt, idempotency_key=idempotency_key)
            )
        return real(self, card, consumer, attempt=attempt, idempotency_key=idempotency_key)

    monkeypatch.setattr(providers.HttpAgenticProvider, "enroll", enroll)
    return calls


def test_a_transient_failure_is_retried_with_the_same_key(tenant, monkeypatch):
    def flaky(call_number, proceed):
        if call_number == 1:
            raise TransientError("vic answered 503", retry_after=0.1)
        return proceed()

    calls = _vic_enroll(monkeypatch, flaky)
    pm = created(tenant.client)
    assert outcome(pm) == {"vic": "enabled", "psp": "enabled"}
    assert len(calls) == 2 and calls[0] == calls[1]  # the job id, both times
    vic_job = next(j for j in jobs_of(pm["id"]) if str(j.id) == calls[0])
    assert vic_job.attempts == 2 and vic_job.status == "succeeded"


def test_transient_failures_past_the_attempts_leave_the_rail_in_error_not_pending(tenant, monkeypatch):
    def down(call_number, proceed):
        raise TransientError("vic answered 503", retry_after=0.2)

    calls = _vic_enroll(monkeypatch, down)
    pm = create(tenant.client, card_token(tenant.client)).json  # 4 attempts 0.2 s apart: within the wait
    assert outcome(pm) == {"vic": "PROVIDER_ENROLLMENT_FAILED", "psp": "enabled"}
    assert settled(tenant.client, pm["id"]) == pm
    assert len(calls) == 4 and len(set(calls)) == 1
    assert [j.status for j in jobs_of(pm["id"]) if str(j.id) == calls[0]] == ["dead"]
    errors = tenant.client.get(f"{BASE}/{pm['id']}/errors").json["data"]
    assert [(e["code"], e["provider"]) for e in errors] == [("PROVIDER_ENROLLMENT_FAILED", "vic")]
    assert rail_events(tenant.id, pm["id"]) == []  # never shown pending: no event


@pytest.mark.parametrize(("code", "status"), [("RAIL_ALREADY_ENROLLED", 409), ("RAIL_ENROLLMENT_INVALID", 422)])
def test_retry_answers_the_providers_rejection(tenant, monkeypatch, code, status):
    pm = created(tenant.client, FAILS_ON_CREATE)

    def rejects(call_number, proceed):
        raise EnrollmentFailed(
            code,
            "rejected",
            provider_code=code,
            correlation_id="corr_9",
            status=409 if code == "RAIL_ALREADY_ENROLLED" else 422,
        )

    _vic_enroll(monkeypatch, rejects)
    problem = assert_problem(
        tenant.client.post(f"{BASE}/{pm['id']}/rails/retry", {"rail": "agentic-token", "provider": "vic"}), status, code
    )
    assert problem["debug"] == {"provider_correlation": "corr_9"}
    assert outcome(get(tenant.client, pm["id"]))["vic"] == code


# ---- the bounded wait ends before the work -------------------------------------------------------------


def _no_wait(monkeypatch):
    async def expired(call, job_ids, *, timeout):
        return {}

    monkeypatch.setattr(Call, "wait_for_jobs", expired)


def _slow_vic(monkeypatch, seconds: float = 1.0):
    def slow(call_number, proceed):
        time.sleep(seconds)
        return proceed()

    return _vic_enroll(monkeypatch, slow)


def test_rails_still_running_when_the_wait_ends_are_pending_and_their_outcome_is_an_event(
    tenant, receiver, monkeypatch
):
    subscribe(tenant, receiver.url)
    _no_wait(monkeypatch)
    _slow_vic(monkeypatch)
    pm = create(tenant.client, card_token(tenant.client)).json
    assert outcome(pm)["vic"] == "pending"

    final = settled(tenant.client, pm["id"])
    assert outcome(final) == {"vic": "enabled", "psp": "enabled"}
    hits = receiver.wait_for(lambda r: r.json["event"]["data"]["rail"]["provider"] == "vic", timeout=20)
    assert hits[0].json["event"]["data"]["rail"]["status"] == "enabled"
    events = rail_events(tenant.id, pm["id"])
    assert sorted(e["rail"]["provider"] for e in events) == sorted(p for p, s in outcome(pm).items() if s == "pending")


def test_a_retry_still_running_when_the_wait_ends_is_shown_pending(tenant, monkeypatch):
    pm = created(tenant.client, FAILS_ON_CREATE)
    _no_wait(monkeypatch)
    _slow_vic(monkeypatch)
    answer = tenant.client.post(f"{BASE}/{pm['id']}/rails/retry", {"rail": "agentic-token", "provider": "vic"})
    assert answer.status == 200, answer
    assert outcome(answer.json)["vic"] == "pending" and "error" not in answer.json["rails"][0]
    assert later(answer.json, pm)  # error -> pending is visible
    assert outcome(settled(tenant.client, pm["id"]))["vic"] == "enabled"
    assert [e["rail"]["status"] for e in rail_events(tenant.id, pm["id"])] == ["enabled"]


def test_a_delete_still_running_when_the_wait_ends_is_409_then_204(tenant, monkeypatch):
    pm = created(tenant.client)
    _no_wait(monkeypatch)
    real_delete = HttpAgenticProvider.delete_enrollment

    def slow_delete(self, enrollment_id):  # the cascade takes 6 s: the three calls below fit in
        time.sleep(3.0)
        return real_delete(self, enrollment_id)

    monkeypatch.setattr(providers.HttpAgenticProvider, "delete_enrollment", slow_delete)
    assert_problem(tenant.client.delete(f"{BASE}/{pm['id']}"), 409, "PAYMENT_METHOD_DELETE_IN_PROGRESS")
    assert_problem(tenant.client.delete(f"{BASE}/{pm['id']}"), 409, "PAYMENT_METHOD_DELETE_IN_PROGRESS")
    assert_problem(
        tenant.client.post(f"{BASE}/{pm['id']}/rails/retry", {"rail": "spt", "provider": "psp"}),
        409,
        "PAYMENT_METHOD_DELETE_IN_PROGRESS",
    )
    wait_until(lambda: get(tenant.client, pm["id"])["status"] == "deleted", timeout=20)
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204
