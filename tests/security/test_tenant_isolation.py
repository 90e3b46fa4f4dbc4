"""Tenant isolation matrix, generated from ``GET /openapi.json``.

Every documented path that takes an id, with every method, is called by tenant B with tenant A's real
ids: the answer is always 404, exactly as for an id that exists nowhere (same problem ``type``,
``title`` and ``status``), and each of A's resources reads the same before and after.

A's resources are created from the document too: ``POST <collection>`` with the operation's own
request example (the collection is the path up to its first ``{id}``); a nested id (``{key_id}``,
``{delivery_id}``) is the first item of the sub-collection before it (created with its example when
it has a POST, else listed). Where an example alone cannot make a resource, :data:`MAKERS` holds the
recipe. A new endpoint with an id is therefore covered as soon as it is documented;
``test_every_id_path_is_covered`` names any path whose resource could not be made.
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from collections.abc import Callable

import pytest

from tests.conftest import make_tenant
from tests.factories.agentic import AMEX, card_token, created, settled
from tests.factories.allowances import allowance, usd
from tests.factories.documents import upload
from tests.helpers import ApiClient, wait_until
from tests.reactors.test_api import settled as reactor_settled
from tests.wallets.issuers import Merchant, key_pem, new_key
from tests.wallets.test_http import apple_body, register

PARAM = re.compile(r"\{([^}]+)\}")
#: Paths whose operations end the caller's own tenant or key: never called by tenant B here.
SELF = ("/tenants/self/members/{id}",)


def _year() -> int:
    return time.gmtime().tm_year + 2


def _network_token(client: ApiClient) -> str:
    answer = client.post(
        "/network-tokens", {"data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": _year()}}
    )
    assert answer.status in (200, 201, 202), answer
    token_id = answer.json["id"]
    wait_until(lambda: client.get(f"/network-tokens/{token_id}").json["status"] != "pending", timeout=30, interval=0.2)
    return token_id


def _payment_method(client: ApiClient) -> str:
    return settled(client, created(client)["id"])["id"]


def _bank_token(client: ApiClient) -> str:
    answer = client.post(
        "/tokens", {"type": "bank", "data": {"routing_number": "110000000", "account_number": "000123456789"}}
    )
    assert answer.status == 201, answer
    return answer.json["id"]


def _token(client: ApiClient) -> str:
    return card_token(client)


def _client_key(client: ApiClient) -> str:
    answer = client.post("/keys", {})
    assert answer.status == 201, answer
    return answer.json["key_id"]


def _document(client: ApiClient) -> str:
    answer = upload(client, b"%PDF-1.4 isolated\n")
    assert answer.status == 201, answer
    return answer.json["id"]


def _token_intent(client: ApiClient) -> str:
    card = {"number": "4242424242424242", "expiration_month": 5, "expiration_year": _year()}
    answer = client.post("/token-intents", {"type": "card", "data": card})
    assert answer.status == 201, answer
    return answer.json["id"]


def _member(client: ApiClient) -> str:
    return client.get("/tenants/self/members").json["data"][0]["id"]


def _allowance(client: ApiClient) -> str:
    return allowance(client, AMEX, "50.00")["id"]  # an spt rail: active at once, so it can mint


def _credential(client: ApiClient, collection: str) -> str:
    answer = client.post(collection, {"rail": "spt", "provider": "psp", "format": "identifier", "amount": usd("1.00")})
    assert answer.status == 201, answer
    return answer.json["id"]


def _reactor(client: ApiClient) -> str:
    answer = client.post(
        "/reactors",
        {
            "name": "isolated",
            "runtime": {"image": "node22"},
            "code": "module.exports = async (req) => ({ raw: req.args });",
        },
    )
    assert answer.status == 201, answer
    return reactor_settled(client, answer.json["id"], states=("active",))["id"]


def _reactor_result(client: ApiClient, collection: str) -> str:
    reactor_path = collection.rsplit("/results", 1)[0]
    started = client.post(f"{reactor_path}/react-async", {"args": {"n": 1}})
    assert started.status == 202, started
    request_id = started.json["async_reactor_request_id"]
    wait_until(lambda: client.get(f"{collection}/{request_id}").status == 200, timeout=60, interval=0.3)
    return request_id


_MERCHANTS: dict[int, Merchant] = {}


def _merchant_certificate(client: ApiClient) -> str:
    merchant = _MERCHANTS.setdefault(id(client), Merchant())
    answer = register(client, merchant)
    assert answer.status == 201, answer
    return answer.json["id"]


def _wallet_a(client: ApiClient) -> str:
    if id(client) not in _MERCHANTS:
        _merchant_certificate(client)
    answer = client.post("/wallet-a", apple_body(_MERCHANTS[id(client)]))
    assert answer.status == 201, answer
    return answer.json["wallet_a"]["id"]


def _wallet_b_key(client: ApiClient) -> str:
    answer = client.post("/wallet-b/merchant-keys", {"private_key": key_pem(new_key()).decode()})
    assert answer.status == 201, answer
    return answer.json["id"]


def _proxy(client: ApiClient) -> str:
    answer = client.post("/proxies", {"name": "isolated", "destination_url": "https://example.com/charges"})
    assert answer.status == 201, answer
    return answer.json["id"]


#: ``collection -> maker(client) -> id`` for resources a request example alone cannot create.
MAKERS: dict[str, Callable[[ApiClient], str]] = {
    "/tokens": _token,
    "/atomic/banks": _bank_token,
    "/network-tokens": _network_token,
    "/agentic/payment-methods": _payment_method,
    "/tenants/self/members": _member,
    "/keys": _client_key,  # the documented example's expires_at lies in the past
    "/documents": _document,  # multipart
    "/token-intents": _token_intent,  # the documented example has no card number
    "/agentic/allowances": _allowance,  # on a payment method of A's
    "/reactors": _reactor,  # its build must end before it can run
    "/wallet-a/merchant-certificates": _merchant_certificate,  # a certificate and key of the tests' chain
    "/wallet-a": _wallet_a,  # a token signed by the tests' chain for A's merchant certificate
    "/wallet-b/merchant-keys": _wallet_b_key,
    "/proxies": _proxy,  # the documented example's destination is not HTTPS
}

#: ``pattern of a nested collection -> maker(client, collection) -> id`` (the parent id is in the path).
NESTED_MAKERS: dict[str, Callable[[ApiClient, str], str]] = {
    r"/agentic/allowances/[^/]+/credentials": _credential,
    r"/reactors/[^/]+/results": _reactor_result,
}

#: Paths with a parameter that is not a resource id: the proxy's tail is the destination's own path.
NOT_IDS = ("/proxy/{tail}",)


#: Collections whose resources are read elsewhere (an atomic bank is a token).
READ_AT = {"/atomic/banks": "/tokens"}


#: Valid bodies where the generated example (placeholder strings) would be refused before any lookup.
BODIES = {
    ("PUT", "/webhooks/{id}"): {"name": "renamed", "url": "https://example.com/hook", "events": ["token.created"]},
    ("PATCH", "/agentic/agents/{agent_id}"): {"name": "renamed"},
    ("PATCH", "/tokens/{id}"): {"metadata": {"renamed": "yes"}},
}


def _example(operation: dict | None):
    for media in ((operation or {}).get("requestBody") or {}).get("content", {}).values():
        if "example" in media:
            return copy.deepcopy(media["example"])
    return None


def _first_id(answer) -> str | None:
    body = answer.json if answer.status < 300 else None
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        return body["id"]
    items = body.get("data") if isinstance(body, dict) else body
    if isinstance(items, list) and items and isinstance(items[0], dict):
        return items[0].get("id")
    return None


class Resources:
    """Tenant A's resources, made on demand and remembered: ``ids_for(path)`` gives every path
    parameter of ``path`` a real id of A's (or records why it could not)."""

    def __init__(self, document: dict, client: ApiClient):
        self.paths = document["paths"]
        self.client = client
        self.ids: dict[str, str] = {}  # concrete collection path -> one id of A's there
        self.missing: dict[str, str] = {}

    def _make(self, collection: str) -> str | None:
        if collection in self.ids or collection in self.missing:
            return self.ids.get(collection)
        template = next((p for p in self.paths if PARAM.sub("{}", p) == collection and "post" in self.paths[p]), None)
        made, tried = None, ""
        for key, maker in MAKERS.items():
            if key == collection:
                made = maker(self.client)
        for pattern, nested in NESTED_MAKERS.items():
            if re.fullmatch(pattern, collection):
                made = nested(self.client, collection)
        if made is None and template is not None:
            answer = self.client.post(collection, _example(self.paths[template].get("post")))
            made, tried = _first_id(answer), f" (POST {collection}: {answer!r})"
        if made is None:
            made = _first_id(self.client.get(collection))
        if made is None:
            self.missing[collection] = "neither a maker, nor the POST example, nor a listing gave an id" + tried
        else:
            self.ids[collection] = made
        return made

    def ids_for(self, path: str) -> dict[str, str] | None:
        """``{parameter: id}`` for every parameter of ``path``, or None when one could not be made."""
        values: dict[str, str] = {}
        concrete = ""
        for piece in re.split(r"(\{[^}]+\})", path):
            match = PARAM.fullmatch(piece)
            if not match:
                concrete += piece
                continue
            known = self._make(concrete.rstrip("/"))
            if known is None:
                return None
            values[match.group(1)] = known
            concrete += known
        return values


