"""End to end: POST /tokenize over HTTP -> event -> a real worker delivers a signed webhook."""

from __future__ import annotations

from infra.signing import verify


def test_tokenize_card_delivers_signed_token_created(tenant, receiver):
    created = tenant.client.post(
        "/webhooks",
        {"name": "e2e", "url": receiver.url, "notify_email": "ops@example.com", "events": ["token.created"]},
    )
    assert created.status == 201, created
    secret = tenant.client.get("/webhooks/signing-key").json["key"]
    trace_id = "5f0c7f0e-6a0e-4a8e-9a7e-0d9e6b1f2c3d"
    token = tenant.client.post(
        "/tokenize",
        {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}},
        headers={"TS-TRACE-ID": trace_id},
    )
    assert token.status == 201, token
    assert token.headers["TS-TRACE-ID"] == trace_id
    token_id = token.json["id"]

    hit = receiver.wait_for(lambda r: token_id.encode() in r.body, timeout=30)[0]
    verify(secret, hit.headers, hit.body)
    event = hit.json["event"]
    assert event["type"] == "token.created"
    assert event["tenant_id"] == str(tenant.id)
    assert event["trace_id"] == trace_id
    assert event["data"]["token"]["id"] == token_id
    assert b"4242424242424242" not in hit.body
    assert b"424242" not in hit.body  # not even the BIN: events carry ids and types only
