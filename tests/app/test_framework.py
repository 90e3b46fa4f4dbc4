"""The request pipeline every endpoint shares: authentication, permissions, problems, trace ids,
content types and sizes, rate limits (spec, core document sections 5, 7, 8 and 9) and the OpenAPI
description served at ``GET /openapi.json``."""

from __future__ import annotations

import importlib
import pkgutil
import re
import time
import uuid

import pytest

from tests.conftest import REDIS_PREFIX, TEST_REDIS_URL, free_port, serve_in_thread
from tests.helpers import PROBLEM, ApiClient, assert_problem

pytestmark = pytest.mark.api


# ---- authentication and permissions ---------------------------------------------------------------


def test_missing_key_is_401(api, tenant):
    body = assert_problem(api.client().get("/applications"), 401)
    assert f"{api.prefix}-API-KEY" in body["detail"]


@pytest.mark.parametrize("key", ["key_not-a-real-key", "x", "key_" + "a" * 300])
def test_invalid_key_is_401(api, tenant, key):
    assert_problem(api.client(key).get("/applications"), 401)


def test_valid_key_passes(api, tenant):
    answer = tenant.client.get("/applications")
    assert answer.status == 200, answer


def test_x_api_key_header_is_shut_down(api, tenant):
    """The X-API-KEY header (shut down March 9, 2022) is refused even with a valid key."""
    answer = api.client().get("/applications", headers={"X-API-KEY": tenant.api_key})
    body = assert_problem(answer, 401)
    assert f"{api.prefix}-API-KEY" in body["detail"]
    assert "X-API-KEY" in body["detail"]


def test_missing_permission_is_403_naming_it(api, tenant, limited):
    client = limited(tenant, ["log:read"])
    body = assert_problem(client.get("/applications"), 403)
    assert "application:read" in body["detail"]
    body = assert_problem(client.post("/applications", {"name": "n", "type": "public"}), 403)
    assert "application:create" in body["detail"]
    # the permission it does hold works
    assert client.get("/logs").status == 200


def test_authentication_comes_before_validation(api, tenant):
    """Without a key a malformed body still answers 401: nothing is parsed for strangers."""
    answer = api.client().post("/applications", raw=b"{not json")
    assert_problem(answer, 401)


# ---- routing ---------------------------------------------------------------------------------------


def test_unknown_route_is_404_problem(api, tenant):
    body = assert_problem(tenant.client.get("/no-such-thing"), 404)
    assert body["instance"] == "/no-such-thing"
    assert_problem(api.client().delete("/no/such/thing"), 404)


def test_wrong_method_is_405_with_allow(api, tenant):
    answer = tenant.client.patch("/applications", {"name": "x"})
    assert_problem(answer, 405)
    allowed = {m.strip() for m in answer.headers["Allow"].split(",")}
    assert {"GET", "POST"} <= allowed


# ---- bodies ------------------------------------------------------------------------------------------


def test_oversized_body_is_413(api, tenant):
    big = b'{"name": "' + b"a" * (1_048_576 + 10) + b'", "type": "public"}'
    assert_problem(tenant.client.post("/applications", raw=big), 413)


def test_non_json_content_type_is_415(api, tenant):
    answer = tenant.client.post("/applications", raw=b'{"name": "n", "type": "public"}', content_type="text/plain")
    assert_problem(answer, 415)
    answer = tenant.client.put("/tenants/self", raw=b"name=x", content_type="application/x-www-form-urlencoded")
    assert_problem(answer, 415)


def test_json_with_charset_is_accepted(api, tenant):
    answer = tenant.client.post(
        "/applications", {"name": "n", "type": "public"}, content_type="application/json; charset=utf-8"
    )
    assert answer.status == 201, answer


@pytest.mark.parametrize("raw", [b"{not json", b'{"name": "a",}', b"\xff\xfe", b"", b"   "])
def test_malformed_json_is_400(api, tenant, raw):
    assert_problem(tenant.client.post("/applications", raw=raw), 400)


