"""Liberal in what the API accepts, strict in what it stores: JSON under any JSON media type, a
``cvc`` sent as a number, expired cards, a comma where an expression's filter pipe belongs. (Legacy
permission names in a grant: tests/api/test_applications.py.)"""

from __future__ import annotations

import pytest

from tests.helpers import assert_problem

pytestmark = pytest.mark.api

VISA = "4242424242424242"


@pytest.mark.parametrize(
    "media_type",
    ["application/json", "application/json-patch+json", "application/vnd.api+json", "application/json; charset=utf-8"],
)
def test_a_json_body_under_any_json_media_type(api, tenant, media_type):
    answer = tenant.client.post("/keys", {}, content_type=media_type)
    assert answer.status == 201, answer
    answer = tenant.client.post("/tokens", {"type": "token", "data": "x"}, content_type=media_type)
    assert answer.status == 201, answer


@pytest.mark.parametrize("media_type", ["text/plain", "application/xml", "application/jsonx", "text/json+xml"])
def test_other_media_types_are_415(api, tenant, media_type):
    assert_problem(tenant.client.post("/tokens", {"type": "token", "data": "x"}, content_type=media_type), 415)


def test_merge_patch_still_requires_its_media_type(api, tenant):
    token = tenant.client.post("/tokens", {"type": "token", "data": "x"}).json
    for media_type in ("application/json", "application/json-patch+json"):
        assert_problem(
            tenant.client.patch(f"/tokens/{token['id']}", {"metadata": {"a": "b"}}, content_type=media_type), 415
        )
    answer = tenant.client.patch(
        f"/tokens/{token['id']}", {"metadata": {"a": "b"}}, content_type="application/merge-patch+json"
    )
    assert answer.status == 200 and answer.json["metadata"] == {"a": "b"}, answer


def test_a_cvc_sent_as_a_number_is_stored_as_its_digits(api, tenant):
    answer = tenant.client.post(
        "/tokens",
        {
            "type": "card",
            "data": {"number": VISA, "cvc": 123},
            "fingerprint_expression": "{{ data.cvc | append: '-' }}",
        },
    )
    assert answer.status == 201, answer
    assert "cvc" not in answer.json["data"]  # never returned
    # the stored value is the string "123": its fingerprint equals that of a card sent with "123"
    same = tenant.client.post(
        "/tokens",
        {
            "type": "card",
            "data": {"number": VISA, "cvc": "123"},
            "fingerprint_expression": "{{ data.cvc | append: '-' }}",
        },
    )
    assert same.status == 201 and same.json["fingerprint"] == answer.json["fingerprint"]
    for wrong in (True, 12, 1.5):
        body = assert_problem(
            tenant.client.post("/tokens", {"type": "card", "data": {"number": VISA, "cvc": wrong}}), 400
        )
        assert "data.cvc" in body["errors"]


def test_an_expired_card_is_a_valid_card_to_vault(api, tenant):
    card = {"number": VISA, "expiration_month": 1, "expiration_year": 2001}
    answer = tenant.client.post("/tokens", {"type": "card", "data": card})
    assert answer.status == 201, answer
    assert answer.json["data"]["expiration_year"] == 2001
    assert tenant.client.post("/tokenize", {"type": "card", "data": card}).status == 201
    body = assert_problem(
        tenant.client.post(
            "/tokens",
            {"type": "card", "data": {"number": "4242424242424241", "expiration_month": 13, "expiration_year": 201}},
        ),
        400,
    )
    assert set(body["errors"]) == {"data.number", "data.expiration_month", "data.expiration_year"}


def test_a_comma_where_a_filter_pipe_belongs_is_read_as_the_pipe(api, tenant):
    answer = tenant.client.post(
        "/tokens", {"type": "card", "data": {"number": VISA}, "mask": {"number": "{{ data.number, reveal_last: 4 }}"}}
    )
    assert answer.status == 201, answer
    assert answer.json["mask"] == {"number": "{{ data.number, reveal_last: 4 }}"}
    reader = tenant.client.post(
        "/applications", {"name": "masked", "type": "server_to_server", "permissions": ["token:pci:read:low"]}
    ).json["key"]
    masked = tenant.client.with_key(reader).get(f"/tokens/{answer.json['id']}")
    assert masked.json["data"] == {"number": "XXXXXXXXXXXX4242"}, masked


def test_a_malformed_expression_is_400_naming_the_position(api, tenant):
    body = assert_problem(
        tenant.client.post("/tokens", {"type": "token", "data": "x", "fingerprint_expression": '{{ data, "x" }}'}), 400
    )
    message = " ".join(body["errors"]["fingerprint_expression"])
    assert "line 1, column 8" in message, message
