"""The proxy over real HTTP: ``/proxy`` and ``/proxy/**`` (ephemeral and pre-configured invocation) and
``/proxies`` (core document section 4 "Proxy", rules 1-10; sections 5, 7 and 8), against an HTTPS
destination on loopback with a test certificate authority (``tests/proxy/upstream.py``)."""

from __future__ import annotations

import json
import socket
import ssl
import uuid
import warnings

import pytest
from aiohttp import web
from sqlmodel import select

from app.main import init_app
from config.settings import get_settings
from storage.db import session_scope
from storage.models_proxy import Proxy
from storage.models_tenancy import TokenActivity
from tests.conftest import RunningApi, app_with_permissions, free_port, make_tenant, serve_in_thread
from tests.proxy.certificates import DEST, LOCAL, resolve_names
from tests.proxy.upstream import start_upstream

CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2030, "cvc": "123"}
URL, KEY, API_KEY = "TS-PROXY-URL", "TS-PROXY-KEY", "TS-API-KEY"
STATUS = "TS-PROXY-DESTINATION-STATUS"
USE = ["proxy:invoke", "token:pci:use:proxy", "token:general:use:proxy"]


@pytest.fixture(scope="module")
def destination(tmp_path_factory):
    upstream, stop = start_upstream(tmp_path_factory.mktemp("proxy-ca"))
    yield upstream
    stop()


def _serve(destination, **settings) -> tuple[RunningApi, object]:
    """An api (same database and worker as ``api``) trusting the destination's CA
    (``TESSERA_PROXY_CA_BUNDLE``), with ``settings`` changed."""
    changed = get_settings().model_copy(update={"proxy_ca_bundle": str(destination.ca), **settings})
    port = free_port()
    stop = serve_in_thread(lambda: init_app(changed), port)
    return RunningApi(f"http://127.0.0.1:{port}"), stop


@pytest.fixture(scope="module")
def proxy_api(api, destination):
    """The api the proxy tests call: private destinations allowed (loopback), 2 s for the destination."""
    running, stop = _serve(destination, proxy_timeout_seconds=2.0, allow_private_destinations=True)
    yield running
    stop()


@pytest.fixture(scope="module")
def strict_api(api, destination):
    """An api refusing private destinations, as deployed by default."""
    running, stop = _serve(destination, allow_private_destinations=False)
    yield running
    stop()


@pytest.fixture
def tenant(proxy_api):
    return make_tenant(proxy_api)


@pytest.fixture
def other_tenant(proxy_api):
    return make_tenant(proxy_api, name="other")


@pytest.fixture
def upstream(destination, monkeypatch):
    """The destination, its names resolvable, its record emptied."""
    resolve_names(monkeypatch)
    destination.received.clear()
    return destination


def _card(tenant) -> str:
    answer = tenant.client.post("/tokens", {"type": "card", "data": CARD})
    assert answer.status == 201, answer
    return answer.json["id"]


def _proxy(tenant, upstream, **fields) -> dict:
    body = {"name": "charges", "destination_url": upstream.base() + "/v1/", **fields}
    answer = tenant.client.post("/proxies", body)
    assert answer.status == 201, answer
    return answer.json


def _proxy_error(answer, status: int) -> dict:
    assert answer.status == status, answer
    assert STATUS not in answer.headers
    error = answer.json["proxy_error"]
    assert set(error) == {"errors", "title", "status", "detail"} and error["status"] == status
    return error