@pytest.mark.parametrize(
    "raw, where",
    [
        (b'{"amount": 1e400}', "amount"),
        (b'{"a": [1, 2E+309]}', "a[1]"),
        (b'{"n": ' + b"9" * 309 + b"e0}", "n"),
        (b'{"n": ' + b"9" * 400 + b".5}", "n"),
        (b"-1e999", "body"),
    ],
)
def test_a_number_too_large_for_a_double_is_400_naming_where(raw, where):
    """Stored JSON has no Infinity: a literal that overflows a double is refused, by its path."""
    from app.api import parse_json
    from infra.errors import Problem

    with pytest.raises(Problem) as refused:
        parse_json(raw)
    assert refused.value.status == 400
    assert refused.value.errors == {where: ["This number is too large."]}


@pytest.mark.parametrize(
    "raw", [b'{"a": 1e308, "e": "e999"}', b'{"n": ' + b"9" * 308 + b".5}", b'{"n": 1e-999}', b"9" * 400]
)
def test_a_large_number_that_fits_a_double_is_parsed(raw):
    from app.api import parse_json

    assert isinstance(parse_json(raw), dict | int)


def test_unknown_property_is_400_naming_it(api, tenant):
    answer = tenant.client.post("/applications", {"name": "n", "type": "public", "colour": "red"})
    body = assert_problem(answer, 400)
    assert list(body["errors"]) == ["colour"]
    assert all(isinstance(m, str) for m in body["errors"]["colour"])


def test_validation_errors_name_each_property(api, tenant):
    answer = tenant.client.post("/applications", {"name": "", "type": "bogus", "permissions": "x"})
    body = assert_problem(answer, 400)
    assert {"name", "type", "permissions"} <= set(body["errors"])


def test_body_of_wrong_json_type_is_400(api, tenant):
    body = assert_problem(tenant.client.post("/applications", [1, 2]), 400)
    assert body["errors"]


# ---- trace ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/applications", {"name": "traced", "type": "public"}),
        ("PUT", "/tenants/self", {"name": "acme"}),
        ("PATCH", "/applications", {"name": "x"}),  # 405, still traced
        ("DELETE", "/applications/00000000-0000-0000-0000-000000000000", None),  # 404, still traced
    ],
)
def test_trace_id_is_echoed_on_writes(api, tenant, method, path, body):
    trace = str(uuid.uuid4())
    header = f"{api.prefix}-TRACE-ID"
    answer = tenant.client.request(method, path, body, headers={header: trace})
    assert answer.status < 500, answer
    assert answer.headers[header] == trace


def test_trace_id_generated_when_absent(api, tenant):
    header = f"{api.prefix}-TRACE-ID"
    first = tenant.client.post("/applications", {"name": "a", "type": "public"})
    second = tenant.client.get("/applications")
    ids = {first.headers[header], second.headers[header]}
    assert len(ids) == 2
    for value in ids:
        uuid.UUID(value)


def test_trace_id_on_reads_is_generated(api, tenant):
    """Clients send trace ids on POST, PUT, PATCH and DELETE; a read gets a fresh one."""
    header = f"{api.prefix}-TRACE-ID"
    sent = str(uuid.uuid4())
    answer = tenant.client.get("/applications", headers={header: sent})
    assert answer.status == 200
    assert answer.headers[header] != sent
    uuid.UUID(answer.headers[header])


def test_trace_id_on_error_answers(api, tenant):
    header = f"{api.prefix}-TRACE-ID"
    for answer in (
        api.client().get("/applications"),  # 401
        tenant.client.get("/nowhere"),  # 404
        tenant.client.post("/applications", raw=b"{"),  # 400
    ):
        assert answer.status >= 400
        uuid.UUID(answer.headers[header])


