"""GET /v2/tokens and POST /v2/tokens/search: filters, query forms, cursor pagination, visibility."""

from __future__ import annotations

import pytest

from tests.factories.tokens import MASTERCARD, VISA, bank, card, create, listed_ids, log_operations

pytestmark = pytest.mark.api


def _search(client, query: str, **extra):
    return client.post("/v2/tokens/search", {"query": query, **extra})


def _ids(answer) -> list[str]:
    assert answer.status == 200, answer
    return [token["id"] for token in answer.json["data"]]


# ---- list ----------------------------------------------------------------------------------------


def test_list_newest_first_with_cursor(tenant):
    made = [create(tenant.client, {"type": "token", "data": i})["id"] for i in range(5)]
    first = tenant.client.get("/v2/tokens?size=2")
    assert first.status == 200
    assert first.json["pagination"]["page_size"] == 2
    seen = _ids(first)
    cursor = first.json["pagination"]["next"]
    while cursor:
        page = tenant.client.get(f"/v2/tokens?size=2&start={cursor}")
        seen += _ids(page)
        cursor = page.json["pagination"].get("next")
    assert seen == list(reversed(made))
    assert log_operations(tenant.id, made[0]) == ["create", "read"]
    assert tenant.client.get("/v2/tokens?start=bogus").status == 400
    assert tenant.client.get("/v2/tokens?size=101").status == 400


def test_list_filters(tenant):
    a = create(tenant.client, card(metadata={"customer": "Ann"}))["id"]
    b = create(tenant.client, bank(metadata={"customer": "ann"}))["id"]
    c = create(tenant.client, {"type": "token", "data": 1, "metadata": {"customer": "Ann"}})["id"]
    assert set(listed_ids(tenant.client, "?metadata.customer=Ann")) == {a, c}
    assert listed_ids(tenant.client, "?metadata.customer=ann") == [b]
    assert listed_ids(tenant.client, "?metadata.customer=An") == []
    assert listed_ids(tenant.client, "?type=card&metadata.customer=Ann") == [a]
    assert set(listed_ids(tenant.client, "?type=card&type=bank")) == {a, b}


@pytest.mark.parametrize(
    "query",
    [
        "?id=x",
        "?metadata.a=1&metadata.b=2",
        "?metadata.a=1&metadata.a=2",
        "?fingerprint=x",
        "?type=passport",
        "?metadata.=x",
    ],
)
def test_list_refuses_unsupported_parameters(tenant, query):
    answer = tenant.client.get(f"/v2/tokens{query}")
    assert answer.status == 400, answer
    assert answer.json["errors"]


def test_list_shows_only_readable_classifications(tenant, limited):
    card_id = create(tenant.client, card())["id"]
    token_id = create(tenant.client, {"type": "token", "data": "x"})["id"]
    moved = create(tenant.client, {"type": "token", "data": "y", "containers": ["/pci/low/"]})["id"]
    pci_low = limited(tenant, ["token:pci:read:low"])
    page = pci_low.get("/v2/tokens").json["data"]
    assert {t["id"] for t in page} == {card_id, moved}
    by_id = {t["id"]: t for t in page}
    assert by_id[card_id]["data"]["number"] == "424242XXXXXX4242"
    assert by_id[moved]["data"] == "y"
    general = limited(tenant, ["token:general:read:high"])
    assert listed_ids(general) == [token_id]
    blind = limited(tenant, ["token:general:create"])
    assert blind.get("/v2/tokens").status == 403
    assert _search(blind, f"id:{card_id}").status == 403


# ---- search --------------------------------------------------------------------------------------


def test_search_supported_forms(tenant, other_tenant):
    visa = create(
        tenant.client,
        card(
            id="visa-1",
            metadata={"customer": "c-1", "tier": "Gold"},
            search_indexes=["{{ data.number | last4 }}", "{{ data.expiration_year }}"],
        ),
    )
    master = create(
        tenant.client,
        card(MASTERCARD, metadata={"customer": "c-1", "tier": "gold"}, search_indexes=["{{ data.number | last4 }}"]),
    )
    create(other_tenant.client, card(metadata={"customer": "c-1"}, search_indexes=["{{ data.number | last4 }}"]))

    assert _ids(_search(tenant.client, "id:visa-1")) == ["visa-1"]
    assert _ids(_search(tenant.client, "data:4242")) == [visa["id"]]
    assert _ids(_search(tenant.client, "data:4444")) == [master["id"]]
    assert _ids(_search(tenant.client, "data:424242")) == []
    assert set(_ids(_search(tenant.client, "metadata.customer:c-1"))) == {visa["id"], master["id"]}
    assert _ids(_search(tenant.client, "metadata.customer:c-1 AND metadata.tier:Gold")) == [visa["id"]]
    assert _ids(_search(tenant.client, 'metadata.tier:"gold"')) == [master["id"]]
    assert _ids(_search(tenant.client, "metadata.tier:GOLD")) == []
    found = _search(tenant.client, "metadata.customer:c-1", size=1)
    assert len(_ids(found)) == 1
    rest = _search(tenant.client, "metadata.customer:c-1", size=1, start=found.json["pagination"]["next"])
    assert _ids(rest) != _ids(found) and "next" not in rest.json["pagination"]
    assert VISA not in str(_search(tenant.client, "data:4242").json["data"][0].get("search_indexes"))


def test_search_with_spaces_in_quoted_values(tenant):
    token = create(tenant.client, {"type": "token", "data": "x", "metadata": {"name": "Ada Lovelace"}})
    assert _ids(_search(tenant.client, 'metadata.name:"Ada Lovelace"')) == [token["id"]]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("metadata.a:1 OR metadata.b:2", "OR"),
        ("NOT metadata.a:1", "Negation"),
        ("-metadata.a:1", "Negation"),
        ("type:card", "type"),
        ("fingerprint:abc", "fingerprint"),
        ("container:/pci/high/", "container"),
        ("created_at:2024-01-01", "created_at"),
        ("modified_by:me", "modified_by"),
        ("id:a AND metadata.b:2", "combined"),
        ("data:4242 AND data:1234", "combined"),
        ("id:a AND id:b", "combined"),
        ("metadata.a:1 metadata.b:2", "AND"),
        ("(metadata.a:1 AND metadata.b:2)", "Grouping"),
        ("4242", "field:value"),
        ("metadata.a:1 AND", "AND"),
        ("", "empty"),
        ("metadata.a:", "no value"),
        ('metadata.a:"open', "not closed"),
        ("colour:red", "not known"),
    ],
)
def test_search_refuses_unsupported_forms(tenant, query, named):
    answer = _search(tenant.client, query)
    assert answer.status == 400, answer
    message = answer.json["errors"]["query"][0]
    assert named in message
    assert "Supported: one id:<id> term" in message


def test_search_body_is_validated(tenant):
    assert tenant.client.post("/v2/tokens/search", {"query": "id:x", "size": 0}).status == 400
    assert tenant.client.post("/v2/tokens/search", {"query": "id:x", "sort": "asc"}).status == 400
    assert tenant.client.post("/v2/tokens/search", {}).status == 400