def test_ephemeral_proxy_forwards_and_detokenizes(tenant, upstream):
    card = _card(tenant)
    body = {
        "number": f"{{{{ {card} | json: '$.number' }}}}",
        "last4": f"{{{{ {card} | json: '$.number' | last4 }}}}",
        "month": f"{{{{ {card} | json: '$.expiration_month' }}}}",
        "plain": "kept",
    }
    answer = tenant.client.post(
        "/proxy/charges/%3Aa?amount=10&currency=eur",
        raw=json.dumps(body)
        .replace(f"\"{{{{ {card} | json: '$.expiration_month' }}}}\"", f"{{{{ {card} | json: '$.expiration_month' }}}}")
        .encode(),
        headers={
            URL: upstream.base() + "/base//",
            "Authorization": "Bearer dest-secret",
            "TS-PROXY-KEEP-ALIVE": "timeout=5",
            "TS-PROXY-CONNECTION": "keep-alive",
            "TS-ENCRYPTED": "x",
            "X-Custom": "1",
            "Proxy-Authorization": "Basic x",
        },
    )
    assert answer.status == 201, answer
    assert answer.headers[STATUS] == "201" and answer.headers["X-Upstream"] == "yes"
    assert answer.json == {"ok": True}
    [seen] = upstream.received
    assert seen.method == "POST" and seen.path == "/base/charges/%3Aa?amount=10&currency=eur"
    assert seen.json == {"number": CARD["number"], "last4": "4242", "month": 12, "plain": "kept"}
    assert seen.header("Authorization") == "Bearer dest-secret" and seen.header("X-Custom") == "1"
    assert seen.header("Keep-Alive") == "timeout=5" and seen.header("Connection") == "keep-alive"
    assert seen.header("Proxy-Authorization") is None  # hop-by-hop
    assert not [name for name, _ in seen.headers if name.upper().startswith("TS-")]
    assert tenant.api_key not in json.dumps(seen.headers)
    with session_scope() as session:
        used = session.exec(select(TokenActivity).where(TokenActivity.tenant_id == tenant.id)).all()
    assert card in {row.token_id for row in used}
    logs = tenant.client.get("/logs?entity_type=proxy").json["data"]
    assert logs[0]["operation"] == "invoke" and logs[0]["entity_id"] == "ephemeral"
    assert CARD["number"] not in json.dumps(logs)


def test_every_method_and_the_bare_path(tenant, upstream):
    for method in ("GET", "PUT", "PATCH", "DELETE", "POST"):
        answer = tenant.client.request(method, "/proxy?q=1", headers={URL: upstream.base()})
        assert answer.status == 201 and answer.headers[STATUS] == "201", answer
    assert [(s.method, s.path) for s in upstream.received] == [
        (m, "/?q=1") for m in ("GET", "PUT", "PATCH", "DELETE", "POST")
    ]


def test_destination_answers_are_returned_unchanged(tenant, upstream):
    answer = tenant.client.post("/proxy/status/402", {"a": 1}, headers={URL: upstream.base()})
    assert answer.status == 402 and answer.headers[STATUS] == "402"
    assert answer.json == {"error": "declined"}
    answer = tenant.client.get("/proxy/redirect", headers={URL: upstream.base()})
    assert answer.status == 302 and answer.headers["Location"] == upstream.location
    assert [s.path for s in upstream.received] == ["/status/402", "/redirect"]  # the redirect is not followed


def test_invalid_destinations(tenant, strict_api, upstream):
    for base, where in (
        ("", f"headers.{URL}"),
        (f"http://{DEST}:{upstream.port}", f"headers.{URL}"),
        (f"https://127.0.0.1:{upstream.port}", f"headers.{URL}"),
        (f"https://[::1]:{upstream.port}", f"headers.{URL}"),
        ("https://nowhere.invalid", "destination"),
    ):
        error = _proxy_error(tenant.client.get("/proxy", headers={URL: base} if base else {}), 400)
        assert where in error["errors"], error
    strict = strict_api.client(tenant.api_key)
    for name in (DEST, "internal.tessera.test", "metadata.tessera.test"):
        error = _proxy_error(strict.get("/proxy/x", headers={URL: upstream.base(name)}), 400)
        assert "not public" in error["detail"]
    assert upstream.received == []


