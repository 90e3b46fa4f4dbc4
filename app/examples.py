"""Request examples (and answer examples a schema cannot suggest) of the OpenAPI description, keyed by
``"METHOD /path"``.

Each is a request the API accepts as it stands: sandbox test cards (``sandbox/README.md``), ids in
the platform's own form, dates as offsets a reader can reuse. An operation missing here gets an example
built from its schema (``app.openapi.example_of``); ``tests/app/test_openapi_examples.py`` posts every
documented request example to a running API and checks every answer example against its schema.
"""

from __future__ import annotations

from typing import Any

from domain.webhooks.events import EVENT_TYPES

#: A sandbox test card that tokenizes, provisions network tokens and enrolls agentic rails.
_CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}
_TOKEN_ID = "0e6a3a3c-5f2f-4c55-8f41-3a4e7c1b9d02"  # noqa: S105 - a token id, not a secret
_AMOUNT = {"value": "50.00", "currency": "USD"}
_REACTOR_CODE = (
    "module.exports = async function (req) {\n  return { raw: { greeting: 'hello ' + req.args.name } };\n};\n"
)

REQUEST_EXAMPLES: dict[str, Any] = {
    "PUT /tenants/self": {"name": "Acme payments"},
    "PUT /tenants/self/security-contact": {"email": "security@example.com"},
    "POST /tenants/self/invitations": {"email": "new.member@example.com", "role": "READ_ONLY"},
    "POST /invitations/accept": {
        "token": "c3e1f8a4b2d94e0f9a7b6c5d4e3f2a1b",
        "first_name": "Ada",
        "last_name": "Lovelace",
    },
    "POST /keys": {},
    "POST /applications": {
        "name": "Checkout backend",
        "type": "private",
        "permissions": ["token:create", "token:read"],
    },
    "PUT /applications/{id}": {"name": "Checkout backend", "permissions": ["token:create", "token:read"]},
    "POST /connections/psp-forward/tokenize": {
        "card": {"number": "4242424242424242", "exp_month": "12", "exp_year": "2031", "cvc": "123"},
        "metadata": {"containers": ["/pci/high/"]},
    },
    "POST /v2/tokens/search": {"query": "metadata.order:1234", "size": 20},
    "PATCH /tokens/{id}": {"metadata": {"order": "1235"}},
    "POST /token-intents": {"type": "card", "data": {**_CARD, "cvc": "123"}},
    "POST /token-intents/{id}/convert": {"metadata": {"order": "1234"}},
    "POST /network-tokens": {"data": _CARD},
    "POST /enrichments/bank-account-verify": {"token_id": _TOKEN_ID},
    "POST /agentic/allowances": {
        "payment_method_id": "pm_3Qx7c2kTq8",
        "amount": _AMOUNT,
        "description": "Groceries for the week",
    },
    "PATCH /agentic/allowances/{allowance_id}": {
        "amount": {"value": "75.00", "currency": "USD"},
        "description": "Groceries for two weeks",
    },
    "POST /agentic/allowances/{allowance_id}/rails/verify": {
        "rail": "agentic-token",
        "provider": "vic",
        "action": "start",
    },
    "POST /agentic/allowances/{allowance_id}/credentials": {
        "rail": "agentic-token",
        "provider": "vic",
        "format": "card",
        "amount": {"value": "12.50", "currency": "USD"},
    },
    "POST /agentic/payment-methods": {
        "source": {"type": "svc_card_token", "token_id": _TOKEN_ID},
        "consumer": {"email": "shopper@example.com", "country_code": "US"},
    },
    "POST /agentic/payment-methods/{payment_method_id}/rails/retry": {"rail": "agentic-token", "provider": "vic"},
    "POST /agentic/agents": {"name": "Shopping assistant"},
    "PATCH /agentic/agents/{agent_id}": {"name": "Shopping assistant (EU)"},
    "POST /webhooks": {
        "name": "Order service",
        "url": "https://example.com/hooks/tessera",
        "notify_email": "ops@example.com",
        "events": ["token.created", "network-token.created"],
    },
    "PUT /webhooks/{id}": {
        "name": "Order service",
        "url": "https://example.com/hooks/tessera",
        "events": ["token.created"],
        "status": "enabled",
    },
    "POST /reactors": {"name": "Greeter", "code": _REACTOR_CODE, "runtime": {"image": "node22"}},
    "PUT /reactors/{id}": {"name": "Greeter", "code": _REACTOR_CODE, "runtime": {"image": "node22"}},
    "PATCH /reactors/{id}": {"name": "Greeter v2"},
    "POST /reactors/{id}/react": {"args": {"name": "Ada"}},
    "POST /reactors/{id}/react-async": {"args": {"name": "Ada"}},
    "POST /wallet-a/domain-registration": {"domain": "shop.example.com"},
    "PUT /wallet-a/domain-registration": {"domains": ["shop.example.com", "checkout.example.com"]},
    "POST /wallet-a/domain-deregistration": {"domain": "shop.example.com"},
    "POST /wallet-a/session": {"display_name": "Acme shop", "domain": "shop.example.com"},
    "POST /proxies": {
        "name": "Payment processor",
        "destination_url": "https://api.example.com/charges",
        "require_auth": True,
    },
    "PUT /proxies/{id}": {
        "name": "Payment processor",
        "destination_url": "https://api.example.com/charges",
        "require_auth": True,
    },
    "PATCH /proxies/{id}": {"name": "Payment processor (EU)"},
    "POST /detokenize": {"card_number": "{{ " + _TOKEN_ID + " | json: '$.number' }}", "amount": 1250},
}

#: Answers whose values the schema cannot suggest (a list of plain strings).
RESPONSE_EXAMPLES: dict[str, Any] = {
    "GET /webhooks/event-types": list(EVENT_TYPES),
}