# the last two hold a card number: a trace id is logged, so a client cannot smuggle one into the logs
@pytest.mark.parametrize(
    "bad", ["has space", "x" * 65, "semi;colon", "<script>", "4242424242424242", "t-4000000000000002"]
)
def test_invalid_trace_id_is_400(api, tenant, bad):
    header = f"{api.prefix}-TRACE-ID"
    answer = tenant.client.post("/applications", {"name": "a", "type": "public"}, headers={header: bad})
    body = assert_problem(answer, 400)
    assert header in body["detail"]
    assert answer.headers[header] != bad
    # nothing was created
    names = [a["name"] for a in tenant.client.get("/applications").json["data"]]
    assert "a" not in names


# ---- every error is a problem ------------------------------------------------------------------------


def test_error_answers_are_problems(api, tenant, limited):
    reader = limited(tenant, ["log:read"])
    cases = [
        (api.client().get("/tenants/self"), 401),
        (api.client("key_bogus").get("/tenants/self"), 401),
        (reader.get("/tenants/self"), 403),
        (tenant.client.get(f"/applications/{uuid.uuid4()}"), 404),
        (tenant.client.get("/applications/not-a-uuid"), 404),
        (tenant.client.post("/applications/x/regenerate"), 410),
        (tenant.client.get("/applications?size=1000"), 400),
        (tenant.client.put("/tenants/self", {"settings": {}}), 400),
    ]
    for answer, status in cases:
        assert_problem(answer, status)


# ---- rate limits ---------------------------------------------------------------------------------------


def _limited_server(database, **overrides):
    from app.main import init_app
    from config.settings import Settings

    settings = Settings(rate_limit_enabled=True, rate_limit_window_seconds=3600, **overrides)
    port = free_port()
    stop = serve_in_thread(lambda: init_app(settings), port)
    return ApiClient(f"http://127.0.0.1:{port}", None, settings.header_prefix), stop


RATE_KEYS = f"{REDIS_PREFIX}tessera:rl:*"


@pytest.fixture
def clear_rate_limits(redis_flushed):
    def clear():
        for key in redis_flushed.scan_iter(RATE_KEYS):
            redis_flushed.delete(key)

    clear()
    yield redis_flushed
    clear()


BACKENDS = ["redis", "in-process"]


def _redis_url(backend: str) -> str | None:
    return TEST_REDIS_URL if backend == "redis" else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_limit_blocks_for_block_seconds(database, clear_rate_limits, backend):
    client, stop = _limited_server(
        database, redis_url=_redis_url(backend), rate_limit_global=5, rate_limit_block_seconds=2
    )
    try:
        for _ in range(5):
            assert client.get("/status").status == 200
        blocked_at = time.monotonic()
        answer = client.get("/status")
        body = assert_problem(answer, 429)
        assert answer.headers["Retry-After"] == "2"
        assert body["detail"]
        # every request meanwhile answers 429, also on other paths
        time.sleep(0.8)
        answer = client.get("/openapi.json")
        assert_problem(answer, 429)
        assert 1 <= int(answer.headers["Retry-After"]) <= 2
        # the block ends after rate_limit_block_seconds and the client starts afresh
        time.sleep(max(0.0, blocked_at + 2.3 - time.monotonic()))
        for _ in range(5):
            answer = client.get("/status")
            assert answer.status == 200, answer
        assert client.get("/status").status == 429
        if backend == "redis":
            assert list(clear_rate_limits.scan_iter(RATE_KEYS)), "the counters live in Redis"
        else:
            assert not list(clear_rate_limits.scan_iter(RATE_KEYS))
    finally:
        stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_create_limit_is_its_own_rule(database, clear_rate_limits, backend):
    client, stop = _limited_server(
        database,
        redis_url=_redis_url(backend),
        rate_limit_global=1000,
        rate_limit_token_create=3,
        rate_limit_block_seconds=1,
    )
    try:
        for _ in range(3):
            assert client.post("/tokenize", {"x": "y"}).status != 429
        answer = client.post("/tokenize", {"x": "y"})
        assert_problem(answer, 429)
        assert answer.headers["Retry-After"] == "1"
        assert client.post("/tokens", {"x": "y"}).status == 429  # same rule
        # other endpoints are not blocked by the token-create rule
        assert client.get("/status").status == 200
        time.sleep(1.3)
        assert client.post("/tokenize", {"x": "y"}).status != 429
    finally:
        stop()