def test_a_local_https_server_by_its_one_label_name(tenant, strict_api, upstream):
    # the machine resolves localhost itself; the test CA (TESSERA_PROXY_CA_BUNDLE) makes its certificate trusted
    answer = tenant.client.get("/proxy/ping?a=1", headers={URL: upstream.base(LOCAL)})
    assert answer.status == 201, answer
    proxy = _proxy(tenant, upstream, name="local", destination_url=upstream.base(LOCAL) + "/v1/")
    assert proxy["destination_url"] == upstream.base(LOCAL) + "/v1"
    assert tenant.client.get("/proxy/charges", headers={KEY: proxy["key"]}).status == 201
    assert [s.path for s in upstream.received] == ["/ping?a=1", "/v1/charges"]
    # refused on the resolved address where private destinations are not allowed
    error = _proxy_error(strict_api.client(tenant.api_key).get("/proxy/x", headers={URL: upstream.base(LOCAL)}), 400)
    assert "127.0.0.1 is not public" in error["detail"]
    assert len(upstream.received) == 2


def test_tails_that_climb_out_of_the_base_path_are_refused(tenant, upstream):
    proxy = _proxy(tenant, upstream, name="base", destination_url=upstream.base() + "/tenant-a/")
    for tail in ("/%2F..%2F..%2Fadmin", "/..;/x", "/%252e%252e/x", "/v1/%2e%2e/admin", "/a%5Cb"):
        for headers in ({KEY: proxy["key"]}, {URL: upstream.base() + "/tenant-a"}):
            error = _proxy_error(tenant.client.get("/proxy" + tail, headers=headers), 400)
            assert list(error["errors"]) == ["path"], (tail, error)
    assert upstream.received == []
    assert tenant.client.get("/proxy/v1/a..b;x=1", headers={KEY: proxy["key"]}).status == 201
    assert [s.path for s in upstream.received] == ["/tenant-a/v1/a..b;x=1"]


def test_timeout_is_408(tenant, upstream):
    error = _proxy_error(tenant.client.get("/proxy/slow", headers={URL: upstream.base()}), 408)
    assert error["errors"] == {"destination": ["The destination did not answer within 2 seconds."]}


def test_untrusted_destination_certificate_is_502(api, tenant, upstream):
    untrusting = api.client(tenant.api_key)  # the default api: no extra CA bundle
    error = _proxy_error(untrusting.get("/proxy", headers={URL: upstream.base()}), 502)
    assert "TLS certificate verification failed" in error["detail"]
    assert upstream.received == []


def test_detokenization_rights_and_limits(tenant, upstream):
    card = _card(tenant)
    plain = app_with_permissions(tenant, ["token:pci:use:proxy"])
    error = _proxy_error(plain.post("/proxy", {"n": f"{{{{ {card} }}}}"}, headers={URL: upstream.base()}), 403)
    assert "proxy:invoke" in error["detail"]
    assert plain.post("/proxy", {"n": "no expression"}, headers={URL: upstream.base()}).status == 201
    no_use = app_with_permissions(tenant, ["proxy:invoke"])
    error = _proxy_error(no_use.post("/proxy", {"n": f"{{{{ {card} }}}}"}, headers={URL: upstream.base()}), 403)
    assert "token:pci:use:proxy" in error["detail"]
    legacy = app_with_permissions(tenant, ["proxy:invoke", "token:use"])
    token = tenant.client.post("/tokens", {"type": "token", "data": "general"}).json["id"]
    assert legacy.post("/proxy", {"n": f"{{{{ {token} }}}}"}, headers={URL: upstream.base()}).status == 201
    error = _proxy_error(tenant.client.post("/proxy", {"n": "{{ nope-1 }}"}, headers={URL: upstream.base()}), 400)
    assert "nope-1" in error["detail"]
    error = _proxy_error(tenant.client.post("/proxy", {"n": "{{ x | nofilter }}"}, headers={URL: upstream.base()}), 400)
    assert error["title"] == "Invalid detokenization expression"
    ids = [tenant.client.post("/tokens", {"type": "token", "data": str(i)}).json["id"] for i in range(21)]
    twenty = {str(i): f"{{{{ {token_id} }}}}" for i, token_id in enumerate(ids[:20])}
    assert tenant.client.post("/proxy", twenty, headers={URL: upstream.base()}).status == 201
    assert upstream.received[-1].json == {str(i): str(i) for i in range(20)}
    error = _proxy_error(
        tenant.client.post("/proxy", {**twenty, "x": f"{{{{ {ids[20]} }}}}"}, headers={URL: upstream.base()}), 400
    )
    assert "at most 20 tokens" in error["detail"]
    assert all(CARD["number"] not in json.dumps(s.headers) for s in upstream.received)


