"""POST/GET/PATCH/DELETE /tokens, read levels, aliases, children, deduplication, expiry, deprecations,
the sweeps and the domain functions later features use."""

from __future__ import annotations

import datetime as dt

import pytest

from domain.tokens import service as tokens
from storage.db import session_scope
from tests.factories.tokens import (
    EXPIRY_YEAR,
    MASTERCARD,
    READ_ALL,
    VISA,
    bank,
    card,
    create,
    events_of,
    expire_now,
    listed_ids,
    log_operations,
    set_settings,
    stored,
    subscribe,
)

pytestmark = pytest.mark.api

MERGE = "application/merge-patch+json"
FAR_FUTURE = dt.datetime.now(dt.UTC) + dt.timedelta(days=3650)


def _patch(client, token_id: str, body: dict):
    return client.patch(f"/tokens/{token_id}", body, content_type=MERGE)


# ---- create and read -----------------------------------------------------------------------------


def test_create_card_and_read_it_back(tenant, receiver):
    subscribe(tenant, receiver.url)
    token = create(tenant.client, card(metadata={"customer": "c-1"}))
    assert token["tenant_id"] == str(tenant.id)
    assert token["data"] == {"number": VISA, "expiration_month": 12, "expiration_year": EXPIRY_YEAR}
    assert token["containers"] == ["/pci/high/"]
    assert token["fingerprint"] and token["fingerprint_expression"] == "{{ data.number }}"
    assert token["created_by"] == str(tenant.application_id)
    assert set(token) == {
        "id",
        "tenant_id",
        "type",
        "data",
        "mask",
        "containers",
        "metadata",
        "search_indexes",
        "fingerprint",
        "fingerprint_expression",
        "deduplicate_token",
        "parent_id",
        "created_by",
        "created_at",
        "modified_by",
        "modified_at",
        "expires_at",
    }
    read = tenant.client.get(f"/tokens/{token['id']}")
    assert read.status == 200
    assert read.json == token
    assert "cvc" not in read.raw.decode()
    assert events_of(tenant.id, token["id"]) == [("token.created", {"token": {"id": token["id"], "type": "card"}})]
    assert log_operations(tenant.id, token["id"]) == ["create", "read"]


def test_data_is_stored_encrypted_and_the_cvc_is_kept_for_providers(tenant):
    token = create(tenant.client, card())
    row = stored(tenant.id, token["id"])
    assert VISA.encode() not in row.data_ct
    assert row.cvc_expires_at is not None
    with session_scope() as session:
        loaded, data = tokens.load_token_data(session, tenant.id, token["id"])
    assert loaded.id == token["id"]
    assert data["cvc"] == "123"


def test_read_levels_complete_masked_absent(tenant, limited):
    card_token = create(tenant.client, card())
    low_token = create(tenant.client, {"type": "token", "data": "secret", "containers": ["/general/low/"]})
    plain = create(tenant.client, {"type": "token", "data": "secret"})
    high = limited(tenant, ["token:pci:read:high"])
    low = limited(tenant, ["token:pci:read:low", "token:general:read:low"])
    none = limited(tenant, ["token:bank:read:high"])

    assert high.get(f"/tokens/{card_token['id']}").json["data"]["number"] == VISA
    masked = low.get(f"/tokens/{card_token['id']}").json["data"]
    assert masked == {"number": "424242XXXXXX4242", "expiration_month": 12, "expiration_year": EXPIRY_YEAR}
    answer = none.get(f"/tokens/{card_token['id']}")
    assert answer.status == 403
    assert "token:pci:read:high" in answer.json["detail"]
    assert low.get(f"/tokens/{low_token['id']}").json["data"] == "secret"
    assert "data" not in low.get(f"/tokens/{plain['id']}").json  # masked level, no mask: no data


def test_custom_mask_and_containers(tenant, limited):
    token = create(
        tenant.client,
        bank(
            mask={"account_number": "{{ data.account_number | last4 }}"}, containers=["/bank/moderate/", "/bank/high/"]
        ),
    )
    assert token["containers"] == ["/bank/moderate/", "/bank/high/"]
    moderate = limited(tenant, ["token:bank:read:moderate"])
    assert moderate.get(f"/tokens/{token['id']}").json["data"]["routing_number"]  # lowest container level
    low = limited(tenant, ["token:bank:read:low"])
    assert low.get(f"/tokens/{token['id']}").json["data"] == {"account_number": "6789"}


