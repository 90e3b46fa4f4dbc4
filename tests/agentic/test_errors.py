"""The agentic problem form (spec 001 section 7): the route attribute that frames core problems, the
framing codes over real HTTP, and the codes handlers raise."""

from __future__ import annotations

import pytest

from app.routes import agentic
from app.routes.agentic_common import DEPRECATION, agentic_form, agents_form
from domain.agentic.errors import CATALOGUE, agentic_error, to_agentic, validation_error
from infra.errors import Problem, validation_problem
from tests.factories.agentic import AMEX, BASE, PROBLEM, assert_problem, body, card_token
from tests.helpers import ApiClient

pytestmark = pytest.mark.api

# ---- the route attribute, as a function ------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "code", "title"),
    [
        (Problem(401, "The TS-API-KEY header is missing."), "UNAUTHORIZED", "Unauthorized"),
        (Problem(403, "The API key lacks the permission x."), "FORBIDDEN", "Forbidden"),
        (Problem(404, "No resource exists at this path."), "NOT_FOUND", "Not found"),
        (Problem(400, "The request body is empty.", title="Invalid body"), "INVALID_BODY", "Invalid body"),
        (Problem(413, "The request body is too large."), "BODY_TOO_LARGE", "Body too large"),
        (Problem(415, "Send the body as application/json."), "UNSUPPORTED_MEDIA_TYPE", "Unsupported media type"),
        (Problem(500, "An unexpected error occurred."), "INTERNAL_ERROR", "Internal error"),
    ],
)
def test_core_framing_problems_become_codes(problem, code, title):
    translated = agentic_form(problem)
    assert translated.type == code
    assert translated.status == problem.status
    assert translated.title == title
    assert translated.detail == problem.detail


def test_a_core_validation_problem_becomes_validation_error_titled_with_the_first_message():
    problem = validation_problem({"size": ["must be at most 100"], "start": ["not a cursor"]})
    translated = agentic_form(problem)
    assert translated.type == "VALIDATION_ERROR" and translated.status == 400
    assert translated.title == "size: must be at most 100"
    assert translated.errors == problem.errors


def test_every_agentic_route_and_only_those_frame_problems_the_agentic_way():
    import app.main
    from app.routes.proxy import as_proxy_error

    for module in app.main.route_modules():
        for route in module.api.routes:
            if route.path.startswith("/agentic/agents"):
                assert route.problems is agents_form, route.path
            elif route.path.startswith("/agentic/"):
                assert route.problems is agentic_form, route.path
            elif route.path == "/proxy" or route.path.startswith("/proxy/"):
                assert route.problems is as_proxy_error, route.path  # the proxy's own {proxy_error} form
            else:
                assert route.problems is None, route.path
    assert any(route.path == "/agentic/{rest:.*}" for route in agentic.api.routes)


def test_agentic_problems_pass_through_and_agents_get_the_deprecation_header():
    problem = agentic_error("CARD_REJECTED")
    assert agentic_form(problem) is problem
    translated = agents_form(Problem(401, "missing"))
    assert translated.type == "UNAUTHORIZED" and translated.headers == DEPRECATION
    assert "Deprecation" not in agentic_form(Problem(401, "x")).headers


