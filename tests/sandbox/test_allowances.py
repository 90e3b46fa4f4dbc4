"""Allowances at the agentic providers, through the platform's adapter over real HTTP to the sandbox:
SANDBOX.md's allowance table, OTP verification, minting in every format, idempotent replays."""

from __future__ import annotations

import datetime
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
from joserfc import jwe
from joserfc.jwk import ECKey, OKPKey

from domain.tokens.cards import luhn_valid
from infra.jobs import TransientError
from providers.agentic import (
    Amount,
    CredentialOutcomeUnknown,
    MppRequest,
    ProviderRejection,
)
from providers.agentic_http import HttpAgenticProvider
from tests.helpers import ApiClient
from tests.sandbox import HANG_SECONDS, admin, card

VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
AMEX = "378282246310005"
SETUP_REJECTED = "4000000000004012"
MINT_FAILS = "4000000000004020"
MINT_HANGS = "4000000000004038"
CANCEL_FAILS_ONCE = "4000000000004046"
NO_VERIFICATION = "4000000000004053"
CONSUMER = {"id": "consumer-1", "email": "ada@example.com"}
USD_100 = Amount(Decimal("100.00"), "USD")
CREDENTIAL_NUMBER = re.compile(r"400000100000[0-9]{4}")


@pytest.fixture
def providers(sandbox, sandbox_url):
    """``providers[name]``: the platform's adapter of provider ``name`` pointed at the sandbox."""
    return {
        name: HttpAgenticProvider(name, f"{sandbox_url}/agentic/{name}", connect_timeout=1.0, read_timeout=2.0)
        for name in ("vic", "agentpay", "psp")
    }


def in_days(days: int) -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0) + datetime.timedelta(days=days)


def enrollment_id(sandbox: ApiClient, provider: str, pan: str) -> str:
    """Enroll ``pan`` with ``provider`` over HTTP; the enrollment id."""
    answer = sandbox.post(f"/agentic/{provider}/enrollments", card(pan, consumer=CONSUMER, attempt="create"))
    assert answer.status == 201, answer
    return answer.json["id"]


def set_up(sandbox: ApiClient, adapter: HttpAgenticProvider, pan: str, key: str = "setup", amount: Amount = USD_100):
    """An allowance of ``amount`` for 30 days on a new enrollment of ``pan`` at ``adapter``'s provider."""
    enrolled = enrollment_id(sandbox, adapter.name, pan)
    return adapter.create_allowance(enrolled, amount, in_days(30), "groceries", idempotency_key=key)


def verified(sandbox: ApiClient, adapter: HttpAgenticProvider, pan: str, amount: Amount = USD_100):
    """An allowance set up and verified with the code 000000."""
    allowance = set_up(sandbox, adapter, pan, amount=amount)
    adapter.start_verification(allowance.id, idempotency_key="start")
    assert adapter.submit_otp(allowance.id, "000000", idempotency_key="otp").status == "verified"
    return allowance


def held(sandbox: ApiClient, **query: str) -> list[dict]:
    return admin(sandbox, "allowances", **query)["allowances"]


def rejection(call) -> ProviderRejection:
    """The ProviderRejection ``call()`` raises."""
    with pytest.raises(ProviderRejection) as raised:
        call()
    return raised.value


@pytest.mark.parametrize(
    ("pan", "provider", "status"),
    [
        (VISA, "vic", "inactive"),
        (VISA, "psp", "active"),
        (MASTERCARD, "agentpay", "inactive"),
        (MASTERCARD, "psp", "active"),
        (AMEX, "psp", "active"),
        (SETUP_REJECTED, "psp", "active"),
        (NO_VERIFICATION, "vic", "inactive"),
        (MINT_FAILS, "vic", "inactive"),
    ],
)
def test_setup_answers_per_the_table(sandbox, providers, pan, provider, status):
    allowance = set_up(sandbox, providers[provider], pan)

    assert allowance.id.startswith("pal_") and allowance.status == status
    assert allowance.verification_required is (provider != "psp")
    assert (allowance.amount, allowance.amount_spent) == (USD_100, Amount(Decimal("0.00"), "USD"))
    assert abs(allowance.expires_at - in_days(30)) < datetime.timedelta(seconds=5)
    assert allowance.provider_ids and all(allowance.provider_ids.values())
    assert [item["id"] for item in held(sandbox, provider=provider, pan_last4=pan[-4:])] == [allowance.id]