def test_create_validation(tenant):
    cases = [
        ({"type": "card", "data": {"number": VISA}, "colour": "red"}, {"colour"}),
        ({"data": "x"}, {"type"}),
        ({"type": "ticket", "data": "x"}, {"type"}),
        ({"type": "token"}, {"data"}),
        (card(containers=["/bank/high/"]), {"containers[0]"}),
        (card(containers="/pci/high/"), {"containers"}),
        ({"type": "token", "data": 1, "containers": ["/general/high/", "/pci/high/"]}, {"containers"}),
        (card(metadata={"k": 1}), {"metadata.k"}),
        (card(metadata={f"k{i}": "v" for i in range(101)}), {"metadata"}),
        (card(id="has space"), {"id"}),
        (card(expires_at="2001-01-01T00:00:00Z"), {"expires_at"}),
        (card(expires_at="tomorrow"), {"expires_at"}),
        (card(search_indexes=["{{ data.number"]), {"search_indexes[0]"}),
        (card(search_indexes=["{{ data.nope | last4 }}"]), {"search_indexes[0]"}),
        (card(search_indexes=["{{ data.number }}"] * 21), {"search_indexes"}),
        (card(fingerprint_expression="{{ data.number | nope }}"), {"fingerprint_expression"}),
        (card(mask={"number": "{{ data.number | nope }}"}), {"mask.number"}),
        (card(deduplicate_token="yes"), {"deduplicate_token"}),
        (card(parent_id="missing"), {"parent_id"}),
        (bank(account="12"), {"data.account_number"}),
    ]
    for body, keys in cases:
        answer = tenant.client.post("/tokens", body)
        assert answer.status == 400, (body, answer)
        assert set(answer.json["errors"]) == keys, (body, answer.json["errors"])
    assert tenant.client.post("/tokens", ["not", "an", "object"]).status == 400
    assert listed_ids(tenant.client) == []


def test_privacy_is_accepted_and_ignored(tenant):
    token = create(tenant.client, card(privacy={"classification": "general", "impact_level": "low"}))
    assert token["containers"] == ["/pci/high/"]
    assert "privacy" not in token


def test_create_permissions(tenant, limited):
    key = limited(tenant, ["token:general:create"])
    answer = key.post("/tokens", bank())
    assert answer.status == 403
    assert "token:bank:create" in answer.json["detail"]
    assert listed_ids(tenant.client) == []


# ---- aliases and other tenants -------------------------------------------------------------------


def test_alias_and_conflict(tenant, other_tenant):
    token = create(tenant.client, card(id="cust_42:card.1"))
    assert token["id"] == "cust_42:card.1"
    assert tenant.client.get("/tokens/cust_42:card.1").json["data"]["number"] == VISA
    again = tenant.client.post("/tokens", card(MASTERCARD, id="cust_42:card.1"))
    assert again.status == 409
    twice = tenant.client.post(
        "/tokenize", [{"type": "token", "data": 1, "id": "dup"}, {"type": "token", "data": 2, "id": "dup"}]
    )
    assert twice.status == 400
    assert set(twice.json["errors"]) == {"[1].id"}
    # the same alias in another tenant is another token
    assert create(other_tenant.client, card(id="cust_42:card.1"))["id"] == "cust_42:card.1"


def test_an_expired_alias_can_be_reused(tenant):
    create(tenant.client, {"type": "token", "data": "old", "id": "reuse-me"})
    expire_now(tenant.id, "reuse-me")
    assert create(tenant.client, {"type": "token", "data": "new", "id": "reuse-me"})["data"] == "new"


def test_other_tenants_tokens_are_not_found(tenant, other_tenant):
    token = create(tenant.client, card())
    path = f"/tokens/{token['id']}"
    assert other_tenant.client.get(path).status == 404
    assert _patch(other_tenant.client, token["id"], {"metadata": {"a": "b"}}).status == 404
    assert other_tenant.client.delete(path).status == 404
    assert other_tenant.client.get(f"{path}/children").status == 404
    assert tenant.client.get(path).status == 200
    assert tenant.client.get("/tokens/no-such-token").status == 404


# ---- expiry --------------------------------------------------------------------------------------