def test_redis_outage_falls_back_to_counting_in_process(database):
    """A Redis that does not answer must not take the API down: the limits still hold, per process."""
    client, stop = _limited_server(
        database,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        rate_limit_global=3,
        rate_limit_block_seconds=1,
    )
    try:
        for _ in range(3):
            answer = client.get("/status")
            assert answer.status == 200, answer
        answer = client.get("/status")
        assert_problem(answer, 429)
        assert answer.headers["Retry-After"] == "1"
    finally:
        stop()


def test_rate_limits_off_by_setting(api, tenant):
    """The session server runs with TESSERA_RATE_LIMIT_ENABLED=false: far past 1000 is fine."""
    statuses = {api.client().get("/status").status for _ in range(30)}
    assert statuses == {200}


# ---- OpenAPI ---------------------------------------------------------------------------------------------


def _declared_routes():
    import app.routes

    routes = []
    for info in pkgutil.iter_modules(app.routes.__path__):
        module = importlib.import_module(f"app.routes.{info.name}")
        registry = getattr(module, "api", None)
        if registry is not None:
            routes += [(info.name, route) for route in registry.routes if route.documented]
    return routes


def test_openapi_describes_every_route(api):
    from app.api import AllOf, AnyOf

    answer = api.client().get("/openapi.json")
    assert answer.status == 200
    assert answer.headers["Content-Type"].startswith("application/json")
    doc = answer.json
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["title"] and doc["info"]["version"]
    scheme = doc["components"]["securitySchemes"]["ApiKey"]
    assert scheme == {"type": "apiKey", "in": "header", "name": f"{api.prefix}-API-KEY"}
    assert "Problem" in doc["components"]["schemas"]

    routes = _declared_routes()
    assert len(routes) > 10
    seen = set()
    for module, route in routes:
        operation = doc["paths"].get(route.path, {}).get(route.method.lower())
        assert operation is not None, f"{route.method} {route.path} ({module}) missing from /openapi.json"
        seen.add((route.path, route.method.lower()))
        assert operation["summary"]
        assert str(route.status) in operation["responses"]
        for name in re.findall(r"{(\w+)}", route.path):
            assert any(p["in"] == "path" and p["name"] == name for p in operation["parameters"])
        if not route.auth:
            assert "security" not in operation, route.path
            continue
        assert operation["security"] == [{"ApiKey": []}]
        assert "401" in operation["responses"]
        stated = operation["x-permission"]
        assert stated.startswith("Permission"), f"{route.method} {route.path}: states no permission: {stated!r}"
        if isinstance(route.permission, str):
            names = [route.permission]
        elif isinstance(route.permission, AnyOf | AllOf):
            names = list(route.permission.names)
        else:
            names = []
        for name in names:
            assert name in stated and name in operation["description"], (route.path, name)
        if route.permission is not None:
            assert "403" in operation["responses"]

    declared = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert declared == seen, "the description has operations that no route declares"
    refs = set(re.findall(r'"\$ref": ?"([^"]+)"', answer.raw.decode()))
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[-1] in doc["components"]["schemas"], f"dangling {ref}"
    operation_ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_openapi_problem_responses(api):
    doc = api.client().get("/openapi.json").json
    create = doc["paths"]["/applications"]["post"]
    assert create["x-permission"] == "Permission: application:create."
    assert "application/json" in create["requestBody"]["content"]
    problem = create["responses"]["400"]["content"][PROBLEM]["schema"]
    assert problem == {"$ref": "#/components/schemas/Problem"}
    assert {"400", "401", "403", "429"} <= set(create["responses"])
    assert doc["paths"]["/applications/{id}/regenerate"]["post"]["deprecated"] is True
    trace = [p for p in create["parameters"] if p["in"] == "header"]
    assert trace and trace[0]["name"] == f"{api.prefix}-TRACE-ID"


# ---- one way to declare an endpoint -----------------------------------------------------------------