def test_authentication_of_the_ephemeral_proxy(api, upstream):
    anonymous = api.client()
    assert _proxy_error(anonymous.get("/proxy", headers={URL: upstream.base()}), 401)
    assert _proxy_error(anonymous.get("/proxy", headers={URL: upstream.base(), API_KEY: "key_nope"}), 401)
    assert upstream.received == []


def test_disable_ephemeral_proxy(tenant, upstream):
    proxy = _proxy(tenant, upstream)
    answer = tenant.client.put("/tenants/self", {"name": "acme", "settings": {"disable_ephemeral_proxy": "true"}})
    assert answer.status == 200, answer
    from domain.tenancy.auth import caller_cache

    caller_cache.clear()
    error = _proxy_error(tenant.client.get("/proxy", headers={URL: upstream.base()}), 403)
    assert error["title"] == "Ephemeral proxies are disabled"
    assert tenant.client.get("/proxy", headers={KEY: proxy["key"]}).status == 201
    assert len(upstream.received) == 1


def test_pre_configured_proxy_by_header_and_by_query(tenant, other_tenant, upstream):
    proxy = _proxy(tenant, upstream)
    answer = tenant.client.post(
        "/proxy/charges?a=1", {"x": 1}, headers={KEY: proxy["key"], URL: "https://ignored.example.com"}
    )
    assert answer.status == 201, answer
    answer = tenant.client.get(f"/proxy/charges?ts-proxy-key={proxy['key']}&a=2")
    assert answer.status == 201, answer
    answer = tenant.client.get(f"/proxy?TS-PROXY-KEY={proxy['key']}")
    assert answer.status == 201, answer
    assert [s.path for s in upstream.received] == ["/v1/charges?a=1", "/v1/charges?a=2", "/v1"]
    assert proxy["key"] not in json.dumps([s.headers for s in upstream.received])
    logs = tenant.client.get(f"/logs?entity_type=proxy&entity_id={proxy['id']}").json["data"]
    assert [log["operation"] for log in logs].count("invoke") == 3
    _proxy_error(tenant.client.get("/proxy", headers={KEY: "pxk_unknown"}), 404)
    _proxy_error(other_tenant.client.get("/proxy", headers={KEY: proxy["key"]}), 404)
    _proxy_error(tenant.client.with_key(None).get("/proxy", headers={KEY: proxy["key"]}), 401)


def test_anonymous_proxy_uses_its_application(tenant, limited, upstream):
    card = _card(tenant)
    detokenizer = tenant.client.post(
        "/applications", {"name": "proxy app", "type": "server_to_server", "permissions": USE}
    ).json
    proxy = _proxy(tenant, upstream, require_auth=False, application={"id": detokenizer["id"]})
    anonymous = tenant.client.with_key(None)
    answer = anonymous.post("/proxy", {"n": f"{{{{ {card} | json: '$.number' }}}}"}, headers={KEY: proxy["key"]})
    assert answer.status == 201, answer
    assert upstream.received[-1].json == {"n": CARD["number"]}
    bare = _proxy(tenant, upstream, name="no app", require_auth=False)
    assert anonymous.post("/proxy", {"n": "plain"}, headers={KEY: bare["key"]}).status == 201
    error = _proxy_error(anonymous.post("/proxy", {"n": f"{{{{ {card} }}}}"}, headers={KEY: bare["key"]}), 403)
    assert "proxy:invoke" in error["detail"]
    # a caller sending a key is that caller, even on an anonymous proxy
    reader = limited(tenant, ["token:pci:read:low"])
    _proxy_error(reader.post("/proxy", {"n": f"{{{{ {card} }}}}"}, headers={KEY: proxy["key"]}), 403)