def test_vic_rejects_the_setup_of_the_rejected_card(sandbox, providers):
    failure = rejection(lambda: set_up(sandbox, providers["vic"], SETUP_REJECTED))

    assert (failure.code, failure.status, failure.provider_code) == (
        "PROVIDER_ALLOWANCE_FAILED",
        422,
        "PROVIDER_ALLOWANCE_FAILED",
    )
    assert failure.correlation_id.startswith("corr_")
    assert admin(sandbox, "allowances", provider="vic")["count"] == 0


def test_setup_on_an_enrollment_the_provider_does_not_hold_fails(sandbox, providers):
    failure = rejection(
        lambda: providers["vic"].create_allowance("enr_unknown", USD_100, in_days(1), None, idempotency_key="k")
    )

    assert (failure.code, failure.provider_code) == ("PROVIDER_ALLOWANCE_FAILED", "ENROLLMENT_NOT_FOUND")


def test_the_same_setup_key_answers_the_same_allowance_and_sets_up_one(sandbox, providers):
    vic = providers["vic"]
    enrolled = enrollment_id(sandbox, "vic", VISA)

    first = vic.create_allowance(enrolled, USD_100, in_days(30), None, idempotency_key="same")
    again = vic.create_allowance(enrolled, USD_100, in_days(30), None, idempotency_key="same")
    other = vic.create_allowance(enrolled, USD_100, in_days(30), None, idempotency_key="other")

    assert again == first and other.id != first.id
    assert admin(sandbox, "allowances", provider="vic", pan=VISA)["count"] == 2
    assert admin(sandbox, "requests", endpoint="agentic.vic.allowances.create", pan=VISA)["total"] == 3


@pytest.mark.parametrize(("pan", "provider"), [(VISA, "vic"), (MASTERCARD, "agentpay")])
def test_the_otp_000000_verifies_and_activates_the_allowance(sandbox, providers, pan, provider):
    adapter = providers[provider]
    allowance = set_up(sandbox, adapter, pan)

    started = adapter.start_verification(allowance.id, idempotency_key="start")
    done = adapter.submit_otp(allowance.id, "000000", idempotency_key="otp")

    assert (started.status, started.attempts_remaining) == ("otp_sent", 3)
    assert done.status == "verified"
    [state] = held(sandbox, provider=provider)
    assert state["status"] == "active"
    assert state["verification"] == {"status": "verified", "otps_sent": 1, "wrong_codes": 0}
    again = rejection(lambda: adapter.start_verification(allowance.id, idempotency_key="start-again"))
    assert (again.code, again.status) == ("VERIFICATION_STATE_INVALID", 400)


def test_wrong_codes_count_down_and_the_third_fails_the_verification(sandbox, providers):
    vic = providers["vic"]
    allowance = set_up(sandbox, vic, VISA)
    vic.start_verification(allowance.id, idempotency_key="start-1")

    first = rejection(lambda: vic.submit_otp(allowance.id, "123456", idempotency_key="otp-1"))
    second = rejection(lambda: vic.submit_otp(allowance.id, "654321", idempotency_key="otp-2"))
    third = rejection(lambda: vic.submit_otp(allowance.id, "111111", idempotency_key="otp-3"))
    late = rejection(lambda: vic.submit_otp(allowance.id, "000000", idempotency_key="otp-4"))

    assert [(error.code, error.status, error.attempts_remaining) for error in (first, second)] == [
        ("INVALID_OTP", 400, 2),
        ("INVALID_OTP", 400, 1),
    ]
    assert (third.code, third.status) == ("PROVIDER_VERIFICATION_FAILED", 422)
    assert late.code == "VERIFICATION_STATE_INVALID"
    assert held(sandbox)[0]["status"] == "inactive"

    restarted = vic.start_verification(allowance.id, idempotency_key="start-2")
    assert (restarted.status, restarted.attempts_remaining) == ("otp_sent", 3)
    assert vic.submit_otp(allowance.id, "000000", idempotency_key="otp-5").status == "verified"
    assert held(sandbox)[0]["verification"] == {"status": "verified", "otps_sent": 2, "wrong_codes": 0}


