"""POST /tokenize and the payment-forwarding tokenize: every body shape, validation, permissions."""

from __future__ import annotations

import pytest

from tests.factories.tokens import EXPIRY_YEAR, MASTERCARD, VISA, bank, card, listed_ids, set_settings

pytestmark = pytest.mark.api


def _read(client, token_id: str) -> dict:
    answer = client.get(f"/tokens/{token_id}")
    assert answer.status == 200, answer
    return answer.json


# ---- shapes --------------------------------------------------------------------------------------


def test_bare_string_number_boolean_and_null(tenant):
    client = tenant.client
    for value in ("4242 secret", 42, 3.5, True):
        answer = client.post("/tokenize", value)
        assert answer.status == 201, answer
        token_id = answer.json
        assert isinstance(token_id, str)
        token = _read(client, token_id)
        assert token["type"] == "token"
        assert token["data"] == value
        assert token["containers"] == ["/general/high/"]
        assert token["fingerprint"] is None  # fingerprint_tokens is 'false' by default
    answer = client.post("/tokenize", None, raw=b"null")
    assert answer.status == 201
    assert answer.json is None


def test_data_beyond_64_bit_integers_and_non_ascii_text_reads_back_as_sent(tenant):
    data = {"big": 2**70, "negative": -(2**65), "float": 1e16, "text": 'é ✓ \u2028 "q" \\', "list": [0.1, None]}
    answer = tenant.client.post("/tokenize", {"type": "token", "data": data})
    assert answer.status == 201, answer
    assert answer.json["data"] == data
    assert _read(tenant.client, answer.json["id"])["data"] == data


def test_plain_objects_and_arrays_are_walked(tenant):
    body = {"name": "Jane", "nested": {"ssn": "123-45-6789", "list": ["a", 7, None, {"deep": False}]}, "none": None}
    answer = tenant.client.post("/tokenize", body)
    assert answer.status == 201, answer
    result = answer.json
    assert set(result) == {"name", "nested", "none"}
    assert result["none"] is None
    assert result["nested"]["list"][2] is None
    assert _read(tenant.client, result["name"])["data"] == "Jane"
    assert _read(tenant.client, result["nested"]["ssn"])["data"] == "123-45-6789"
    assert _read(tenant.client, result["nested"]["list"][1])["data"] == 7
    assert _read(tenant.client, result["nested"]["list"][3]["deep"])["data"] is False
    assert len(listed_ids(tenant.client)) == 5


def test_token_request_objects_and_mixed_types(tenant):
    body = [
        card(metadata={"customer": "c-1"}),
        bank(),
        "plain",
        {"type": "token", "data": {"any": ["json"]}, "search_indexes": ["{{ data.any[0] }}"]},
        {"holder": {"type": "card", "data": {"number": MASTERCARD}, "privacy": {"impact_level": "low"}}},
    ]
    answer = tenant.client.post("/tokenize", body)
    assert answer.status == 201, answer
    made_card, made_bank, plain_id, made_token, wrapper = answer.json
    assert made_card["type"] == "card" and made_card["metadata"] == {"customer": "c-1"}
    assert made_card["data"] == {"number": VISA, "expiration_month": 12, "expiration_year": EXPIRY_YEAR}
    assert made_card["containers"] == ["/pci/high/"]
    assert made_bank["type"] == "bank" and made_bank["containers"] == ["/bank/high/"]
    assert made_bank["fingerprint"]
    assert isinstance(plain_id, str)
    assert made_token["data"] == {"any": ["json"]}
    assert wrapper["holder"]["type"] == "card"
    assert "privacy" not in wrapper["holder"]


def test_object_with_keys_outside_a_token_request_is_plain(tenant):
    answer = tenant.client.post("/tokenize", {"type": "card", "data": "x", "colour": "red"})
    assert answer.status == 201, answer
    assert set(answer.json) == {"type", "data", "colour"}
    assert _read(tenant.client, answer.json["type"])["data"] == "card"
    unknown_type = tenant.client.post("/tokenize", {"type": "passport", "data": "x"})
    assert unknown_type.status == 201
    assert set(unknown_type.json) == {"type", "data"}


# ---- validation: all or nothing ------------------------------------------------------------------