def test_expired_tokens_read_as_missing_and_are_swept(tenant, receiver):
    subscribe(tenant, receiver.url)
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
    token = create(tenant.client, card(expires_at=soon))
    assert token["expires_at"]
    kept = create(tenant.client, {"type": "token", "data": "kept"})
    expire_now(tenant.id, token["id"])
    assert tenant.client.get(f"/tokens/{token['id']}").status == 404
    assert _patch(tenant.client, token["id"], {"metadata": {"a": "b"}}).status == 404
    assert listed_ids(tenant.client) == [kept["id"]]
    with session_scope() as session:
        assert tokens.delete_expired_tokens(session, now=FAR_FUTURE) >= 1
    assert stored(tenant.id, token["id"]) is None
    assert stored(tenant.id, kept["id"]) is not None
    assert ("token.deleted", {"token": {"id": token["id"], "type": "card"}}) in events_of(tenant.id, token["id"])


def test_purge_card_verification_codes(tenant):
    token = create(tenant.client, card())
    with session_scope() as session:
        assert tokens.purge_card_verification_codes(session, now=FAR_FUTURE) >= 1
    row = stored(tenant.id, token["id"])
    assert row.cvc_expires_at is None
    with session_scope() as session:
        _, data = tokens.load_token_data(session, tenant.id, token["id"])
    assert "cvc" not in data
    assert data["number"] == VISA
    with session_scope() as session:
        assert tokens.purge_card_verification_codes(session, now=FAR_FUTURE) == 0


# ---- merge patch ---------------------------------------------------------------------------------


def test_merge_patch(tenant, receiver):
    subscribe(tenant, receiver.url)
    token = create(tenant.client, card(metadata={"a": "1", "b": "2"}, search_indexes=["{{ data.number | last4 }}"]))
    assert tenant.client.patch(f"/tokens/{token['id']}", {"metadata": {"a": "x"}}).status == 415
    answer = _patch(
        tenant.client, token["id"], {"data": {"expiration_month": 1, "name": "Ada"}, "metadata": {"a": None, "c": "3"}}
    )
    assert answer.status == 200, answer
    patched = answer.json
    assert patched["data"] == {"number": VISA, "expiration_month": 1, "expiration_year": EXPIRY_YEAR, "name": "Ada"}
    assert patched["metadata"] == {"b": "2", "c": "3"}
    assert patched["modified_at"] and patched["modified_by"] == str(tenant.application_id)
    assert tenant.client.get(f"/tokens/{token['id']}").json == patched
    assert [t for t, _ in events_of(tenant.id, token["id"])] == ["token.created", "token.updated"]
    search = tenant.client.post("/v2/tokens/search", {"query": "metadata.c:3"})
    assert [t["id"] for t in search.json["data"]] == [token["id"]]
    assert tenant.client.post("/v2/tokens/search", {"query": "metadata.a:1"}).json["data"] == []

    renumbered = _patch(tenant.client, token["id"], {"data": {"number": MASTERCARD}}).json
    assert renumbered["fingerprint"] != token["fingerprint"]
    assert tenant.client.post("/v2/tokens/search", {"query": "data:4444"}).json["data"][0]["id"] == token["id"]
    assert tenant.client.post("/v2/tokens/search", {"query": "data:4242"}).json["data"] == []


def test_merge_patch_validation(tenant, limited):
    token = create(tenant.client, card())
    cases = [
        ({"data": {"number": "4242424242424241"}}, {"data.number"}),
        ({"data": None}, {"data"}),
        ({"id": "new", "type": "bank"}, {"id", "type"}),
        ({"parent_id": "x"}, {"parent_id"}),
        ({"containers": ["/general/high/"]}, {"containers[0]"}),
        ({"expires_at": "2001-01-01T00:00:00Z"}, {"expires_at"}),
    ]
    for body, keys in cases:
        answer = _patch(tenant.client, token["id"], body)
        assert answer.status == 400, (body, answer)
        assert set(answer.json["errors"]) == keys
    assert _patch(tenant.client, token["id"], ["not", "an", "object"]).status == 400
    reader = limited(tenant, ["token:pci:read:high"])
    answer = _patch(reader, token["id"], {"metadata": {"a": "b"}})
    assert answer.status == 403
    assert "token:pci:update" in answer.json["detail"]
    assert tenant.client.get(f"/tokens/{token['id']}").json == token


def test_merge_patch_removes_to_defaults(tenant):
    token = create(
        tenant.client,
        {
            "type": "token",
            "data": {"a": 1},
            "mask": "{{ data.a }}",
            "containers": ["/general/low/"],
            "fingerprint_expression": "{{ data.a }}",
        },
    )
    patched = _patch(
        tenant.client,
        token["id"],
        {"mask": None, "containers": None, "fingerprint_expression": None, "privacy": {"x": 1}},
    ).json
    assert patched["mask"] is None
    assert patched["containers"] == ["/general/high/"]
    assert patched["fingerprint"] is None and patched["fingerprint_expression"] is None