#: Handlers that read their request themselves, and why.
_READS_ITS_OWN_BODY = {
    "create_document": "a multipart upload streamed part by part into S3",
    "invoke": "the proxy forwards any body, of any media type, with its expressions rendered",
    "invoke_path": "the proxy forwards any body, of any media type, with its expressions rendered",
}


def test_every_route_declares_its_request_and_response_models():
    """Bodies and queries are models the framework validates (no parser in a handler beside a model
    used only for the description); every JSON answer goes through a response model."""
    import inspect

    for module, route in _declared_routes():
        source = inspect.getsource(route.handler)
        where = f"{route.method} {route.path} ({module})"
        if "call.body" in source or "call.payload" in source:
            assert route.body is not None and route.body_adapter is not None, where
        if route.handler.__name__ not in _READS_ITS_OWN_BODY:
            for hand_parsing in ("read_json(", "json.loads(", "request.read(", "request.post(", "model_validate("):
                assert hand_parsing not in source, f"{where} parses its request by hand ({hand_parsing})"
        assert "request.query" not in source or route.query is not None, f"{where} reads an undeclared query"
        if "call.query" in source:
            assert route.query is not None, where
        if route.status not in (204, 410):
            assert route.response is not None, f"{where} declares no response model"
            if route.response_content_type.endswith("json"):
                assert route.response_adapter is not None, where
        if route.handler.__name__ not in _READS_ITS_OWN_BODY:
            assert "requestBody" not in route.openapi_extra, f"{where}: a body described beside its model"