def test_a_replayed_wrong_code_is_answered_again_and_counted_once(sandbox, providers):
    vic = providers["vic"]
    allowance = set_up(sandbox, vic, VISA)
    vic.start_verification(allowance.id, idempotency_key="start")

    answers = [rejection(lambda: vic.submit_otp(allowance.id, "999999", idempotency_key="otp-1")) for _ in range(3)]
    replayed = sandbox.post(
        f"/agentic/vic/allowances/{allowance.id}/verification/otp",
        {"otp": "999999"},
        headers={"Idempotency-Key": "otp-1"},
    )

    assert {(error.code, error.attempts_remaining) for error in answers} == {("INVALID_OTP", 2)}
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert held(sandbox)[0]["verification"]["wrong_codes"] == 1
    assert vic.submit_otp(allowance.id, "000000", idempotency_key="otp-2").status == "verified"


def test_submitting_a_code_before_starting_is_out_of_order(sandbox, providers):
    allowance = set_up(sandbox, providers["agentpay"], MASTERCARD)

    failure = rejection(lambda: providers["agentpay"].submit_otp(allowance.id, "000000", idempotency_key="k"))

    assert (failure.code, failure.status) == ("VERIFICATION_STATE_INVALID", 400)


@pytest.mark.parametrize("pan", [AMEX, VISA])
def test_psp_allowances_need_no_verification(sandbox, providers, pan):
    allowance = set_up(sandbox, providers["psp"], pan)

    failure = rejection(lambda: providers["psp"].start_verification(allowance.id, idempotency_key="k"))

    assert (failure.code, failure.status) == ("VERIFICATION_NOT_REQUIRED", 400)
    assert held(sandbox)[0]["verification"] is None


def test_vic_has_no_verification_for_its_card_and_the_allowance_stays_inactive(sandbox, providers):
    vic = providers["vic"]
    allowance = set_up(sandbox, vic, NO_VERIFICATION)

    failure = rejection(lambda: vic.start_verification(allowance.id, idempotency_key="k"))
    mint = rejection(
        lambda: vic.mint_credential(
            allowance.id, credential_format="card", amount=USD_100, mpp=None, idempotency_key="mint"
        )
    )

    assert (failure.code, failure.status) == ("VERIFICATION_NOT_SUPPORTED", 422)
    assert held(sandbox)[0]["status"] == "inactive"
    assert (mint.code, mint.provider_code) == ("PROVIDER_CREDENTIALS_FAILED", "ALLOWANCE_NOT_ACTIVE")


@pytest.mark.parametrize(
    ("pan", "provider", "credential_format"),
    [
        (VISA, "vic", "card"),
        (VISA, "vic", "network-token"),
        (MASTERCARD, "agentpay", "card"),
        (MASTERCARD, "agentpay", "network-token"),
    ],
)
def test_card_formats_mint_numbers_of_the_sandbox_range(sandbox, providers, pan, provider, credential_format):
    adapter = providers[provider]
    allowance = verified(sandbox, adapter, pan)

    minted = adapter.mint_credential(
        allowance.id,
        credential_format=credential_format,
        amount=Amount(Decimal("25.00"), "USD"),
        mpp=None,
        idempotency_key="mint",
    )

    value = minted.credential
    assert set(value) == {"number", "expiration_month", "expiration_year", "cvc"}
    assert CREDENTIAL_NUMBER.fullmatch(value["number"]) and luhn_valid(value["number"])
    assert (value["expiration_month"], value["expiration_year"]) == (in_days(30).month, in_days(30).year)
    assert re.fullmatch(r"[0-9]{3}", value["cvc"])
    assert (minted.format, minted.amount) == (credential_format, Amount(Decimal("25.00"), "USD"))
    assert value["number"] not in repr(minted)
    [state] = held(sandbox, provider=provider)
    assert (state["amount_spent"], state["credentials"]) == ({"value": "25.00", "currency": "USD"}, 1)


@pytest.mark.parametrize("pan", [VISA, AMEX])
def test_psp_mints_identifiers(sandbox, providers, pan):
    allowance = set_up(sandbox, providers["psp"], pan)

    minted = providers["psp"].mint_credential(
        allowance.id,
        credential_format="identifier",
        amount=Amount(Decimal("9.99"), "USD"),
        mpp=None,
        idempotency_key="m",
    )

    assert re.fullmatch(r"spt_[0-9a-f]{24}", minted.credential["id"]) and set(minted.credential) == {"id"}