def test_transforms(tenant, upstream):
    proxy = _proxy(
        tenant,
        upstream,
        request_transforms=[
            {"type": "append_header", "location": "X-Merchant", "value": "m-1"},
            {"type": "append_json", "location": "$.meta.source", "value": "proxy"},
            {"type": "tokenize", "location": "$.secret", "token": {"type": "token"}},
        ],
        response_transforms=[
            {"type": "mask", "matcher": "jsonpath", "expression": "$.card.number"},
            {"type": "append_header", "location": "X-Masked", "value": "1"},
        ],
    )
    answer = tenant.client.post("/proxy/answer", {"secret": "s3cret"}, headers={KEY: proxy["key"]})
    assert answer.status == 200, answer
    assert answer.json == {"card": {"number": "*" * 16}, "note": "x"} and answer.headers["X-Masked"] == "1"
    seen = upstream.received[-1]
    assert seen.header("X-Merchant") == "m-1" and seen.json["meta"] == {"source": "proxy"}
    token_id = seen.json["secret"]
    assert token_id != "s3cret" and tenant.client.get(f"/tokens/{token_id}").json["data"] == "s3cret"
    answer = tenant.client.post("/proxy/status/400", {"secret": "s"}, headers={KEY: proxy["key"]})
    assert answer.status == 400 and "X-Masked" not in answer.headers  # response transforms only on 2xx


def test_code_transforms_run_in_a_worker_with_the_proxy_configuration(tenant, upstream):
    rewrite = (
        "module.exports = async (req) => ({ body: {...req.args.body, merchant: req.configuration.MERCHANT}, "
        "headers: {...req.args.headers, 'X-Code': 'yes'} });"
    )
    masked = (
        "module.exports = async (req) => ({ body: {...req.args.body, "
        "card: {number: req.args.body.card.number.replace(/[0-9]/g, '#')}} });"
    )
    proxy = _proxy(
        tenant,
        upstream,
        name="code",
        configuration={"MERCHANT": "m-42"},
        request_transforms=[{"type": "code", "code": rewrite, "runtime": {"image": "node22"}}],
        response_transforms=[{"type": "code", "code": masked, "runtime": {"image": "node22"}}],
    )
    answer = tenant.client.post("/proxy/answer", {"a": 1}, headers={KEY: proxy["key"]})
    assert answer.status == 200, answer
    seen = upstream.received[-1]
    assert seen.json == {"a": 1, "merchant": "m-42"} and seen.header("X-Code") == "yes"
    assert answer.json["card"] == {"number": "#" * 16}  # the response side ran too
    thrower = _proxy(
        tenant,
        upstream,
        name="thrower",
        request_transforms=[
            {
                "type": "code",
                "code": "const { BadRequestError } = require('@tessera/reactor');"
                "module.exports = async () => { throw new BadRequestError('no way'); };",
                "runtime": {"image": "node22"},
            }
        ],
    )
    error = _proxy_error(tenant.client.post("/proxy", {"a": 1}, headers={KEY: thrower["key"]}), 400)
    assert "no way" in error["detail"]