def test_errors_are_keyed_by_path_and_nothing_is_written(tenant):
    body = {
        "ok": card(),
        "card": card("4242424242424241"),
        "items": ["fine", {"type": "bank", "data": {"routing_number": "123456789", "account_number": "12"}}],
        "later": {"type": "card", "data": {"number": VISA, "expiration_month": 13, "expiration_year": 20011}},
    }
    answer = tenant.client.post("/tokenize", body)
    assert answer.status == 400, answer
    errors = answer.json["errors"]
    assert set(errors) == {
        "card.data.number",
        "items[1].data.routing_number",
        "items[1].data.account_number",
        "later.data.expiration_month",
        "later.data.expiration_year",
    }
    assert "Luhn" in errors["card.data.number"][0]
    assert VISA not in answer.raw.decode()
    assert listed_ids(tenant.client) == []


def test_array_item_errors(tenant):
    body = ["a", {"type": "card", "data": {"number": 4242}}, card(containers=["/x/"])]
    answer = tenant.client.post("/tokenize", body)
    assert answer.status == 400
    assert set(answer.json["errors"]) == {"[1].data.number", "[2].containers[0]"}
    missing = tenant.client.post("/tokenize", [{"type": "card", "data": None}])
    assert missing.status == 400
    assert set(missing.json["errors"]) == {"[0].data"}
    assert listed_ids(tenant.client) == []


def test_nesting_is_bounded(tenant):
    body: object = "deep"
    for _ in range(70):
        body = [body]
    answer = tenant.client.post("/tokenize", body)
    assert answer.status == 400
    assert "nested deeper" in str(answer.json["errors"])


def test_card_field_rules(tenant):
    bad = {
        "number": "4242-4242-4242-4242",
        "expiration_month": 13,
        "expiration_year": EXPIRY_YEAR,
        "cvc": "12",
        "name": 7,
        "pin": "1234",
    }
    answer = tenant.client.post("/tokenize", {"type": "card", "data": bad})
    assert answer.status == 400
    assert set(answer.json["errors"]) == {
        "data.number",
        "data.expiration_month",
        "data.cvc",
        "data.name",
        "data.pin",
    }


def test_malformed_json_and_content_type(tenant):
    answer = tenant.client.post("/tokenize", raw=b'{"type": "card",')
    assert answer.status == 400
    assert answer.json["status"] == 400
    answer = tenant.client.post("/tokenize", raw=b"", content_type="application/json")
    assert answer.status == 400
    answer = tenant.client.post("/tokenize", raw=b'"x"', content_type="text/plain")
    assert answer.status == 415


# ---- permissions ---------------------------------------------------------------------------------


def test_each_classification_needs_its_create_permission(tenant, limited):
    general_only = limited(tenant, ["token:general:create", "token:general:read:high"])
    answer = general_only.post("/tokenize", ["plain", card()])
    assert answer.status == 403, answer
    assert "token:pci:create" in answer.json["detail"]
    assert listed_ids(tenant.client) == []
    answer = general_only.post("/tokenize", ["plain", {"type": "token", "data": 1, "containers": ["/bank/low/"]}])
    assert answer.status == 403
    assert "token:bank:create" in answer.json["detail"]
    assert general_only.post("/tokenize", ["plain"]).status == 201
    nothing = limited(tenant, ["token:pci:read:high"])
    assert nothing.post("/tokenize", "x").status == 403


def test_a_create_only_key_gets_tokens_without_data(tenant, limited):
    create_only = limited(tenant, ["token:pci:create"])
    answer = create_only.post("/tokenize", {"c": card()})
    assert answer.status == 201
    assert "data" not in answer.json["c"]
    assert answer.json["c"]["mask"]["number"] == "{{ data.number | card_mask }}"
    assert _read(tenant.client, answer.json["c"]["id"])["data"]["number"] == VISA


def test_no_key_is_401(tenant):
    assert tenant.client.with_key(None).post("/tokenize", "x").status == 401


# ---- fingerprints and deduplication in one request -----------------------------------------------