@pytest.mark.parametrize(
    ("pan", "provider", "key"),
    [
        (VISA, "vic", OKPKey.generate_key("X25519", parameters={"kid": "merchant-1", "use": "enc"})),
        (MASTERCARD, "agentpay", ECKey.generate_key("P-256", parameters={"kid": "merchant-2"})),
        (AMEX, "psp", OKPKey.generate_key("X25519", parameters={"kid": "merchant-3"})),
    ],
)
def test_mpp_tokens_are_sealed_for_the_merchants_key(sandbox, providers, pan, provider, key):
    adapter = providers[provider]
    allowance = verified(sandbox, adapter, pan) if provider != "psp" else set_up(sandbox, adapter, pan)
    signing_only = OKPKey.generate_key("Ed25519", parameters={"kid": "sig"}).as_dict(private=False)
    key_set = {"keys": [signing_only, key.as_dict(private=False)]}

    minted = adapter.mint_credential(
        allowance.id,
        credential_format="mpp",
        amount=Amount(Decimal("12.50"), "USD"),
        mpp=MppRequest(key_set, "challenge-42"),
        idempotency_key="mpp",
    )

    sealed = jwe.decrypt_compact(minted.credential["token"], key)
    claims = json.loads(sealed.plaintext)
    assert (sealed.protected["alg"], sealed.protected["enc"], sealed.protected["kid"]) == (
        "ECDH-ES",
        "A256GCM",
        key.kid,
    )
    assert (claims["challenge"], claims["credential_id"], claims["provider"]) == ("challenge-42", minted.id, provider)
    assert claims["amount"] == {"value": "12.50", "currency": "USD"}
    inner = claims["credential"]
    if provider == "psp":
        assert re.fullmatch(r"spt_[0-9a-f]{24}", inner["id"])
    else:
        assert CREDENTIAL_NUMBER.fullmatch(inner["number"])


def test_an_mpp_key_set_without_an_encryption_key_fails_the_mint(sandbox, providers):
    allowance = set_up(sandbox, providers["psp"], AMEX)
    key_set = {"keys": [OKPKey.generate_key("Ed25519").as_dict(private=False)]}

    failure = rejection(
        lambda: providers["psp"].mint_credential(
            allowance.id, credential_format="mpp", amount=USD_100, mpp=MppRequest(key_set, "c"), idempotency_key="m"
        )
    )

    assert (failure.code, failure.provider_code) == ("PROVIDER_CREDENTIALS_FAILED", "MPP_KEY_UNSUPPORTED")
    assert admin(sandbox, "credentials")["count"] == 0


def test_a_replayed_mint_answers_the_same_credential_and_spends_once(sandbox, providers):
    vic = providers["vic"]
    allowance = verified(sandbox, vic, VISA)
    ten = Amount(Decimal("10.00"), "USD")

    with ThreadPoolExecutor(max_workers=4) as pool:
        minted = list(
            pool.map(
                lambda _: vic.mint_credential(
                    allowance.id, credential_format="card", amount=ten, mpp=None, idempotency_key="mint-1"
                ),
                range(4),
            )
        )
    other = vic.mint_credential(allowance.id, credential_format="card", amount=ten, mpp=None, idempotency_key="mint-2")

    assert {credential.id for credential in minted} == {minted[0].id} != {other.id}
    assert {credential.credential["number"] for credential in minted} == {minted[0].credential["number"]}
    assert admin(sandbox, "credentials", allowance_id=allowance.id)["count"] == 2
    assert held(sandbox)[0]["amount_spent"] == {"value": "20.00", "currency": "USD"}


def test_a_mint_over_what_is_left_is_refused(sandbox, providers):
    psp = providers["psp"]
    allowance = set_up(sandbox, psp, VISA, amount=Amount(Decimal("30.00"), "USD"))
    psp.mint_credential(
        allowance.id,
        credential_format="identifier",
        amount=Amount(Decimal("20.00"), "USD"),
        mpp=None,
        idempotency_key="m1",
    )

    failure = rejection(
        lambda: psp.mint_credential(
            allowance.id,
            credential_format="identifier",
            amount=Amount(Decimal("10.01"), "USD"),
            mpp=None,
            idempotency_key="m2",
        )
    )

    assert (failure.code, failure.provider_code) == ("PROVIDER_CREDENTIALS_FAILED", "AMOUNT_EXCEEDED")
    assert admin(sandbox, "credentials")["count"] == 1