# ---- delete and children -------------------------------------------------------------------------


def test_children_and_delete(tenant, limited, receiver):
    subscribe(tenant, receiver.url)
    parent = create(tenant.client, card())
    child_card = create(tenant.client, card(MASTERCARD, parent_id=parent["id"]))
    child_token = create(tenant.client, {"type": "token", "data": "t", "parent_id": parent["id"]})
    grandchild = create(tenant.client, {"type": "token", "data": "g", "parent_id": child_token["id"]})
    unrelated = create(tenant.client, {"type": "token", "data": "u"})
    assert child_card["parent_id"] == parent["id"]

    page = tenant.client.get(f"/tokens/{parent['id']}/children")
    assert page.status == 200, page
    assert page.json["pagination"] == {"total_items": 2, "page_number": 1, "page_size": 20, "total_pages": 1}
    assert {t["id"] for t in page.json["data"]} == {child_card["id"], child_token["id"]}
    by_type = tenant.client.get(f"/tokens/{parent['id']}/children?type=card").json["data"]
    assert [t["id"] for t in by_type] == [child_card["id"]]
    by_id = tenant.client.get(f"/tokens/{parent['id']}/children?id={child_token['id']}&id=nope").json["data"]
    assert [t["id"] for t in by_id] == [child_token["id"]]
    paged = tenant.client.get(f"/tokens/{parent['id']}/children?size=1&page=2").json
    assert paged["pagination"]["total_pages"] == 2 and len(paged["data"]) == 1
    assert tenant.client.get(f"/tokens/{parent['id']}/children?type=passport").status == 400

    low = limited(tenant, ["token:pci:read:low"])
    children = {t["id"]: t for t in low.get(f"/tokens/{parent['id']}/children").json["data"]}
    assert children[child_card["id"]]["data"]["number"] == "555555XXXXXX4444"
    assert "data" not in children[child_token["id"]]
    general = limited(tenant, ["token:general:read:high"])
    assert general.get(f"/tokens/{parent['id']}/children").status == 403

    assert tenant.client.delete(f"/tokens/{parent['id']}").status == 204
    for gone in (parent, child_card, child_token, grandchild):
        assert tenant.client.get(f"/tokens/{gone['id']}").status == 404
    assert tenant.client.get(f"/tokens/{unrelated['id']}").status == 200
    assert ("token.deleted", {"token": {"id": grandchild["id"], "type": "token"}}) in events_of(
        tenant.id, grandchild["id"]
    )
    assert log_operations(tenant.id, parent["id"])[-1] == "delete"
    assert tenant.client.delete(f"/tokens/{parent['id']}").status == 404


def test_delete_needs_the_permission_of_every_classification(tenant, limited):
    parent = create(tenant.client, {"type": "token", "data": "p"})
    create(tenant.client, card(parent_id=parent["id"]))
    key = limited(tenant, ["token:general:delete"])
    answer = key.delete(f"/tokens/{parent['id']}")
    assert answer.status == 403
    assert "token:pci:delete" in answer.json["detail"]
    assert tenant.client.get(f"/tokens/{parent['id']}").status == 200


# ---- deduplication -------------------------------------------------------------------------------


def test_deduplication_update_existing(tenant):
    set_settings(tenant, deduplicate_tokens="true")
    first = create(tenant.client, card(metadata={"v": "1"}))
    newer = card(metadata={"v": "2"})
    newer["data"]["expiration_month"] = 6
    second = tenant.client.post("/tokens", newer)
    assert second.status == 201
    assert second.json["id"] == first["id"]
    assert second.json["data"]["expiration_month"] == 6
    assert second.json["metadata"] == {"v": "2"}
    assert listed_ids(tenant.client) == [first["id"]]
    opted_out = create(tenant.client, card(deduplicate_token=False))
    assert opted_out["id"] != first["id"]


def test_deduplication_read_existing(tenant):
    set_settings(tenant, deduplicate_tokens="true", token_deduplication_behavior="read_existing")
    first = create(tenant.client, bank(metadata={"v": "1"}))
    second = create(tenant.client, bank(metadata={"v": "2"}))
    assert second["id"] == first["id"]
    assert second["metadata"] == {"v": "1"}
    assert second["modified_at"] is None


