"""The card networks' network-token API: SANDBOX.md's provisioning table, idempotency, lifecycle."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from domain.tokens.cards import card_brand, luhn_valid
from sandbox.app import make_app
from sandbox.cards import payment_account_reference
from tests.conftest import free_port, serve_in_thread
from tests.helpers import ApiClient
from tests.sandbox import SLOW_SECONDS, admin, card, future_year, idempotent, post_with_timeout

TOKENS = "/card-network/network-tokens"
VISA = "4242424242424242"
MASTERCARD = "5555555555554444"
NOT_ELIGIBLE = "4000000000002016"
FLAKY = "4000000000002024"
SLOW = "4000000000002032"
AMEX = "378282246310005"


def provision(client: ApiClient, pan: str, key: str | None = None, **fields):
    """POST a provisioning request for ``pan`` (with ``Idempotency-Key: key`` when given)."""
    return client.post(TOKENS, card(pan, **fields), headers=idempotent(key) if key else None)


def provisioned(client: ApiClient, pan: str) -> dict:
    """A new network token for ``pan``; asserts 201."""
    answer = provision(client, pan)
    assert answer.status == 201, answer
    return answer.json


@pytest.mark.parametrize(("pan", "brand", "prefix"), [(VISA, "visa", "4"), (MASTERCARD, "mastercard", "5")])
def test_visa_and_mastercard_cards_provision_an_active_network_token(sandbox, pan, brand, prefix):
    answer = provision(sandbox, pan, cvc="123", cardholder={"name": "Ada", "address": {"city": "London"}})

    assert answer.status == 201, answer
    token = answer.json
    number = token["number"]
    assert token["status"] == "active"
    assert len(number) == 16 and luhn_valid(number) and number != pan and number.startswith(prefix)
    assert card_brand(number) == brand == token["brand"]
    assert (token["bin"], token["last4"]) == (number[:8], number[-4:])
    assert token["expiration_month"] == 12
    assert token["expiration_year"] == future_year() + 3
    assert token["par"] == payment_account_reference(pan)
    assert token["funding"] == "credit" and token["segment"] == "Consumer" and token["product"]["code"]
    assert token["issuer"] == {"name": "Tessera Sandbox Bank", "country": "US"}
    assert token["issuer_country"] == {"alpha2": "US", "name": "United States of America", "numeric": "840"}
    assert sandbox.get(f"{TOKENS}/{token['id']}").json == token


def test_the_par_is_derived_from_the_card_alone_and_survives_a_restart(sandbox):
    first, second = provisioned(sandbox, VISA), provisioned(sandbox, VISA)
    other = provisioned(sandbox, MASTERCARD)
    port = free_port()
    stop = serve_in_thread(make_app, port)
    try:
        restarted = provisioned(ApiClient(f"http://127.0.0.1:{port}"), VISA)
    finally:
        stop()

    par = first["par"]
    assert len(par) == 29 and par.isalnum() and VISA not in par
    assert second["par"] == restarted["par"] == par != other["par"]
    assert second["id"] != first["id"] and second["number"] != first["number"]


def test_a_card_that_is_not_eligible_is_declined_and_nothing_is_stored(sandbox):
    answer = provision(sandbox, NOT_ELIGIBLE)

    assert answer.status == 422
    assert answer.json["code"] == "card_not_eligible" and "eligible" in answer.json["message"]
    assert admin(sandbox, "network-tokens", pan_last4="2016")["count"] == 0


def test_the_flaky_card_answers_503_twice_per_idempotency_key_then_succeeds(sandbox):
    statuses = [provision(sandbox, FLAKY, "job-1").status for _ in range(2)]
    created = provision(sandbox, FLAKY, "job-1")
    replayed = provision(sandbox, FLAKY, "job-1")

    assert statuses == [503, 503]
    assert created.status == 201 and created.json["status"] == "active"
    assert (replayed.status, replayed.json) == (201, created.json)
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert admin(sandbox, "network-tokens", pan_last4="2024")["count"] == 1

    statuses = [provision(sandbox, FLAKY, "job-2").status for _ in range(3)]

    assert statuses == [503, 503, 201]
    assert admin(sandbox, "network-tokens", pan_last4="2024")["count"] == 2
    assert admin(sandbox, "requests", endpoint="card-network.provision", pan_last4="2024")["total"] == 7


def test_the_503_body_is_json(sandbox):
    answer = provision(sandbox, FLAKY, "job-3")

    assert answer.status == 503
    assert answer.json["code"] == "network_unavailable"


def test_the_slow_card_answers_after_the_delay_while_other_requests_are_served(sandbox, sandbox_url):
    with ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        slow = pool.submit(provision, sandbox, SLOW, "slow-1")
        time.sleep(0.1)
        meanwhile = provision(sandbox, VISA)
        served_after = time.monotonic() - started
        still_waiting = not slow.done()
        answer = slow.result(timeout=10)
        elapsed = time.monotonic() - started

    assert meanwhile.status == 201 and served_after < SLOW_SECONDS and still_waiting
    assert answer.status == 201 and answer.json["status"] == "active"
    assert elapsed >= SLOW_SECONDS


def test_retries_of_the_slow_card_with_one_key_create_exactly_one_network_token(sandbox, sandbox_url):
    gave_up = post_with_timeout(sandbox_url, TOKENS, card(SLOW), 0.2, idempotent("slow-2"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda _: provision(sandbox, SLOW, "slow-2"), range(2)))

    assert gave_up is None
    assert [answer.status for answer in answers] == [201, 201]
    assert answers[0].json == answers[1].json
    tokens = admin(sandbox, "network-tokens", pan_last4="2032")
    assert tokens["count"] == 1 and tokens["network_tokens"][0]["id"] == answers[0].json["id"]
    assert admin(sandbox, "requests", endpoint="card-network.provision", pan_last4="2032")["total"] == 3


@pytest.mark.parametrize("pan", [AMEX, "6011111111111117", "3566002020360505"])
def test_brands_other_than_visa_and_mastercard_are_not_supported(sandbox, pan):
    answer = provision(sandbox, pan)

    assert answer.status == 422
    assert answer.json["code"] == "network_not_supported"
    assert admin(sandbox, "network-tokens", pan_last4=pan[-4:])["count"] == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (card("4000000000001010"), "pan"),
        (card("4242 4242 4242 4242"), "pan"),
        (card(4242424242424242), "pan"),
        ({"expiration_month": 12, "expiration_year": 2040}, "pan"),
        (card(VISA, expiration_month=13), "expiration_month"),
        (card(VISA, expiration_month=True), "expiration_month"),
        (card(VISA, expiration_year=40), "expiration_year"),
        (card(VISA, expiration_month=1, expiration_year=2020), "expiration_year"),
        (card(VISA, cvc="12"), "cvc"),
        (card(VISA, cardholder="Ada"), "cardholder"),
        (card(VISA, cardholder={"name": 7}), "cardholder.name"),
        (card(VISA, merchant_id=7), "merchant_id"),
        ([VISA], "body"),
    ],
)
def test_malformed_requests_answer_400_naming_the_field(sandbox, body, field):
    answer = sandbox.post(TOKENS, body)

    assert answer.status == 400
    assert answer.json["code"] == "invalid_request"
    assert field in answer.json["errors"]
    assert admin(sandbox, "network-tokens")["count"] == 0


def test_a_body_that_is_not_json_answers_400(sandbox):
    answer = sandbox.post(TOKENS, raw=b"{not json")

    assert answer.status == 400 and answer.json["errors"] == {"body": ["must be a JSON object"]}


def test_an_idempotency_key_of_more_than_255_characters_answers_400(sandbox):
    answer = provision(sandbox, VISA, "k" * 256)

    assert answer.status == 400 and "Idempotency-Key" in answer.json["errors"]


def test_the_same_key_returns_the_same_token_and_a_new_key_creates_another(sandbox):
    first = provision(sandbox, VISA, "job-a")
    again = provision(sandbox, VISA, "job-a")
    other = provision(sandbox, VISA, "job-b")

    assert first.status == again.status == other.status == 201
    assert again.json == first.json and "Idempotent-Replayed" not in first.headers
    assert other.json["id"] != first.json["id"] and other.json["par"] == first.json["par"]
    assert admin(sandbox, "network-tokens", pan_last4="4242")["count"] == 2


def test_a_declined_card_is_replayed_with_its_key(sandbox):
    first = provision(sandbox, NOT_ELIGIBLE, "job-d")
    again = provision(sandbox, NOT_ELIGIBLE, "job-d")

    assert first.status == 422
    assert (again.status, again.json) == (422, first.json)
    assert again.headers["Idempotent-Replayed"] == "true"


def test_visa_card_art_has_logo_card_image_and_background_color(sandbox):
    token = provisioned(sandbox, VISA)

    answer = sandbox.get(f"{TOKENS}/{token['id']}/card-art")

    assert answer.status == 200
    art = answer.json["card_art"]
    assert art["background_color"].startswith("#")
    for image in (art["logo"], art["card_image"]):
        assert set(image) == {"url", "description", "height", "width"}
        assert token["id"] in image["url"]
        picture = ApiClient("").get(image["url"])
        assert picture.status == 200 and picture.headers["Content-Type"] == "image/png"
        assert picture.raw.startswith(b"\x89PNG")


def test_mastercard_card_art_has_a_logo_only(sandbox):
    token = provisioned(sandbox, MASTERCARD)

    art = sandbox.get(f"{TOKENS}/{token['id']}/card-art").json["card_art"]

    assert art["logo"]["url"] and art["logo"]["height"] > 0
    assert art["card_image"] is None and art["background_color"] is None


@pytest.mark.parametrize(("pan", "eci"), [(VISA, "05"), (MASTERCARD, "02")])
def test_cryptograms_are_fresh_on_every_call_with_the_brand_eci(sandbox, pan, eci):
    token = provisioned(sandbox, pan)

    answers = [sandbox.post(f"{TOKENS}/{token['id']}/cryptograms") for _ in range(3)]

    assert {answer.status for answer in answers} == {200}
    assert {answer.json["eci"] for answer in answers} == {eci}
    cryptograms = {answer.json["cryptogram"] for answer in answers}
    assert len(cryptograms) == 3
    assert all(len(base64.b64decode(value, validate=True)) == 20 for value in cryptograms)


def test_a_cryptogram_is_replayed_with_its_key(sandbox):
    token = provisioned(sandbox, VISA)
    path = f"{TOKENS}/{token['id']}/cryptograms"

    first, again = (sandbox.post(path, headers=idempotent("c-1")) for _ in range(2))

    assert first.json == again.json and again.headers["Idempotent-Replayed"] == "true"


def test_suspend_resume_and_delete_change_the_status(sandbox):
    token_id = provisioned(sandbox, VISA)["id"]
    path = f"{TOKENS}/{token_id}"

    def status_after(method: str, suffix: str = "") -> tuple[int, str | None]:
        answer = sandbox.request(method, path + suffix)
        return answer.status, answer.json.get("status") or answer.json.get("code")

    assert status_after("POST", "/suspend") == (200, "suspended")
    assert status_after("POST", "/suspend") == (200, "suspended")
    assert status_after("POST", "/cryptograms") == (409, "token_not_active")
    assert status_after("POST", "/resume") == (200, "active")
    assert status_after("POST", "/resume") == (200, "active")
    assert status_after("POST", "/cryptograms")[0] == 200
    assert status_after("DELETE") == (200, "deleted")
    assert status_after("DELETE") == (200, "deleted")
    assert status_after("POST", "/cryptograms") == (409, "token_not_active")
    assert status_after("POST", "/resume") == (409, "token_deleted")
    assert status_after("POST", "/suspend") == (409, "token_deleted")
    assert status_after("GET") == (200, "deleted")


@pytest.mark.parametrize(
    ("method", "suffix"),
    [
        ("GET", ""),
        ("GET", "/card-art"),
        ("POST", "/cryptograms"),
        ("POST", "/suspend"),
        ("POST", "/resume"),
        ("DELETE", ""),
    ],
)
def test_unknown_network_token_ids_answer_404(sandbox, method, suffix):
    answer = sandbox.request(method, f"{TOKENS}/00000000-0000-0000-0000-000000000000{suffix}")

    assert answer.status == 404 and answer.json["code"] == "not_found"


def test_requests_are_counted_per_endpoint_and_card(sandbox):
    token_id = provisioned(sandbox, VISA)["id"]
    provisioned(sandbox, MASTERCARD)
    for _ in range(2):
        sandbox.post(f"{TOKENS}/{token_id}/cryptograms")
    sandbox.get(f"{TOKENS}/{token_id}/card-art")
    sandbox.post(f"{TOKENS}/unknown/suspend")

    visa = admin(sandbox, "requests", pan_last4="4242")["requests"]
    assert {row["endpoint"]: row["count"] for row in visa} == {
        "card-network.provision": 1,
        "card-network.cryptogram": 2,
        "card-network.card-art": 1,
    }
    assert {row["par"] for row in visa} == {payment_account_reference(VISA)}
    assert admin(sandbox, "requests", pan=MASTERCARD)["total"] == 1
    assert admin(sandbox, "requests", endpoint="card-network.suspend")["requests"] == [
        {"endpoint": "card-network.suspend", "par": None, "pan_last4": None, "count": 1}
    ]
    assert admin(sandbox, "requests")["total"] == 6
