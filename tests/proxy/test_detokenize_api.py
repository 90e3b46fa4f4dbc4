"""``POST /detokenize`` over real HTTP: a JSON document's token expressions replaced by token data with
the proxy's expression engine, its 20-token limit, the caller's use and read rights, logged like a
proxy invocation and counted as use."""

from __future__ import annotations

import json

from sqlmodel import select

from storage.db import session_scope
from storage.models_tenancy import TokenActivity

CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2030, "cvc": "123"}


def _card(tenant) -> str:
    answer = tenant.client.post("/tokens", {"type": "card", "data": CARD})
    assert answer.status == 201, answer
    return answer.json["id"]


def test_both_expression_forms_in_any_string_of_any_object_or_array(tenant):
    card = _card(tenant)
    document = {
        "card": f"{{{{ {card} }}}}",
        "number": f"{{{{ {card} | json: '$.number' }}}}",
        "month": f'{{{{ {card} | json: "$.expiration_month" }}}}',
        "text": f"ends in {{{{ {card} | json: '$.number' | last4 }}}}, thanks",
        "nested": [{"year": f"{{{{ token: {card} | json: '$.data.expiration_year' }}}}"}, None, 7, True],
        "plain": "no expression",
    }
    answer = tenant.client.post("/detokenize", document)
    assert answer.status == 200, answer
    assert answer.json == {
        "card": {"number": CARD["number"], "expiration_month": 12, "expiration_year": 2030},  # never the cvc
        "number": CARD["number"],
        "month": 12,
        "text": "ends in 4242, thanks",
        "nested": [{"year": 2030}, None, 7, True],
        "plain": "no expression",
    }
    listed = tenant.client.post("/detokenize", [f"{{{{ {card} | json: '$.number' }}}}", "x"])
    assert listed.status == 200 and listed.json == [CARD["number"], "x"]
    # logged like a proxy invocation, never with the data; the token counts as used
    logs = tenant.client.get("/logs?entity_type=proxy").json["data"]
    assert (logs[0]["entity_id"], logs[0]["operation"]) == ("detokenize", "invoke")
    assert CARD["number"] not in json.dumps(logs)
    with session_scope() as session:
        used = session.exec(select(TokenActivity).where(TokenActivity.tenant_id == tenant.id)).all()
    assert card in {row.token_id for row in used}


def test_at_most_twenty_tokens(tenant):
    ids = tenant.client.post("/tokenize", [f"value-{i}" for i in range(21)]).json
    twenty = {str(i): f"{{{{ {token_id} }}}}" for i, token_id in enumerate(ids[:20])}
    answer = tenant.client.post("/detokenize", twenty)
    assert answer.status == 200 and answer.json == {str(i): f"value-{i}" for i in range(20)}, answer
    too_many = tenant.client.post("/detokenize", {**twenty, "20": f"{{{{ {ids[20]} }}}}"})
    assert too_many.status == 400 and "at most 20 tokens" in too_many.json["detail"], too_many
    assert too_many.json["errors"] == {"body": [too_many.json["detail"]]} and "proxy_error" not in too_many.json


def test_the_callers_use_and_read_rights(tenant, limited):
    card = _card(tenant)
    body = {"n": f"{{{{ {card} | json: '$.number' }}}}"}
    reader = limited(tenant, ["token:pci:read:high"])
    refused = reader.post("/detokenize", body)
    assert refused.status == 403 and "token:pci:use:proxy" in refused.json["detail"], refused
    user = limited(tenant, ["token:pci:use:proxy"])
    refused = user.post("/detokenize", body)
    assert refused.status == 403 and "token:pci:read:high" in refused.json["detail"], refused
    masked_reader = limited(tenant, ["token:pci:use:proxy", "token:pci:read:low"])
    assert masked_reader.post("/detokenize", body).status == 403
    both = limited(tenant, ["token:pci:use:proxy", "token:pci:read:high"])
    assert both.post("/detokenize", body).json == {"n": CARD["number"]}
    assert user.post("/detokenize", {"n": "nothing to read"}).json == {"n": "nothing to read"}


def test_bad_input_is_a_problem_with_errors(tenant, other_tenant):
    card = _card(tenant)
    for body in (
        {"n": "{{ nope-1 }}"},
        {"n": "{{ x | nofilter }}"},
        {"n": "{{ network_token: 2c5f3b3e-0a4e-4a8e-9d7e-1a2b3c4d5e6f }}"},
        {"n": "{{ encrypted | json: '$.data' }}"},
    ):
        answer = tenant.client.post("/detokenize", body)
        assert answer.status == 400 and answer.json["errors"], (body, answer)
    assert tenant.client.post("/detokenize", "just a string").status == 400
    # another tenant's token is unknown here
    answer = other_tenant.client.post("/detokenize", {"n": f"{{{{ {card} }}}}"})
    assert answer.status == 400 and CARD["number"] not in answer.raw.decode()