@pytest.mark.parametrize("provider", ["vic", "psp"])
def test_every_mint_fails_conclusively_for_the_failing_card_and_replays(sandbox, providers, provider):
    adapter = providers[provider]
    allowance = verified(sandbox, adapter, MINT_FAILS) if provider == "vic" else set_up(sandbox, adapter, MINT_FAILS)
    credential_format = "card" if provider == "vic" else "identifier"

    def mint(key):
        return rejection(
            lambda: adapter.mint_credential(
                allowance.id, credential_format=credential_format, amount=USD_100, mpp=None, idempotency_key=key
            )
        )

    first, replay, fresh = mint("m1"), mint("m1"), mint("m2")

    assert {(error.code, error.status) for error in (first, replay, fresh)} == {("PROVIDER_CREDENTIALS_FAILED", 422)}
    assert first.correlation_id == replay.correlation_id != fresh.correlation_id
    assert admin(sandbox, "credentials")["count"] == 0
    assert held(sandbox, provider=provider)[0]["amount_spent"]["value"] == "0"


def test_the_hanging_mint_is_an_unknown_outcome_not_a_failure(sandbox, providers, sandbox_url):
    slow = HttpAgenticProvider("vic", f"{sandbox_url}/agentic/vic", connect_timeout=1.0, read_timeout=0.5)
    allowance = verified(sandbox, providers["vic"], MINT_HANGS)

    started = time.monotonic()
    with pytest.raises(CredentialOutcomeUnknown) as raised:
        slow.mint_credential(allowance.id, credential_format="card", amount=USD_100, mpp=None, idempotency_key="m")
    elapsed = time.monotonic() - started

    assert not isinstance(raised.value, ProviderRejection)
    assert (raised.value.code, raised.value.status) == ("CREDENTIAL_OUTCOME_UNKNOWN", 409)
    assert 0.5 <= elapsed < HANG_SECONDS
    assert admin(sandbox, "credentials")["count"] == 0
    assert admin(sandbox, "requests", endpoint="agentic.vic.credentials.create", pan=MINT_HANGS)["total"] == 1


def test_a_patient_caller_gets_the_hanging_mints_late_504_as_transient(sandbox, sandbox_url):
    patient = HttpAgenticProvider(
        "psp", f"{sandbox_url}/agentic/psp", connect_timeout=1.0, read_timeout=HANG_SECONDS + 3
    )
    allowance = set_up(sandbox, patient, MINT_HANGS)

    started = time.monotonic()
    with pytest.raises(TransientError, match="504"):
        patient.mint_credential(
            allowance.id, credential_format="identifier", amount=USD_100, mpp=None, idempotency_key="m"
        )

    assert time.monotonic() - started >= HANG_SECONDS
    assert admin(sandbox, "credentials")["count"] == 0
    assert held(sandbox)[0]["amount_spent"]["value"] == "0"


def test_an_expired_allowance_mints_and_changes_no_more(sandbox, providers):
    psp = providers["psp"]
    enrolled = enrollment_id(sandbox, "psp", AMEX)
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1)
    allowance = psp.create_allowance(enrolled, USD_100, soon, None, idempotency_key="k")
    time.sleep(max(0.0, (soon - datetime.datetime.now(datetime.UTC)).total_seconds()) + 0.1)

    mint = rejection(
        lambda: psp.mint_credential(
            allowance.id, credential_format="identifier", amount=USD_100, mpp=None, idempotency_key="m"
        )
    )
    update = rejection(lambda: psp.update_allowance(allowance.id, expires_at=in_days(1), idempotency_key="u"))

    assert (mint.code, mint.provider_code) == ("PROVIDER_CREDENTIALS_FAILED", "ALLOWANCE_EXPIRED")
    assert (update.code, update.provider_code) == ("PROVIDER_ALLOWANCE_UPDATE_FAILED", "ALLOWANCE_EXPIRED")
    assert held(sandbox, status="expired")[0]["id"] == allowance.id