def test_new_code_transforms_need_a_node_runtime_image(tenant, upstream):
    code = "module.exports = async (req) => req.args;"
    base = {"name": "code", "destination_url": upstream.base()}
    for transform, where in (
        ({"type": "code", "code": code}, "request_transforms[0].runtime.image"),
        ({"type": "code", "code": code, "runtime": {}}, "request_transforms[0].runtime.image"),
        ({"type": "code", "code": code, "runtime": {"image": "node-svc"}}, "request_transforms[0].runtime.image"),
    ):
        answer = tenant.client.post("/proxies", {**base, "request_transforms": [transform]})
        assert answer.status == 400, answer
        assert list(answer.json["errors"]) == [where] and "October 5, 2026" in answer.json["errors"][where][0]
    # the deprecated singular form without a type is a code transform, under the same rule
    for side in ("request", "response"):
        answer = tenant.client.post("/proxies", {**base, f"{side}_transform": {"code": code}})
        assert answer.status == 400, answer
        [message] = answer.json["errors"][f"{side}_transform.runtime.image"]
        assert "Node runtime image is required" in message and "discriminator" not in json.dumps(answer.json)
    answer = tenant.client.post(
        "/proxies", {**base, "request_transform": {"code": code, "runtime": {"image": "node22"}}}
    )
    assert answer.status == 201 and answer.headers["Deprecation"], answer
    assert answer.json["request_transforms"] == [{"type": "code", "code": code, "runtime": {"image": "node22"}}]
    # a proxy stored before the rule keeps its code transform through a merge patch of other fields
    legacy = _proxy(tenant, upstream, name="legacy")
    with session_scope() as session:
        session.get(Proxy, uuid.UUID(legacy["id"])).request_transforms = [{"type": "code", "code": code}]
    patched = tenant.client.patch(
        f"/proxies/{legacy['id']}", {"name": "renamed"}, content_type="application/merge-patch+json"
    )
    assert patched.status == 200 and patched.json["request_transforms"] == [{"type": "code", "code": code}], patched
    added = tenant.client.patch(
        f"/proxies/{legacy['id']}",
        {"response_transforms": [{"type": "code", "code": "x"}]},
        content_type="application/merge-patch+json",
    )
    assert added.status == 400 and list(added.json["errors"]) == ["response_transforms[0].runtime.image"], added