def test_fingerprint_tokens_setting_and_batch_deduplication(tenant):
    set_settings(tenant, fingerprint_tokens="true", deduplicate_tokens="true")
    answer = tenant.client.post("/tokenize", ["same", "same", "other"])
    assert answer.status == 201
    first, second, other = answer.json
    assert first == second != other
    assert _read(tenant.client, first)["fingerprint"]
    assert len(listed_ids(tenant.client)) == 2


def test_deduplication_stays_within_a_classification(tenant):
    def request(container: str) -> dict:
        return {
            "type": "token",
            "data": "same",
            "containers": [container],
            "deduplicate_token": True,
            "fingerprint_expression": "{{ data }}",
        }

    answer = tenant.client.post("/tokenize", [request("/general/high/"), request("/pci/high/"), request("/pci/low/")])
    assert answer.status == 201
    general, pci, pci_again = (token["id"] for token in answer.json)
    assert general != pci == pci_again


# ---- payment-forwarding tokenize -----------------------------------------------------------------


def _psp(**metadata) -> dict:
    body = {"card": {"number": VISA, "exp_month": "07", "exp_year": str(EXPIRY_YEAR), "cvc": "321", "name": "J D"}}
    if metadata:
        body["metadata"] = metadata
    return body


def test_psp_forward_converts_the_card(tenant):
    answer = tenant.client.post(
        "/connections/psp-forward/tokenize",
        _psp(metadata={"order": "o-1"}, search_indexes=["{{ data.expiration_month }}"]),
    )
    assert answer.status == 201, answer
    token = answer.json
    assert token["type"] == "card"
    assert token["data"] == {"number": VISA, "expiration_month": 7, "expiration_year": EXPIRY_YEAR, "name": "J D"}
    assert token["metadata"] == {"order": "o-1"}
    assert token["fingerprint_expression"] == "{{ data | stringify }}"
    search = tenant.client.post("/v2/tokens/search", {"query": "data:7"})
    assert [t["id"] for t in search.json["data"]] == [token["id"]]


def test_psp_forward_validation(tenant):
    body = {
        "card": {"number": "123", "exp_month": "7", "exp_year": "26", "zip": "1"},
        "metadata": {"containers": ["/general/high/"], "parent_id": "p"},
        "extra": 1,
    }
    answer = tenant.client.post("/connections/psp-forward/tokenize", body)
    assert answer.status == 400
    assert set(answer.json["errors"]) == {"card.exp_month", "card.exp_year", "card.zip", "metadata.parent_id", "extra"}
    answer = tenant.client.post(
        "/connections/psp-forward/tokenize",
        {
            "card": {"number": VISA, "exp_month": "13", "exp_year": "0999"},
            "metadata": {"containers": ["/general/high/"]},
        },
    )
    assert answer.status == 400
    assert set(answer.json["errors"]) == {"card.exp_month", "card.exp_year", "metadata.containers[0]"}
    assert listed_ids(tenant.client) == []


def test_psp_forward_redacts_deduplicated_answers(tenant, limited):
    first = tenant.client.post("/connections/psp-forward/tokenize", _psp(metadata={"k": "v"}, deduplicate_token=True))
    assert first.status == 201
    create_only = limited(tenant, ["token:pci:create", "token:pci:read:low"])
    again = create_only.post("/connections/psp-forward/tokenize", _psp(deduplicate_token=True))
    assert again.status == 201
    assert again.json["id"] == first.json["id"]
    assert "data" not in again.json and "metadata" not in again.json
    full = tenant.client.post("/connections/psp-forward/tokenize", _psp(deduplicate_token=True))
    assert full.json["id"] == first.json["id"]
    assert full.json["data"]["number"] == VISA
    assert full.json["metadata"] == {"k": "v"}
    fresh = create_only.post("/connections/psp-forward/tokenize", {"card": {"number": MASTERCARD}})
    assert fresh.status == 201
    assert fresh.json["data"]["number"] == "555555XXXXXX4444"  # not deduplicated: masked by the read rules
    assert fresh.json["metadata"] == {}


def test_psp_forward_needs_pci_create(tenant, limited):
    key = limited(tenant, ["token:general:create"])
    answer = key.post("/connections/psp-forward/tokenize", _psp())
    assert answer.status == 403
    assert "token:pci:create" in answer.json["detail"]