def test_an_update_changes_amount_and_expiry_and_replays(sandbox, providers):
    vic = providers["vic"]
    allowance = verified(sandbox, vic, VISA)
    new_expiry = in_days(60)

    updated = vic.update_allowance(
        allowance.id, amount=Amount(Decimal("150.00"), "USD"), expires_at=new_expiry, idempotency_key="u1"
    )
    replayed = vic.update_allowance(
        allowance.id, amount=Amount(Decimal("150.00"), "USD"), expires_at=new_expiry, idempotency_key="u1"
    )

    assert updated == replayed
    assert (updated.amount.value, updated.expires_at, updated.status) == (Decimal("150.00"), new_expiry, "active")
    assert held(sandbox)[0]["amount"] == {"value": "150.00", "currency": "USD"}


def test_an_update_below_what_was_spent_is_refused_and_changes_nothing(sandbox, providers):
    psp = providers["psp"]
    allowance = set_up(sandbox, psp, AMEX)
    psp.mint_credential(
        allowance.id,
        credential_format="identifier",
        amount=Amount(Decimal("40.00"), "USD"),
        mpp=None,
        idempotency_key="m",
    )

    below = rejection(
        lambda: psp.update_allowance(allowance.id, amount=Amount(Decimal("39.99"), "USD"), idempotency_key="u1")
    )
    currency = rejection(
        lambda: psp.update_allowance(allowance.id, amount=Amount(Decimal("100.00"), "EUR"), idempotency_key="u2")
    )

    assert (below.code, below.status, below.provider_code) == (
        "PROVIDER_ALLOWANCE_UPDATE_FAILED",
        422,
        "AMOUNT_BELOW_SPENT",
    )
    assert (currency.code, currency.provider_code) == ("PROVIDER_ALLOWANCE_UPDATE_FAILED", "CURRENCY_MISMATCH")
    assert held(sandbox)[0]["amount"] == {"value": "100.00", "currency": "USD"}
    assert psp.update_allowance(
        allowance.id, amount=Amount(Decimal("40.00"), "USD"), idempotency_key="u3"
    ).amount.value == Decimal("40.00")


def test_cancel_stops_the_allowance_and_is_idempotent(sandbox, providers):
    vic = providers["vic"]
    allowance = verified(sandbox, vic, VISA)

    vic.cancel_allowance(allowance.id, idempotency_key="c1")
    vic.cancel_allowance(allowance.id, idempotency_key="c2")
    vic.cancel_allowance("pal_unknown", idempotency_key="c3")
    mint = rejection(
        lambda: vic.mint_credential(
            allowance.id, credential_format="card", amount=USD_100, mpp=None, idempotency_key="m"
        )
    )
    update = rejection(lambda: vic.update_allowance(allowance.id, description="x", idempotency_key="u"))

    assert held(sandbox)[0]["status"] == "cancelled"
    assert (mint.code, mint.provider_code) == ("PROVIDER_CREDENTIALS_FAILED", "ALLOWANCE_CANCELLED")
    assert (update.code, update.provider_code) == ("PROVIDER_ALLOWANCE_UPDATE_FAILED", "ALLOWANCE_CANCELLED")


def test_the_first_cancellation_fails_for_its_card_and_a_new_attempt_succeeds(sandbox, providers):
    adapter = providers["vic"]
    allowance = set_up(sandbox, adapter, CANCEL_FAILS_ONCE)

    first = rejection(lambda: adapter.cancel_allowance(allowance.id, idempotency_key="c1"))
    replay = rejection(lambda: adapter.cancel_allowance(allowance.id, idempotency_key="c1"))
    adapter.cancel_allowance(allowance.id, idempotency_key="c2")

    assert (first.code, first.status) == (replay.code, replay.status) == ("PROVIDER_ALLOWANCE_CANCEL_FAILED", 500)
    [state] = held(sandbox, provider="vic")
    assert (state["status"], state["cancel_attempts"]) == ("cancelled", 2)