def test_deduplication_by_request_flag(tenant):
    first = create(tenant.client, card(deduplicate_token=True))
    assert create(tenant.client, card(deduplicate_token=True))["id"] == first["id"]
    assert create(tenant.client, card())["id"] != first["id"]  # tenant setting is 'false'
    custom = create(
        tenant.client,
        {
            "type": "token",
            "data": {"email": "a@b.c", "n": 1},
            "fingerprint_expression": "{{ data.email }}",
            "deduplicate_token": True,
        },
    )
    same = create(
        tenant.client,
        {
            "type": "token",
            "data": {"email": "a@b.c", "n": 2},
            "fingerprint_expression": "{{ data.email }}",
            "deduplicate_token": True,
        },
    )
    assert same["id"] == custom["id"] and same["data"]["n"] == 2


# ---- deprecations --------------------------------------------------------------------------------


def test_v1_list_and_search_are_gone(tenant):
    for answer in (tenant.client.get("/tokens"), tenant.client.post("/tokens/search", {"query": "id:x"})):
        assert answer.status == 410
        assert "/v2/tokens" in answer.json["detail"]


def test_decrypt_endpoints_answer_like_reads_with_a_deprecation_header(tenant, limited):
    card_token = create(tenant.client, card())
    bank_token = create(tenant.client, bank())
    answer = tenant.client.get(f"/tokens/{card_token['id']}/decrypt")
    assert answer.status == 200
    assert answer.headers["Deprecation"] == "@1641168000"
    assert answer.json == tenant.client.get(f"/tokens/{card_token['id']}").json
    low = limited(tenant, ["token:pci:read:low", "token:bank:read:low"])
    assert low.get(f"/tokens/{card_token['id']}/decrypt").json["data"]["number"] == "424242XXXXXX4242"
    banks = low.get(f"/atomic/banks/{bank_token['id']}/decrypt")
    assert banks.status == 200 and banks.headers["Deprecation"] == "@1641168000"
    assert banks.json["data"]["account_number"] == "XXXXX6789"
    not_a_bank = tenant.client.get(f"/atomic/banks/{card_token['id']}/decrypt")
    assert not_a_bank.status == 404 and not_a_bank.headers["Deprecation"] == "@1641168000"
    listing = tenant.client.get("/tokens/decrypt?type=bank")
    assert listing.status == 200 and listing.headers["Deprecation"] == "@1641168000"
    assert [t["id"] for t in listing.json["data"]] == [bank_token["id"]]


def test_read_permissions_for_full_access(tenant, limited):
    token = create(tenant.client, {"type": "token", "data": "x"})
    reader = limited(tenant, READ_ALL)
    assert reader.get(f"/tokens/{token['id']}").json["data"] == "x"


# ---- events only for subscribers; activity through created_at -------------------------------------


def test_events_are_recorded_only_while_a_webhook_subscribes(tenant, receiver):
    first = create(tenant.client, card())
    assert events_of(tenant.id, first["id"]) == []  # nobody listens: no event row
    assert log_operations(tenant.id, first["id"]) == ["create"]  # the log row stays
    webhook = subscribe(tenant, receiver.url, ["token.created"])  # seen at once by this api process
    second = create(tenant.client, card())
    assert events_of(tenant.id, second["id"]) == [("token.created", {"token": {"id": second["id"], "type": "card"}})]
    assert tenant.client.delete(f"/tokens/{second['id']}").status == 204
    assert [t for t, _ in events_of(tenant.id, second["id"])] == ["token.created"]  # not subscribed to deleted
    disabled = {"name": webhook["name"], "url": webhook["url"], "events": webhook["events"], "status": "disabled"}
    assert tenant.client.put(f"/webhooks/{webhook['id']}", disabled).status == 200
    third = create(tenant.client, card())
    assert events_of(tenant.id, third["id"]) == []


def test_monthly_active_tokens_count_created_and_deleted_tokens(tenant):
    def active() -> int:
        return tenant.client.get("/tenants/self/reports/usage").json["token_report"]["monthly_active_tokens"]

    assert active() == 0
    made = [create(tenant.client, card()) for _ in range(2)]
    answer = tenant.client.post("/tokenize", {"a": "x", "b": card()})
    assert answer.status == 201, answer
    assert active() == 4
    assert tenant.client.get(f"/tokens/{made[0]['id']}").status == 200  # created and read: still one
    assert tenant.client.delete(f"/tokens/{made[1]['id']}").status == 204  # deleted: still counted
    assert active() == 4