def test_proxies_crud_pagination_and_merge_patch(tenant, limited, upstream):
    answer = tenant.client.post(
        "/proxies",
        {
            "name": "alpha one",
            "destination_url": upstream.base() + "/v1/",
            "configuration": {"user": "u", "password": "p"},
            "request_transform": {"type": "append_text", "value": "!"},
        },
    )
    assert answer.status == 201 and answer.headers["Deprecation"] == "@1759881600", answer
    created = answer.json
    assert created["key"].startswith("pxk_") and created["request_transforms"] == [
        {"type": "append_text", "value": "!"}
    ]
    assert created["destination_url"] == upstream.base() + "/v1" and created["require_auth"] is True
    _proxy(tenant, upstream, name="beta")
    _proxy(tenant, upstream, name="Alpha two")
    got = tenant.client.get(f"/proxies/{created['id']}")
    assert got.status == 200 and "key" not in got.json and got.json["configuration"] == {"user": "u", "password": "p"}
    page = tenant.client.get("/proxies?size=2").json
    assert len(page["data"]) == 2 and page["pagination"]["next"]
    rest = tenant.client.get(f"/proxies?size=2&start={page['pagination']['next']}").json
    assert len(rest["data"]) == 1 and "next" not in rest["pagination"]
    assert {p["name"] for p in page["data"] + rest["data"]} == {"alpha one", "beta", "Alpha two"}
    assert {p["name"] for p in tenant.client.get("/proxies?name=ALPHA").json["data"]} == {"alpha one", "Alpha two"}
    patched = tenant.client.patch(
        f"/proxies/{created['id']}",
        {"configuration": {"password": None, "extra": "e"}, "require_auth": False},
        content_type="application/merge-patch+json",
    )
    assert patched.status == 200 and "Deprecation" not in patched.headers, patched
    assert patched.json["configuration"] == {"user": "u", "extra": "e"} and patched.json["require_auth"] is False
    assert patched.json["name"] == "alpha one" and patched.json["request_transforms"] == created["request_transforms"]
    assert tenant.client.patch(f"/proxies/{created['id']}", {"name": "x"}).status == 415
    bad = tenant.client.patch(
        f"/proxies/{created['id']}",
        {"destination_url": "http://a.example.com"},
        content_type="application/merge-patch+json",
    )
    assert bad.status == 400 and "destination_url" in bad.json["errors"]
    replaced = tenant.client.put(f"/proxies/{created['id']}", {"name": "gamma", "destination_url": upstream.base()})
    assert replaced.status == 200 and replaced.json["configuration"] == {} and replaced.json["require_auth"] is True
    assert replaced.json["request_transforms"] == []
    shut = tenant.client.post("/proxies", {"name": "r", "destination_url": upstream.base(), "request_reactor_id": "x"})
    assert shut.status == 400 and "request_reactor_id" in shut.json["errors"]
    mask = {"type": "mask", "matcher": "regex", "expression": "("}
    bad = tenant.client.post(
        "/proxies", {"name": "r", "destination_url": upstream.base(), "request_transforms": [mask]}
    )
    assert bad.status == 400 and list(bad.json["errors"]) == ["request_transforms[0].expression"]
    reader = limited(tenant, ["proxy:read"])
    assert reader.get(f"/proxies/{created['id']}").status == 200
    assert reader.post("/proxies", {"name": "n", "destination_url": upstream.base()}).status == 403
    assert reader.delete(f"/proxies/{created['id']}").status == 403
    assert tenant.client.delete(f"/proxies/{created['id']}").status == 204
    assert tenant.client.get(f"/proxies/{created['id']}").status == 404
    assert tenant.client.get(f"/proxies/{uuid.uuid4()}").status == 404
    _proxy_error(tenant.client.get("/proxy", headers={KEY: created["key"]}), 404)


def test_openapi_describes_the_proxy(api):
    document = api.client().get("/openapi.json").json
    assert set(document["paths"]["/proxy"]) == {"get", "post", "put", "patch", "delete"}
    assert set(document["paths"]["/proxy/{tail}"]) == {"get", "post", "put", "patch", "delete"}
    assert set(document["paths"]["/proxies"]) == {"get", "post"}
    assert set(document["paths"]["/proxies/{id}"]) == {"get", "put", "patch", "delete"}
    error = document["paths"]["/proxy"]["post"]["responses"]["408"]["content"]["application/problem+json"]
    proxy_error, problem = error["schema"]["anyOf"]
    assert "proxy_error" in proxy_error["properties"] and problem == {"$ref": "#/components/schemas/Problem"}


def test_encrypted_payloads_over_http(tenant, upstream):
    from tests.proxy.conftest import Vault
    from tests.proxy.test_detokenize import _encrypted

    vault = Vault(tenant.id, tenant.application_id)
    single = _encrypted(vault, {"type": "card", "data": CARD})
    body = {"pan": '{{ encrypted | json: "$.data.number" }}'}
    answer = tenant.client.post("/proxy", body, headers={URL: upstream.base(), "TS-ENCRYPTED": single})
    assert answer.status == 201, answer
    multiple = _encrypted(vault, {"first": {"type": "card", "data": CARD}})
    body = {"pan": '{{ encrypted | json: "$.first.data.number" | last4 }}'}
    answer = tenant.client.post("/proxy", body, headers={URL: upstream.base(), "TS-ENCRYPTED": multiple})
    assert answer.status == 201, answer
    assert [s.json for s in upstream.received] == [{"pan": CARD["number"]}, {"pan": "4242"}]
    assert all(s.header("TS-ENCRYPTED") is None for s in upstream.received)
    error = _proxy_error(tenant.client.post("/proxy", body, headers={URL: upstream.base()}), 400)
    assert "encrypted" in error["errors"]