def test_the_cancel_failing_card_cancels_at_psp_the_first_time(sandbox, providers):
    # one refusal per allowance: the platform's repeated DELETE then succeeds (SANDBOX.md)
    adapter = providers["psp"]
    allowance = set_up(sandbox, adapter, CANCEL_FAILS_ONCE)

    adapter.cancel_allowance(allowance.id, idempotency_key="c1")

    [state] = held(sandbox, provider="psp")
    assert (state["status"], state["cancel_attempts"]) == ("cancelled", 1)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "",
            {"enrollment_id": "e", "amount": {"value": 10, "currency": "USD"}, "expires_at": "2999-01-01T00:00:00Z"},
            "amount.value",
        ),
        (
            "",
            {"enrollment_id": "e", "amount": {"value": "10", "currency": "usd"}, "expires_at": "2999-01-01T00:00:00Z"},
            "amount.currency",
        ),
        (
            "",
            {"enrollment_id": "e", "amount": {"value": "10", "currency": "USD"}, "expires_at": "2000-01-01T00:00:00Z"},
            "expires_at",
        ),
        ("", {"amount": {"value": "10", "currency": "USD"}, "expires_at": "2999-01-01T00:00:00"}, "enrollment_id"),
        ("/credentials", {"format": "identifier", "amount": {"value": "1", "currency": "USD"}}, "format"),
        ("/credentials", {"format": "card", "amount": {"value": "0", "currency": "USD"}}, "amount.value"),
        ("/credentials", {"format": "mpp", "amount": {"value": "1", "currency": "USD"}}, "mpp"),
        (
            "/credentials",
            {
                "format": "mpp",
                "amount": {"value": "1", "currency": "USD"},
                "mpp": {"key_set": {"keys": [{"kty": "OKP", "d": "x"}]}, "challenge": "c"},
            },
            "mpp.key_set",
        ),
        ("/verification/otp", {"otp": 0}, "otp"),
    ],
)
def test_malformed_calls_answer_400_naming_the_field_and_change_nothing(sandbox, providers, path, body, field):
    allowance = set_up(sandbox, providers["vic"], VISA)
    target = f"/agentic/vic/allowances{'/' + allowance.id if path else ''}{path}"

    answer = sandbox.post(target, body)

    assert answer.status == 400 and answer.json["code"] == "invalid_request" and field in answer.json["errors"]
    assert admin(sandbox, "allowances")["count"] == 1 and admin(sandbox, "credentials")["count"] == 0


def test_the_adapter_refuses_a_format_the_rail_does_not_allow_without_calling(sandbox, providers):
    allowance = set_up(sandbox, providers["psp"], VISA)

    with pytest.raises(ValueError, match="card"):
        providers["psp"].mint_credential(
            allowance.id, credential_format="card", amount=USD_100, mpp=None, idempotency_key="m"
        )

    assert admin(sandbox, "requests", endpoint="agentic.psp.credentials.create")["total"] == 0


def test_allowance_calls_are_counted_per_card_and_unknown_ids_answer_404(sandbox, providers):
    allowance = verified(sandbox, providers["vic"], VISA)

    assert sandbox.get(f"/agentic/vic/allowances/{allowance.id}").json["status"] == "active"
    assert sandbox.get(f"/agentic/psp/allowances/{allowance.id}").status == 404
    assert sandbox.post("/agentic/vic/allowances/pal_none/verification").status == 404
    counts = {row["endpoint"]: row["count"] for row in admin(sandbox, "requests", pan=VISA)["requests"]}
    assert {name: count for name, count in counts.items() if ".enrollments." not in name} == {
        "agentic.vic.allowances.create": 1,
        "agentic.vic.allowances.read": 1,
        "agentic.vic.verifications.start": 1,
        "agentic.vic.verifications.otp": 1,
    }


def test_reset_forgets_allowances_credentials_and_their_keys(sandbox, providers):
    psp = providers["psp"]
    allowance = set_up(sandbox, psp, VISA, key="before-reset")
    psp.mint_credential(allowance.id, credential_format="identifier", amount=USD_100, mpp=None, idempotency_key="m")

    assert sandbox.post("/_admin/reset").status == 204

    assert admin(sandbox, "allowances")["count"] == admin(sandbox, "credentials")["count"] == 0
    assert sandbox.get(f"/agentic/psp/allowances/{allowance.id}").status == 404
    assert set_up(sandbox, psp, VISA, key="before-reset").id != allowance.id


def test_amounts_are_exact_decimals_sent_in_plain_notation():
    with pytest.raises(TypeError):
        Amount(25.0, "USD")
    with pytest.raises(TypeError):
        Amount(Decimal("NaN"), "USD")

    assert Amount(Decimal("1E+2"), "USD").wire() == {"value": "100", "currency": "USD"}
    assert Amount(Decimal("0.10"), "EUR").wire() == {"value": "0.10", "currency": "EUR"}