def _resolve(path: str, values: dict[str, str]) -> str:
    return PARAM.sub(lambda m: values[m.group(1)], path)


def _stable(value):
    """``value`` with pre-signed URLs cut at their query (signed afresh on every read: not a change)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    if isinstance(value, str) and "X-Amz-Signature=" in value:
        return value.split("?", 1)[0]
    return value


def _read(client: ApiClient, collection: str, resource_id: str):
    """How tenant A sees one of its resources: ``GET collection/id``, or its item in the listing
    where the resource has no read of its own."""
    collection = READ_AT.get(collection, collection)
    answer = client.get(f"{collection}/{resource_id}")
    if answer.status == 200:
        return _stable(answer.json)
    listing = client.get(collection).json
    items = listing.get("data", []) if isinstance(listing, dict) else listing
    found = [item for item in items if resource_id in (item.get("id"), item.get("key_id"))]
    assert found, f"tenant A cannot read {collection}/{resource_id}: {answer!r}"
    return _stable(found[0])


@pytest.fixture(scope="module")
def matrix(api, receiver_module):
    """``(document, A's client, B's client, A's resources)``: A holds one resource of every kind."""
    owner_a = make_tenant(api, name="isolated-a")
    owner_b = make_tenant(api, name="isolated-b")
    document = owner_a.client.get("/openapi.json").json
    resources = Resources(document, owner_a.client)
    # a webhook of A's with a delivery: the nested delivery id is then real
    hook = owner_a.client.post(
        "/webhooks", {"name": "isolated", "url": receiver_module.url, "events": ["token.created"]}
    )
    assert hook.status == 201, hook
    resources.ids["/webhooks"] = hook.json["id"]
    _token(owner_a.client)
    wait_until(lambda: owner_a.client.get(f"/webhooks/{hook.json['id']}/deliveries").json["data"], timeout=30)
    for path in document["paths"]:
        if "{" in path:
            resources.ids_for(path)
    return document, owner_a.client, owner_b.client, resources


@pytest.fixture(scope="module")
def receiver_module():
    from tests.helpers import WebhookReceiver

    server = WebhookReceiver().start()
    yield server
    server.stop()


def _id_paths(document: dict) -> list[str]:
    """Paths with an id that some operation answers (a shut-down path answers 410 to everyone)."""
    return [
        path
        for path, operations in document["paths"].items()
        if "{" in path
        and path not in SELF
        and path not in NOT_IDS
        and any(_answers(operation) for operation in operations.values())
    ]


def test_every_id_path_is_covered(matrix):
    document, _, _, resources = matrix
    uncovered = [path for path in _id_paths(document) if resources.ids_for(path) is None]
    assert not uncovered, f"no resource of tenant A for {uncovered}: {resources.missing}"
    assert len(_id_paths(document)) >= 25


def _settled(client: ApiClient, collections: dict[str, str]) -> dict:
    """A's view of its resources once slow work on them (an account-updater job running, a network
    token being provisioned) has finished: each read again a second later agrees (only the resources
    that changed are read again, which keeps rate-limited families under their limits)."""
    views = {c: _read(client, c, i) for c, i in collections.items()}
    moving = set(collections)
    deadline = time.monotonic() + 60
    while moving:
        assert time.monotonic() < deadline, f"still changing after 60 s: {sorted(moving)}"
        time.sleep(1.0)
        for collection in sorted(moving):
            current = _read(client, collection, collections[collection])
            if current == views[collection]:
                moving.discard(collection)
            else:
                views[collection] = current
    return views


def _media_type(operation: dict) -> str:
    return next(iter((operation.get("requestBody") or {}).get("content") or {"application/json": {}}))


def _answers(operation: dict) -> bool:
    """Whether the operation documents a success at all (a shut-down one answers 410 to everyone)."""
    return any(status.startswith("2") for status in operation.get("responses", {}))


def _problem(answer) -> dict:
    body = answer.json if answer.raw else {}
    return {k: body.get(k) for k in ("type", "title", "status", "errors")} | {"http": answer.status}


def test_tenant_b_gets_404_for_every_id_of_tenant_a_and_nothing_changes(matrix):
    """B's call with A's ids answers 404 exactly like a call with ids that exist nowhere. Where the
    documented example body is refused as invalid (400) before any lookup, B's answer must equal the
    answer for a missing id and A's own call with that body must be refused the same way: the body is
    invalid for everyone, so the answer says nothing about A's resource (such calls are counted apart)."""
    document, client_a, client_b, resources = matrix
    collections = dict(resources.ids)
    before = _settled(client_a, collections)
    calls, invalid_bodies, wrong = 0, [], []
    for path in _id_paths(document):
        values = resources.ids_for(path)
        for method, operation in document["paths"][path].items():
            if not _answers(operation):
                continue
            body = BODIES.get((method.upper(), path), _example(operation))
            kind = _media_type(operation)
            answer = client_b.request(method.upper(), _resolve(path, values), body, content_type=kind)
            nowhere = client_b.request(
                method.upper(), _resolve(path, {k: str(uuid.uuid4()) for k in values}), body, content_type=kind
            )
            calls += 1
            if answer.status == 400 and _problem(answer) == _problem(nowhere):
                invalid_bodies.append((method.upper(), path, values, body, kind))
            elif answer.status != 404:
                wrong.append(f"{method.upper()} {path}: {answer.status} {answer.raw[:200]!r}")
            elif _problem(answer) != _problem(nowhere):
                wrong.append(
                    f"{method.upper()} {path}: {_problem(answer)} differs from a missing id's {_problem(nowhere)}"
                )
    after = {c: _read(client_a, c, i) for c, i in collections.items()}
    changed = [c for c in collections if before[c] != after[c]]
    for method, path, values, body, kind in invalid_bodies:  # after the comparison: A's call may not change A
        own = client_a.request(method, _resolve(path, values), body, content_type=kind)
        if own.status != 400:
            wrong.append(f"{method} {path}: refused (400) to B but answered {own.status} to A with the same body")
    print(
        f"tenant isolation: {calls} cross-tenant calls over {len(_id_paths(document))} paths; "
        f"{len(invalid_bodies)} refused as invalid for everyone"
    )
    assert not wrong, "\n".join(wrong)
    assert not changed, f"tenant A's resources changed: {changed}"
    assert calls >= 40 and len(invalid_bodies) < calls / 4