def test_destinations_below_tls_1_2_are_refused(tenant, upstream, destination, tmp_path):
    """A destination speaking at most TLS 1.1 (which an old client reaches) is refused: 502."""
    cert, key = destination.ca.parent / "server.pem", destination.ca.parent / "server-key.pem"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the old versions are deprecated: that is the point
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        old.load_cert_chain(cert, key)
        old.minimum_version, old.maximum_version = ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1
        old.set_ciphers("DEFAULT:@SECLEVEL=0")
        seen = []

        async def handler(request):
            seen.append(request.path)
            return web.Response(status=201)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        port = free_port()
        stop = serve_in_thread(lambda: app, port, ssl_context=old)
        try:
            client = ssl.create_default_context(cafile=str(destination.ca))
            client.minimum_version = ssl.TLSVersion.TLSv1
            client.set_ciphers("DEFAULT:@SECLEVEL=0")
            with (
                socket.create_connection(("127.0.0.1", port)) as raw,
                client.wrap_socket(raw, server_hostname=DEST) as tls,
            ):
                assert tls.version() == "TLSv1.1"
            # the proxy offers TLS 1.2 at least: the handshake fails (the server resets it) and nothing is sent
            _proxy_error(tenant.client.get("/proxy", headers={URL: f"https://{DEST}:{port}"}), 502)
            assert seen == []
        finally:
            stop()


def test_a_change_of_a_proxy_applies_to_the_next_invocation(tenant, proxy_api, upstream):
    """Invocation targets are kept by key for a while; an update or a delete made here forgets them."""
    proxy = _proxy(tenant, upstream)
    anonymous = proxy_api.client()
    assert tenant.client.post("/proxy/a", {"x": 1}, headers={KEY: proxy["key"]}).status == 201
    _proxy_error(anonymous.post("/proxy/a", {"x": 1}, headers={KEY: proxy["key"]}), 401)
    patched = tenant.client.patch(
        f"/proxies/{proxy['id']}",
        {"destination_url": upstream.base() + "/v2", "require_auth": False},
        content_type="application/merge-patch+json",
    )
    assert patched.status == 200, patched
    assert anonymous.post("/proxy/b", {"x": 2}, headers={KEY: proxy["key"]}).status == 201
    replaced = tenant.client.put(
        f"/proxies/{proxy['id']}",
        {
            "name": "charges",
            "destination_url": upstream.base(),
            "response_transforms": [{"type": "append_header", "location": "X-Seen", "value": "yes"}],
        },
    )
    assert replaced.status == 200, replaced
    answer = tenant.client.post("/proxy/c", {"x": 3}, headers={KEY: proxy["key"]})
    assert answer.status == 201 and answer.headers["X-Seen"] == "yes", answer
    assert [s.path for s in upstream.received] == ["/v1/a", "/v2/b", "/c"]
    assert tenant.client.delete(f"/proxies/{proxy['id']}").status == 204
    _proxy_error(tenant.client.post("/proxy/d", {"x": 4}, headers={KEY: proxy["key"]}), 404)
    assert len(upstream.received) == 3


def test_invocations_reuse_the_connection_to_a_destination(tenant, upstream):
    proxy = _proxy(tenant, upstream)
    for n in range(3):
        assert tenant.client.post(f"/proxy/keep-{n}", {"n": n}, headers={KEY: proxy["key"]}).status == 201
        assert tenant.client.post(f"/proxy/v1/keep-{n}", {"n": n}, headers={URL: upstream.base()}).status == 201
    peers = {seen.peer for seen in upstream.received}
    assert len(upstream.received) == 6 and None not in peers
    assert len(peers) == 1  # one kept-alive connection, requests one after the other