def test_the_catalogue_is_complete():
    spec_codes = {
        "VALIDATION_ERROR",
        "INVALID_TOKEN",
        "UNSUPPORTED_PROVIDER",
        "RAIL_NOT_FOUND",
        "RAIL_NOT_ACTIVE",
        "NO_ACTIVE_RAILS",
        "PAYMENT_METHOD_DELETED",
        "ALLOWANCE_CANCELLED",
        "ALLOWANCE_EXPIRED",
        "ALLOWANCE_AMOUNT_EXCEEDED",
        "VERIFICATION_STATE_INVALID",
        "VERIFICATION_NOT_REQUIRED",
        "INVALID_OTP",
        "PAYMENT_METHOD_NOT_FOUND",
        "AGENT_NOT_FOUND",
        "ALLOWANCE_NOT_FOUND",
        "PAYMENT_CREDENTIAL_NOT_FOUND",
        "CARD_REJECTED",
        "PROVIDER_ENROLLMENT_FAILED",
        "RAIL_ENROLLMENT_INVALID",
        "RAIL_ALREADY_ENROLLED",
        "PROVIDER_ALLOWANCE_FAILED",
        "PROVIDER_ALLOWANCE_UPDATE_FAILED",
        "PROVIDER_CREDENTIALS_FAILED",
        "PROVIDER_VERIFICATION_FAILED",
        "VERIFICATION_NOT_SUPPORTED",
        "PROVIDER_NOT_CONFIGURED",
        "MPP_KEY_UNAVAILABLE",
        "UNSUPPORTED_RAIL",
        "INTERNAL_ERROR",
        "PROVIDER_ALLOWANCE_CANCEL_FAILED",
        "IDEMPOTENCY_IN_PROGRESS",
        "PAYMENT_METHOD_DELETE_IN_PROGRESS",
        "PAYMENT_METHOD_OPERATION_IN_PROGRESS",
        "IDEMPOTENCY_CONFLICT",
        "PAYMENT_METHOD_DELETE_INCOMPLETE",
        "CREATE_OUTCOME_UNKNOWN",
        "UNAUTHORIZED",
        "FORBIDDEN",
        "NOT_FOUND",
        "INVALID_BODY",
        "BODY_TOO_LARGE",
        "UNSUPPORTED_MEDIA_TYPE",
    }
    assert spec_codes <= set(CATALOGUE)
    statuses = {
        "CARD_REJECTED": 422,
        "RAIL_ALREADY_ENROLLED": 409,
        "MPP_KEY_UNAVAILABLE": 502,
        "PAYMENT_METHOD_NOT_FOUND": 404,
        "CREATE_OUTCOME_UNKNOWN": 409,
        "UNSUPPORTED_RAIL": 500,
    }
    assert {code: CATALOGUE[code][0] for code in statuses} == statuses
    error = validation_error({"a.b": ["is wrong"], "c": ["too"]})
    assert (error.type, error.title, error.status) == ("VALIDATION_ERROR", "a.b: is wrong", 400)
    assert to_agentic(error) is error


# ---- framing over real HTTP ------------------------------------------------------------------------


def _framing_cases(client: ApiClient, keyless: ApiClient, reader: ApiClient) -> list[tuple]:
    return [
        (keyless.post(BASE, {}), 401, "UNAUTHORIZED"),
        (keyless.with_key("key_bogus").get(BASE), 401, "UNAUTHORIZED"),
        (reader.post(BASE, {}), 403, "FORBIDDEN"),
        (client.get("/agentic/nothing-here"), 404, "NOT_FOUND"),
        (client.post(BASE, raw=b"{not json"), 400, "INVALID_BODY"),
        (client.post(BASE, raw=b""), 400, "INVALID_BODY"),
        (client.post(BASE, raw=b"{}", content_type="text/plain"), 415, "UNSUPPORTED_MEDIA_TYPE"),
        (client.post(BASE, raw=b"{" + b" " * 1_100_000 + b"}"), 413, "BODY_TOO_LARGE"),
        (client.delete("/agentic/agents/agt_1", raw=b"x"), 404, "AGENT_NOT_FOUND"),
    ]


def test_framing_codes_over_http(api, tenant, limited):
    reader = limited(tenant, ["agentic:payment-method:get"])
    for answer, status, code in _framing_cases(tenant.client, api.client(), reader):
        assert_problem(answer, status, code)
    agents = api.client().post("/agentic/agents", {"name": "x"})
    assert_problem(agents, 401, "UNAUTHORIZED")
    assert agents.headers["Deprecation"] == DEPRECATION["Deprecation"]
    missing_agent_path = api.client().get("/agentic/agents/agt_1/nothing")
    assert_problem(missing_agent_path, 404, "NOT_FOUND")
    assert missing_agent_path.headers["Deprecation"] == DEPRECATION["Deprecation"]
    wrong_method = tenant.client.put(BASE, {})
    assert_problem(wrong_method, 405, "METHOD_NOT_ALLOWED")
    assert wrong_method.headers["Allow"] == "GET, POST"
    outside = api.client().get("/webhooks")
    assert outside.status == 401 and outside.json["type"] == "about:blank"


# ---- codes raised by the handlers themselves (no hook needed) ----------------------------------------


def test_handler_problems_are_agentic_without_the_hook(tenant):
    client = tenant.client
    problem = assert_problem(client.post(BASE, {"source": {}, "consumer": {"email": 1}}), 400, "VALIDATION_ERROR")
    assert set(problem["errors"]) == {"source.type", "source.token_id", "consumer.email"}
    assert problem["title"] == f"source.type: {problem['errors']['source.type'][0]}"
    assert_problem(client.post(BASE, [1, 2]), 400, "VALIDATION_ERROR")
    assert_problem(client.get(f"{BASE}?size=500"), 400, "VALIDATION_ERROR")
    assert_problem(client.get(f"{BASE}/pm_missing"), 404, "PAYMENT_METHOD_NOT_FOUND")
    answer = client.post(BASE, body(card_token(client, AMEX)))
    assert answer.status == 201 and answer.headers["Content-Type"].startswith("application/json")
    assert not answer.headers["Content-Type"].startswith(PROBLEM)