def test_a_json_answer_is_written_as_its_documented_type_writes_it():
    """``JsonAnswer`` (the answer of ``POST /tokenize``) writes with orjson what the documented
    union's adapter writes: the same bytes for token objects (UUIDs, datetimes in UTC, with an
    offset, without microseconds), nested structures, unicode, control characters and floats; what
    orjson refuses (an integer beyond 64 bits) goes through the adapter."""
    import datetime as dt

    from pydantic import TypeAdapter

    from app.api import JsonAnswer
    from app.routes.tokens import TokenizeOut

    token = {
        "id": "tok-1",
        "tenant_id": uuid.uuid4(),
        "type": "card",
        "data": {"number": "XXXXXXXXXXXX4242", "expiration_month": 12, "expiration_year": 2031},
        "mask": {"number": "{{ data.number | card_mask }}"},
        "containers": ["/pci/high/"],
        "metadata": {"k\u00e9": 'v\u2028\n\t\x01"/'},
        "search_indexes": [],
        "fingerprint": None,
        "fingerprint_expression": "{{ data.number }}",
        "deduplicate_token": None,
        "parent_id": None,
        "created_by": uuid.uuid4(),
        "created_at": dt.datetime(2026, 11, 27, 19, 42, 10, 428465, tzinfo=dt.UTC),
        "modified_by": None,
        "modified_at": dt.datetime(2026, 11, 27, 19, 42, 10, tzinfo=dt.timezone(dt.timedelta(0))),
        "expires_at": dt.datetime(2027, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    }
    masked = {key: value for key, value in token.items() if key != "data"}
    documented = TypeAdapter(TokenizeOut)
    answer = JsonAnswer(TokenizeOut)
    values = [
        token,
        masked,
        "d2cbc1b4-5c3e-40d4-9a5d-8e8f3c1b5a9e",
        None,
        [token, None, "id", [masked]],
        {"card": token, "nested": {"list": [1.5, 1e16, 0.1, -0.0, 12345678901234567890 // 10, True]}},
        {"big": 2**70},
    ]
    for value in values:
        expected = documented.dump_json(documented.validate_python(value), exclude_unset=True, by_alias=True)
        written = answer.dump_json(answer.validate_python(value), exclude_unset=True, by_alias=True)
        assert written == expected, value
    assert b"2026-11-27T19:42:10.428465Z" in answer.dump_json(token)
    assert b'"big":1180591620717411303424' in answer.dump_json({"big": 2**70})


def test_served_answers_fit_the_description(api, tenant):
    """Answers served by the running API validate against the schemas of /openapi.json (each answer is
    serialised through its model; this checks the description says the same)."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    doc = api.client().get("/openapi.json").json
    registry = Registry().with_resource("urn:tessera", Resource.opaque(doc))

    def check(method: str, path: str, template: str, status: int, body=None, **kw):
        answer = tenant.client.request(method, path, body, **kw)
        assert answer.status == status, answer
        content = doc["paths"][template][method.lower()]["responses"][str(status)]["content"]
        pointer = "/".join(
            (
                "",
                "paths",
                template.replace("~", "~0").replace("/", "~1"),
                method.lower(),
                "responses",
                str(status),
                "content",
                next(iter(content)).replace("/", "~1"),
                "schema",
            )
        )
        validator = Draft202012Validator({"$ref": "urn:tessera#" + pointer}, registry=registry)
        errors = list(validator.iter_errors(answer.json))
        assert not errors, (method, path, [e.message for e in errors[:3]])
        return answer.json

    token = check("POST", "/tokens", "/tokens", 201, {"type": "card", "data": {"number": "4242424242424242"}})
    check("POST", "/tokenize", "/tokenize", 201, {"a": {"type": "token", "data": "x"}, "b": ["y", None]})
    check("GET", f"/tokens/{token['id']}", "/tokens/{id}", 200)
    check("GET", "/v2/tokens?size=1", "/v2/tokens", 200)
    check("GET", "/applications", "/applications", 200)
    check("GET", "/logs?size=2", "/logs", 200)
    check("GET", "/webhooks", "/webhooks", 200)
    check("GET", "/tenants/self/members", "/tenants/self/members", 200)
    check("GET", "/tenants/self/invitations", "/tenants/self/invitations", 200)
    check("GET", "/agentic/payment-methods", "/agentic/payment-methods", 200)


def test_the_description_a_user_can_work_from(api):
    """Webhooks with every event type, an example on every operation, no empty schema, a full Problem."""
    from domain.webhooks.events import EVENT_TYPES

    doc = api.client().get("/openapi.json").json
    assert set(doc["webhooks"]) == set(EVENT_TYPES)
    for event_type, entry in doc["webhooks"].items():
        body = entry["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["properties"]["event"]["properties"]["type"] == {"const": event_type}
        assert body["schema"]["properties"]["event"]["properties"]["data"]["properties"]
        assert body["example"]["event"]["type"] == event_type
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            parts = [operation.get("requestBody", {}), *operation["responses"].values()]
            media = [m for part in parts for m in (part.get("content") or {}).values()]
            assert any("example" in m for m in media), f"{method} {path} has no example"
            for m in media:
                assert m["schema"] not in ({}, None), f"{method} {path} has an empty schema"
    tokenize = doc["paths"]["/tokenize"]["post"]
    assert tokenize["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
    assert tokenize["responses"]["201"]["content"]["application/json"]["schema"]["anyOf"]
    page = doc["paths"]["/webhooks"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert page["$ref"].endswith("CursorPage_WebhookOut_")
    problem = doc["components"]["schemas"]["Problem"]["properties"]
    assert {"type", "title", "status", "detail", "instance", "errors", "code"} <= set(problem)
    assert "any JSON media type" in doc["info"]["description"]


def test_the_docs_page_renders_the_description_from_the_package(api):
    page = api.client().get("/docs")
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    html = page.raw.decode()
    assert "/docs/assets/swagger-ui-bundle.js" in html and "http" not in html.replace("http-equiv", "")
    script = api.client().get("/docs/assets/swagger-ui-bundle.js")
    assert script.status == 200 and len(script.raw) > 100_000
    assert "/openapi.json" in api.client().get("/docs/assets/init.js").raw.decode()
    assert api.client().get("/docs/assets/swagger-ui.css").status == 200
    assert_problem(api.client().get("/docs/assets/..%2Fsecret"), 404)
    assert_problem(api.client().get("/docs/assets/index.j2"), 404)
