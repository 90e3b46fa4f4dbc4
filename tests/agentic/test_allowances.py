"""Allowances over real HTTP with a real worker and the sandbox providers: create, read, list,
verification, update, cancellation, the payment method delete cascade."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from storage.db import session_scope
from storage.models_agentic import PaymentMethodRail
from tests.factories.agentic import AMEX, BASE, REJECTED, VISA, assert_problem, created, fresh_visa, rail_rows
from tests.factories.allowances import (
    ALLOWANCES,
    CANCEL_FAILS_ONCE,
    NO_VERIFICATION,
    OTP,
    REJECTS_SETUP,
    allowance,
    amounts,
    events_of,
    mint,
    rails,
    read,
    usd,
    verified,
    verify,
)

pytestmark = pytest.mark.api

# ---- create, read, list ----------------------------------------------------------------------------


def test_create_sets_up_every_enabled_rail_with_exact_amounts(tenant):
    before = dt.datetime.now(dt.UTC)
    alw = allowance(tenant.client, amount="25.5", description="groceries")

    assert alw["id"].startswith("alw_")
    assert alw["status"] == "pending_verification"
    assert alw["amount"] == usd("25.50")
    assert alw["amount_available"] == usd("25.50")
    assert alw["amount_reserved"] == usd("0.00") and alw["amount_spent"] == usd("0.00")
    assert alw["description"] == "groceries"
    by_provider = rails(alw)
    assert by_provider["vic"]["status"] == "inactive" and by_provider["vic"]["rail"] == "agentic-token"
    assert by_provider["psp"]["status"] == "active" and by_provider["psp"]["rail"] == "spt"
    assert by_provider["vic"]["provider_ids"]["mandate_reference"].startswith("vic_mdt_")
    expires = dt.datetime.fromisoformat(alw["expires_at"])
    assert dt.timedelta(days=29, hours=23) < expires - before < dt.timedelta(days=30, minutes=5)
    assert read(tenant.client, alw["id"]) == alw


def test_an_amex_allowance_has_only_the_spt_rail_and_is_active(tenant):
    alw = allowance(tenant.client, AMEX)
    assert alw["status"] == "active"
    assert [(r["rail"], r["provider"], r["status"]) for r in alw["rails"]] == [("spt", "psp", "active")]
    assert events_of(tenant.id, "agentic.allowance.updated") == [{"allowance": {"id": alw["id"], "status": "active"}}]


def test_a_rejected_setup_is_a_rail_error_with_its_provider_error(tenant):
    alw = allowance(tenant.client, REJECTS_SETUP)
    by_provider = rails(alw)
    assert by_provider["vic"]["status"] == "error"
    assert by_provider["vic"]["error"] == {"code": "PROVIDER_ALLOWANCE_FAILED"}
    assert by_provider["psp"]["status"] == "active"
    assert alw["status"] == "active"
    errors = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/errors")
    assert errors.status == 200, errors
    [error] = errors.json["data"]
    assert error["code"] == "PROVIDER_ALLOWANCE_FAILED" and error["operation"] == "allowance"
    assert error["allowance_id"] == alw["id"] and error["provider"] == "vic"


def test_create_validates_amount_currency_and_expiry(tenant):
    pm = created(tenant.client)
    cases = [
        ({"amount": {"value": "1.001", "currency": "USD"}}, "amount.value"),
        ({"amount": {"value": "0", "currency": "USD"}}, "amount.value"),
        ({"amount": {"value": "abc", "currency": "USD"}}, "amount.value"),
        ({"amount": {"value": "1.00", "currency": "ZZZ"}}, "amount.currency"),
        ({"amount": usd("1.00"), "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        (
            {"amount": usd("1.00"), "expires_at": (dt.datetime.now(dt.UTC) + dt.timedelta(days=400)).isoformat()},
            "expires_at",
        ),
    ]
    for extra, field in cases:
        answer = tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], **extra})
        problem = assert_problem(answer, 400, "VALIDATION_ERROR")
        assert field in problem["errors"], (extra, problem)
    answer = tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": {"value": 12, "currency": "jpy"}})
    assert answer.status == 201, answer
    assert answer.json["amount"] == {"value": "12", "currency": "JPY"}


def test_create_errors_of_the_payment_method(tenant):
    assert_problem(
        tenant.client.post(ALLOWANCES, {"payment_method_id": "pm_nothing", "amount": usd("1.00")}),
        404,
        "PAYMENT_METHOD_NOT_FOUND",
    )
    pm = created(tenant.client)
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204
    assert_problem(
        tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": usd("1.00")}),
        400,
        "PAYMENT_METHOD_DELETED",
    )
    # a payment method whose every rail failed (the rails' outcome written as an enrollment failure would)
    pm = created(tenant.client, REJECTED)
    with session_scope() as session:
        for rail in rail_rows(pm["id"]):
            current = session.get(PaymentMethodRail, rail.id)
            current.status, current.error_code = "error", "PROVIDER_ENROLLMENT_FAILED"
            session.add(current)
    assert_problem(
        tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": usd("1.00")}), 400, "NO_ACTIVE_RAILS"
    )


def test_create_with_an_idempotency_key_answers_the_same_allowance(tenant):
    pm = created(tenant.client)
    body = {"payment_method_id": pm["id"], "amount": usd("5.00")}
    headers = {"TS-IDEMPOTENCY-KEY": "alw-key-1"}
    first = tenant.client.post(ALLOWANCES, body, headers=headers)
    again = tenant.client.post(ALLOWANCES, body, headers=headers)
    assert first.status == again.status == 201
    assert again.json["id"] == first.json["id"]
    other = tenant.client.post(ALLOWANCES, {**body, "amount": usd("6.00")}, headers=headers)
    assert_problem(other, 409, "IDEMPOTENCY_CONFLICT")
    listed = tenant.client.get(f"{ALLOWANCES}?payment_method_id={pm['id']}")
    assert [a["id"] for a in listed.json["data"]] == [first.json["id"]]


def test_get_list_and_not_found(tenant, other_tenant):
    first = allowance(tenant.client, AMEX)
    second = allowance(tenant.client, AMEX)
    page = tenant.client.get(f"{ALLOWANCES}?size=1")
    assert page.status == 200, page
    assert [a["id"] for a in page.json["data"]] == [second["id"]]
    rest = tenant.client.get(f"{ALLOWANCES}?size=1&start={page.json['pagination']['next']}")
    assert [a["id"] for a in rest.json["data"]] == [first["id"]]
    active = tenant.client.get(f"{ALLOWANCES}?status=active&size=100")
    assert {a["id"] for a in active.json["data"]} >= {first["id"], second["id"]}
    assert tenant.client.get(f"{ALLOWANCES}?status=cancelled").json["data"] == []
    assert_problem(other_tenant.client.get(f"{ALLOWANCES}/{first['id']}"), 404, "ALLOWANCE_NOT_FOUND")
    assert_problem(tenant.client.get(f"{ALLOWANCES}/alw_nothing/errors"), 404, "ALLOWANCE_NOT_FOUND")


def test_permissions_are_enforced(tenant, limited):
    alw = allowance(tenant.client, AMEX)
    reader = limited(tenant, ["agentic:allowance:get"])
    assert reader.get(f"{ALLOWANCES}/{alw['id']}").status == 200
    assert_problem(reader.delete(f"{ALLOWANCES}/{alw['id']}"), 403, "FORBIDDEN")
    assert_problem(mint(reader, alw["id"]), 403, "FORBIDDEN")


# ---- verification --------------------------------------------------------------------------------


def test_verification_start_wrong_codes_then_the_right_one(tenant):
    alw = allowance(tenant.client)
    assert_problem(verify(tenant.client, alw["id"], "submit_otp", OTP), 400, "VERIFICATION_STATE_INVALID")
    started = verify(tenant.client, alw["id"], "start")
    assert started.status == 200, started
    assert started.json["status"] == "otp_sent"
    assert started.json["rail"]["status"] == "inactive"
    wrong = assert_problem(verify(tenant.client, alw["id"], "submit_otp", "123456"), 400, "INVALID_OTP")
    assert wrong["attempts_remaining"] == 2
    answer = verify(tenant.client, alw["id"], "submit_otp", OTP)
    assert answer.status == 200, answer
    assert answer.json == {"status": "verified", "rail": {**rails(alw)["vic"], "status": "active"}}
    now = read(tenant.client, alw["id"])
    assert now["status"] == "active"
    assert_problem(verify(tenant.client, alw["id"], "start"), 400, "VERIFICATION_STATE_INVALID")
    assert {"allowance": {"id": alw["id"], "status": "active"}} in events_of(tenant.id, "agentic.allowance.updated")


def test_three_wrong_codes_fail_the_verification(tenant):
    alw = allowance(tenant.client)
    verify(tenant.client, alw["id"], "start")
    assert_problem(verify(tenant.client, alw["id"], "submit_otp", "1"), 400, "INVALID_OTP")
    assert_problem(verify(tenant.client, alw["id"], "submit_otp", "2"), 400, "INVALID_OTP")
    assert_problem(verify(tenant.client, alw["id"], "submit_otp", "3"), 422, "PROVIDER_VERIFICATION_FAILED")
    assert_problem(verify(tenant.client, alw["id"], "submit_otp", OTP), 400, "VERIFICATION_STATE_INVALID")
    assert verify(tenant.client, alw["id"], "start").json["status"] == "otp_sent"
    assert verify(tenant.client, alw["id"], "submit_otp", OTP).json["status"] == "verified"


def test_verification_errors(tenant):
    alw = allowance(tenant.client)
    assert_problem(
        verify(tenant.client, alw["id"], "start", rail="spt", provider="psp"), 400, "VERIFICATION_NOT_REQUIRED"
    )
    assert_problem(verify(tenant.client, alw["id"], "start", provider="psp"), 400, "VALIDATION_ERROR")
    assert_problem(verify(tenant.client, alw["id"], "start", provider="agentpay"), 400, "RAIL_NOT_FOUND")
    assert_problem(verify(tenant.client, alw["id"], "submit_otp"), 400, "VALIDATION_ERROR")
    assert_problem(verify(tenant.client, "alw_nothing", "start"), 404, "ALLOWANCE_NOT_FOUND")
    unsupported = allowance(tenant.client, NO_VERIFICATION)
    assert_problem(verify(tenant.client, unsupported["id"], "start"), 422, "VERIFICATION_NOT_SUPPORTED")
    assert rails(read(tenant.client, unsupported["id"]))["vic"]["status"] == "inactive"


# ---- update --------------------------------------------------------------------------------------


def test_update_changes_amount_description_and_expiry_at_the_provider_first(tenant):
    alw = allowance(tenant.client, AMEX, "50.00", description="first")
    assert mint(tenant.client, alw["id"], "20.00").status == 201
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(days=60)).replace(microsecond=0)
    answer = tenant.client.patch(
        f"{ALLOWANCES}/{alw['id']}",
        {"amount": usd("80"), "description": None, "expires_at": expires.isoformat()},
        content_type="application/merge-patch+json",
    )
    assert answer.status == 200, answer
    assert answer.json["amount"] == usd("80.00")
    assert answer.json["amount_available"] == usd("60.00")
    assert answer.json["amount_spent"] == usd("20.00")
    assert answer.json["description"] is None
    assert dt.datetime.fromisoformat(answer.json["expires_at"]) == expires
    below = tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"amount": usd("19.99")})
    assert "amount.value" in assert_problem(below, 400, "VALIDATION_ERROR")["errors"]
    other = tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"amount": {"value": "90", "currency": "EUR"}})
    assert "amount.currency" in assert_problem(other, 400, "VALIDATION_ERROR")["errors"]
    assert_problem(tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"amount": None}), 400, "VALIDATION_ERROR")
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(80), Decimal(60), Decimal(0), Decimal(20))


# ---- cancellation --------------------------------------------------------------------------------


def test_delete_cancels_at_every_provider_then_nothing_more_is_minted(tenant):
    alw = verified(tenant.client)
    answer = tenant.client.delete(f"{ALLOWANCES}/{alw['id']}")
    assert answer.status == 204, answer
    cancelled = read(tenant.client, alw["id"])
    assert cancelled["status"] == "cancelled"
    assert tenant.client.delete(f"{ALLOWANCES}/{alw['id']}").status == 204
    assert_problem(mint(tenant.client, alw["id"]), 400, "ALLOWANCE_CANCELLED")
    assert_problem(verify(tenant.client, alw["id"], "start"), 400, "ALLOWANCE_CANCELLED")
    assert_problem(tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", {"description": "x"}), 400, "ALLOWANCE_CANCELLED")
    assert {"allowance": {"id": alw["id"], "status": "cancelled"}} in events_of(tenant.id, "agentic.allowance.updated")


def test_a_failed_cancellation_answers_500_and_the_repeated_delete_resumes_it(tenant):
    alw = allowance(tenant.client, CANCEL_FAILS_ONCE)
    assert_problem(tenant.client.delete(f"{ALLOWANCES}/{alw['id']}"), 500, "PROVIDER_ALLOWANCE_CANCEL_FAILED")
    assert read(tenant.client, alw["id"])["status"] != "cancelled"
    assert_problem(mint(tenant.client, alw["id"]), 400, "ALLOWANCE_CANCELLED")
    # SANDBOX.md: the first cancellation fails at the provider; the repeated DELETE succeeds
    assert tenant.client.delete(f"{ALLOWANCES}/{alw['id']}").status == 204
    assert read(tenant.client, alw["id"])["status"] == "cancelled"
    errors = tenant.client.get(f"{ALLOWANCES}/{alw['id']}/errors").json["data"]
    assert [(e["code"], e["provider"], e["operation"]) for e in errors] == [
        ("PROVIDER_ALLOWANCE_CANCEL_FAILED", "vic", "cancellation"),
    ]


def test_deleting_the_payment_method_cancels_its_allowances(tenant):
    number = fresh_visa()
    pm = created(tenant.client, number)
    first = tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": usd("10.00")}).json
    second = tenant.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": usd("20.00")}).json
    assert tenant.client.delete(f"{BASE}/{pm['id']}").status == 204
    assert tenant.client.get(f"{BASE}/{pm['id']}").json["status"] == "deleted"
    for alw in (first, second):
        assert read(tenant.client, alw["id"])["status"] == "cancelled"
        assert_problem(mint(tenant.client, alw["id"]), 400, "ALLOWANCE_CANCELLED")


def test_an_allowance_of_a_visa_card_is_usable_on_spt_before_verification(tenant):
    alw = allowance(tenant.client, VISA, "30.00")
    assert_problem(
        mint(tenant.client, alw["id"], rail="agentic-token", provider="vic", fmt="card"), 400, "RAIL_NOT_ACTIVE"
    )
    answer = mint(tenant.client, alw["id"], "30.00")
    assert answer.status == 201, answer
    assert amounts(read(tenant.client, alw["id"])) == (Decimal(30), Decimal(0), Decimal(0), Decimal(30))


def test_log_rows_name_the_allowance_and_the_credential(tenant):
    alw = allowance(tenant.client, AMEX)
    credential = mint(tenant.client, alw["id"], "1.00").json
    for entity_type, entity_id in (("allowance", alw["id"]), ("payment_credential", credential["id"])):
        rows = tenant.client.get(f"/logs?entity_type={entity_type}").json["data"]
        assert (entity_id, "create") in [(r["entity_id"], r["operation"]) for r in rows], rows
    listed = {t["value"] for t in tenant.client.get("/logs/entity-types").json}
    assert {"allowance", "payment_credential"} <= listed


def test_allowance_and_credential_events_are_delivered(tenant, receiver):
    events = ["agentic.allowance.updated", "agentic.credential.created"]
    hook = tenant.client.post("/webhooks", {"name": "allowances", "url": receiver.url, "events": events})
    assert hook.status == 201, hook
    alw = allowance(tenant.client, AMEX)
    credential = mint(tenant.client, alw["id"], "2.00").json
    hits = receiver.wait_for(lambda r: r.json["event"]["type"] == "agentic.credential.created", timeout=20)
    assert hits[0].json["event"]["data"] == {
        "credential": {"id": credential["id"]},
        "allowance": {"id": alw["id"], "status": "active"},
    }
    updated = receiver.wait_for(lambda r: r.json["event"]["type"] == "agentic.allowance.updated", timeout=20)
    assert updated[0].json["event"]["data"] == {"allowance": {"id": alw["id"], "status": "active"}}


def test_framing_problems_take_the_agentic_form(tenant, api):
    alw = allowance(tenant.client, AMEX)
    assert_problem(tenant.client.post(ALLOWANCES, raw=b"{", content_type="application/json"), 400, "INVALID_BODY")
    assert_problem(tenant.client.post(ALLOWANCES, {"amount": usd("1.00")}), 400, "VALIDATION_ERROR")
    assert_problem(
        tenant.client.patch(f"{ALLOWANCES}/{alw['id']}", raw=b"x", content_type="text/plain"),
        415,
        "UNSUPPORTED_MEDIA_TYPE",
    )
    assert_problem(api.client().get(ALLOWANCES), 401, "UNAUTHORIZED")
    assert_problem(tenant.client.get(f"{ALLOWANCES}/{alw['id']}/nothing"), 404, "NOT_FOUND")
    assert_problem(tenant.client.put(f"{ALLOWANCES}/{alw['id']}", {}), 405, "METHOD_NOT_ALLOWED")


def test_a_production_tenant_without_live_providers_has_no_active_rails(api):
    from tests.conftest import make_tenant

    production = make_tenant(api, type="production")
    pm = created(production.client, AMEX)
    assert pm["rails"][0]["error"] == {"code": "PROVIDER_NOT_CONFIGURED"}
    answer = production.client.post(ALLOWANCES, {"payment_method_id": pm["id"], "amount": usd("1.00")})
    assert_problem(answer, 400, "NO_ACTIVE_RAILS")
