"""The outbound proxy: ``/proxy`` and ``/proxy/**`` (ephemeral and pre-configured invocation) and
``POST /detokenize`` (core document section 4 "Proxy", rules 1-10; section 5 rules 1 and 6; errors in
section 7; limits in section 8). The pre-configured proxies' management, ``/proxies``, is in
:mod:`app.routes.proxies`.

Invocation, in order: the proxy key (``<prefix>-PROXY-KEY`` header or ``<prefix lowercased>-proxy-key``
query parameter) names a pre-configured proxy, else ``<prefix>-PROXY-URL`` gives an ephemeral
destination; the caller is the ``<prefix>-API-KEY``'s application, or for a proxy that does not
require authentication and a request without a key, the proxy's ``application``; the request
transforms run; the expressions are detokenized and the invocation logged (one unit of work); the
request goes out through the one outbound client (``infra/http.py``); the response transforms run on
a 2xx answer, which is returned with ``<prefix>-PROXY-DESTINATION-STATUS``. Every failure of the
service itself is a ``{"proxy_error": {...}}`` body.
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from multidict import CIMultiDict
from pydantic import BaseModel, ConfigDict, Field

from app.api import Api, Call, authenticate_request
from config.settings import get_settings
from domain.proxy import service
from domain.proxy.detokenize import MAX_TOKENS
from domain.proxy.errors import INVALID_REQUEST, ProxyError, invalid_request
from domain.proxy.rules import ProxyHeaderNames, destination_url, forward_headers, proxy_header_names
from domain.proxy.transforms import (
    CodeRunner,
    DomainTokenizer,
    Message,
    apply_request_transforms,
    apply_response_transforms,
)
from domain.reactors.transforms import code_transform_runner
from domain.tenancy.caller import Caller
from infra import http
from infra.errors import Problem

api = Api()
TAG = "Proxy"
METHODS = ("POST", "GET", "PUT", "PATCH", "DELETE")

NOT_FOUND = "Proxy not found"
DESTINATION_TIMEOUT = "Proxy destination timeout"
DESTINATION_UNREACHABLE = "Proxy destination unreachable"
EPHEMERAL_DISABLED = "Ephemeral proxies are disabled"


# ---- the proxy_error frame -----------------------------------------------------------------------


def as_proxy_error(problem: Problem) -> Problem:
    """Every problem of an invocation as ``{"proxy_error": {errors, title, status, detail}}``
    (the proxy's error form), its headers (``Retry-After``, ``Allow``) kept."""
    if isinstance(problem, ProxyError):
        return problem
    wrapped = ProxyError(problem.status, problem.detail or problem.title, title=problem.title, errors=problem.errors)
    wrapped.headers = dict(problem.headers)
    return wrapped


def _forward_problem(error: http.ForwardError, timeout_s: float) -> ProxyError:
    if error.outcome == "timeout":
        detail = f"The destination did not answer within {timeout_s:g} seconds."
        return ProxyError(408, detail, title=DESTINATION_TIMEOUT, errors={"destination": [detail]})
    if error.outcome == "refused" or error.message == "DNS resolution failed":
        detail = f"The destination cannot be used: {error.message}."
        return ProxyError(400, detail, title=INVALID_REQUEST, errors={"destination": [detail]})
    detail = f"The destination could not be reached: {error.message}."
    return ProxyError(502, detail, title=DESTINATION_UNREACHABLE, errors={"destination": [detail]})


# ---- OpenAPI shapes -------------------------------------------------------------------------------


class ProxyErrorBody(BaseModel):
    """The members of ``proxy_error``."""

    model_config = ConfigDict(extra="forbid")
    errors: dict[str, list[str]] = Field(
        description="Messages by the part of the request at fault "
        "(`body`, `headers.<name>`, `destination`, `request_transforms[0]`)."
    )
    title: str
    status: int
    detail: str | None = None


class ProxyErrorOut(BaseModel):
    """The body of every failure of the proxy itself: ``{"proxy_error": {errors, title, status, detail}}``."""

    model_config = ConfigDict(extra="forbid")
    proxy_error: ProxyErrorBody


_PROXY_ERROR_SCHEMA = {**ProxyErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")}
_DEFS = _PROXY_ERROR_SCHEMA.pop("$defs", {})
_PROXY_ERROR_SCHEMA["properties"]["proxy_error"] = _DEFS["ProxyErrorBody"]
#: A ``proxy_error``, or a plain problem for what the API refuses before the proxy runs (a malformed
#: trace id, the rate limit).
_ERROR_SCHEMA = {
    "anyOf": [_PROXY_ERROR_SCHEMA, {"$ref": "#/components/schemas/Problem"}],
    "description": "A proxy_error; a plain problem only for what the API refuses before the proxy runs "
    "(a malformed trace id, the rate limit).",
}
_PROXY_ERROR_STATUSES = {
    "400": "Invalid proxy request or detokenization expression; a destination refused (HTTP, an IP address, a "
    "name resolving to a private address, a name that does not resolve); more than 20 tokens; an unknown "
    "token id.",
    "401": "Missing or invalid API key (for an ephemeral proxy, or a pre-configured one requiring authentication).",
    "403": "proxy:invoke or the token's use right is missing; or ephemeral proxies are disabled for the tenant.",
    "404": "No proxy has this key (or it is another tenant's).",
    "408": "The destination did not answer within 25 seconds.",
    "413": "The request body is too large.",
    "422": "A value cannot be used (a network token that is not active).",
    "502": "The destination could not be reached (connection refused or reset, TLS failure, answer too large).",
    "503": "A code transform's runtime is initializing; retry shortly.",
}


_ANY_BODY = {"type": "string", "format": "binary", "description": "Any body, of any media type."}


def _parameter(name: str, where: str, description: str) -> dict:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "schema": {"type": "string"},
        "description": description,
    }


def _invoke_openapi(names: ProxyHeaderNames, with_tail: bool) -> dict:
    parameters = [
        _parameter(
            names.url,
            "header",
            "Ephemeral proxy: the destination base URL (https, a DNS host, no IP "
            "address). Ignored when a proxy key is sent.",
        ),
        _parameter(names.key, "header", "Pre-configured proxy: its key."),
        _parameter(
            names.key_query,
            "query",
            f"Pre-configured proxy: its key, instead of the {names.key} header (not forwarded).",
        ),
        _parameter(
            names.api_key, "header", "Required, except for a pre-configured proxy configured with require_auth false."
        ),
        _parameter(
            names.encrypted,
            "header",
            "Base64 JSON of encrypted payloads (single `{type, encrypted}` or a "
            "map of names to them), read by `{{ encrypted | json: ... }}`.",
        ),
        _parameter(names.keep_alive, "header", "Sent to the destination as Keep-Alive."),
        _parameter(names.connection, "header", "Sent to the destination as Connection."),
    ]
    if with_tail:
        parameters.insert(
            0,
            _parameter(
                "tail",
                "path",
                "The path appended to the destination (several segments "
                "allowed), forwarded byte for byte. Refused (400, `errors.path`): a segment "
                "that, percent-decoded repeatedly, is `.` or `..` (also with a `;` suffix "
                "such as `..;`) or holds a slash, backslash, line break or NUL (so `%2F`, "
                "`%5C`, `%252e%252e` never reach the destination).",
            ),
        )
    answer = {
        "description": f"The destination's answer (any status), headers and body unchanged, with "
        f"`{names.destination_status}` carrying its status.",
        "headers": {names.destination_status: {"schema": {"type": "integer"}}},
        "content": {"*/*": {"schema": _ANY_BODY}},
    }
    responses: dict[str, Any] = {"200": answer, "default": answer}
    for status, text in _PROXY_ERROR_STATUSES.items():
        responses[status] = {"description": text, "content": {"application/problem+json": {"schema": _ERROR_SCHEMA}}}
    return {
        "parameters": parameters,
        "responses": responses,
        "requestBody": {"required": False, "content": {"*/*": {"schema": _ANY_BODY}}},
    }


_INVOKE_TEXT = (
    "Forwards the request to a destination, replacing `{{ ... }}` expressions in the body and headers with token "
    "data.\n\n"
    "Destination: a pre-configured proxy's `destination_url` when its key is sent (`{key}` header or `{query}` "
    "query parameter; `{url}` is then ignored), else the `{url}` header (an ephemeral proxy, refused with 403 when "
    "the tenant setting `disable_ephemeral_proxy` is 'true'). It must be HTTPS with a DNS host (no IP address; "
    "a one-label name such as `localhost` is a DNS name) and TLS 1.2 or higher; its trailing slashes are removed "
    "before the path after `/proxy` and the query string "
    "(without the proxy key parameter) are appended. Names resolving to private, loopback, link-local or "
    "metadata addresses are refused (400) unless the deployment allows private destinations.\n\n"
    "Authentication: `{api_key}`, except for a pre-configured proxy with `require_auth` false called without "
    "one: its `application`'s permissions then apply (none without an application). A key of another tenant "
    "than the proxy's answers 404.\n\n"
    'Detokenization: `{{{{ <token_id> }}}}`, `{{{{ <token_id> | json: "$.number" }}}}`, '
    '`{{{{ token: <id> | json: "$.data.number" }}}}`, `{{{{ network_token: <id> | json: "$.data.number" }}}}`, '
    '`{{{{ token_intent: <id> | ... }}}}`, `{{{{ encrypted | json: "$.data.number" }}}}` (with `{encrypted}`); '
    "filters such as last4, reveal_last, card_bin, card_exp, json, to_string, to_number, pad_left, pad_right, "
    "to_base64. Requires `proxy:invoke` and the token's `token:<classification>:use:proxy` (403); at most "
    "{max_tokens} tokens per request (400); an unknown id 400.\n\n"
    "Forwarding: hop-by-hop headers and every `{prefix}-*` header are not forwarded (`{keep_alive}` and "
    "`{connection}` become Keep-Alive and Connection); the destination's own authentication headers are. "
    "Redirects are not followed. No answer within 25 seconds: 408.\n\n"
    "Pre-configured proxies: request transforms run on the request before detokenization (so expressions they "
    "add are detokenized too); response transforms run on a 2xx answer only; a code transform runs as a reactor "
    "invocation in a worker (the code gets `{{args: {{body, headers}}, configuration}}` with the proxy's "
    "configuration and returns `{{body, headers}}`); a thrown error answers its status as a `proxy_error`, a "
    "worker that does not answer within the reactor wait answers 503 'Proxy request transform is initializing'.\n\n"
    "Answer: the destination's status, headers and body unchanged, plus `{status}`. Without that header the "
    "failure is the proxy's own, as `{{\"proxy_error\": {{errors, title, status, detail}}}}`: 4xx on the caller's "
    "side (a name that does not resolve included), 5xx on the service's (502 when the destination cannot be "
    "reached or its answer exceeds 10 MiB). The request body is read whole (at most the API's body limit) "
    "because expressions are rendered in it. Every invocation writes a log (entity type proxy, operation invoke, "
    "entity id the proxy's id or 'ephemeral'; never the body), and detokenized tokens count as used this month."
)


def _invoke_description(names: ProxyHeaderNames, prefix: str) -> str:
    return _INVOKE_TEXT.format(
        key=names.key,
        query=names.key_query,
        url=names.url,
        api_key=names.api_key,
        encrypted=names.encrypted,
        max_tokens=MAX_TOKENS,
        prefix=prefix,
        keep_alive=names.keep_alive,
        connection=names.connection,
        status=names.destination_status,
    )


# ---- invocation -----------------------------------------------------------------------------------


class _Tokenizer:
    """The ``tokenize`` transform's call-out, run on the database thread pool (never on the loop)."""

    def __init__(self, call: Call, caller: Caller):
        self.call, self.caller = call, caller

    def tokenize(self, requests: list[dict]):
        caller = self.caller
        return self.call.db(lambda session: DomainTokenizer(session, caller).tokenize(requests))


def _proxy_key(request: web.Request, names: ProxyHeaderNames) -> str | None:
    key = request.headers.get(names.key)
    if key:
        return key
    for name, value in request.query.items():
        if name.lower() == names.key_query and value:
            return value
    return None


async def _caller_for(call: Call, target: service.Target | None, names: ProxyHeaderNames) -> Caller:
    request = call.request
    if target is not None and not target.require_auth and not request.headers.get(names.api_key):
        assert target.anonymous is not None
        return target.anonymous
    caller = await authenticate_request(request, call.settings, call.trace_id)
    if target is not None and caller.tenant_id != target.tenant_id:
        raise ProxyError(404, "No proxy has this key.", title=NOT_FOUND, errors={"key": ["No proxy has this key."]})
    return caller


def _code_runner(call: Call, caller: Caller, target: service.Target | None) -> CodeRunner | None:
    """The runner of the proxy's code transforms: each runs as a reactor invocation in a worker, the
    request waiting for its outcome message; None when the proxy has no code transform."""
    if target is None or not target.has_code:
        return None
    return code_transform_runner(
        caller, proxy_id=target.proxy_id, configuration=target.configuration, db=call.db, wait=call.wait_for_jobs
    )


async def invoke(call: Call) -> web.StreamResponse:
    """One proxied request (see :data:`_INVOKE_TEXT`)."""
    request = call.request
    settings = call.settings
    names = proxy_header_names(settings.header_prefix)
    body = await request.read() if request.body_exists else None
    key = _proxy_key(request, names)
    target = None
    if key:
        target = await service.target_cache.get_or_load(
            key,
            trace_id=call.trace_id,
            ttl=settings.auth_cache_seconds,
            load=lambda: call.db(service.invocation_target, key, trace_id=call.trace_id),
        )
        if target is None:
            raise ProxyError(404, "No proxy has this key.", title=NOT_FOUND, errors={"key": ["No proxy has this key."]})
    caller = await _caller_for(call, target, names)
    if target is not None:
        base, where = target.destination_url, "destination_url"
    else:
        if caller.setting("disable_ephemeral_proxy"):
            detail = "The tenant's setting disable_ephemeral_proxy forbids ephemeral proxies; use a pre-configured one."
            raise ProxyError(403, detail, title=EPHEMERAL_DISABLED, errors={f"headers.{names.url}": [detail]})
        base, where = request.headers.get(names.url, ""), f"headers.{names.url}"
        if not base:
            raise invalid_request(f"Send the destination in {names.url} or a proxy key in {names.key}.", where=where)
    raw_path = request.rel_url.raw_path
    url = destination_url(
        base, raw_path[len("/proxy") :], request.rel_url.raw_query_string, key_query=names.key_query, where=where
    )
    content_type = request.headers.get("Content-Type")
    message = Message(forward_headers(request.headers.items(), names), body, content_type)
    code_runner = _code_runner(call, caller, target)
    if target is not None and target.request_transforms:
        message = await apply_request_transforms(
            target.request_transforms, message, _Tokenizer(call, caller), code_runner=code_runner
        )
    detokenized = await call.db_grouped(
        service.prepare_invocation,
        caller,
        target.proxy_id if target else None,
        headers=message.headers,
        body=message.body,
        content_type=content_type,
        encrypted_header=request.headers.get(names.encrypted),
    )
    timeout_s = settings.proxy_timeout_seconds
    try:
        answer = await http.forward(
            request.method,
            url,
            detokenized.headers,
            detokenized.body,
            timeout_s=timeout_s,
            allow_private=settings.allow_private_destinations,
            extra_ca=settings.proxy_ca_bundle,
            max_response_bytes=settings.proxy_max_response_bytes,
        )
    except http.ForwardError as error:
        raise _forward_problem(error, timeout_s) from None
    answer_body: bytes | None
    headers, answer_body = answer.headers, answer.body
    if target is not None and target.response_transforms and 200 <= answer.status < 300:
        answer_type = next((value for name, value in headers if name.lower() == "content-type"), None)
        out = await apply_response_transforms(
            target.response_transforms,
            answer.status,
            Message(headers, answer_body, answer_type),
            _Tokenizer(call, caller),
            code_runner=code_runner,
        )
        headers, answer_body = out.headers, out.body
    response_headers = CIMultiDict(headers)
    response_headers[names.destination_status] = str(answer.status)
    response = web.Response(status=answer.status, body=answer_body or b"", headers=response_headers)
    if "Content-Type" not in response_headers:
        response.headers.popall("Content-Type", None)  # the destination sent none: add none
    return response


async def invoke_path(call: Call) -> web.StreamResponse:
    """:func:`invoke` for ``/proxy/**`` (its own OpenAPI operation id)."""
    return await invoke(call)


def _install_invocation_routes() -> None:
    settings = get_settings()
    names = proxy_header_names(settings.header_prefix)
    description = _invoke_description(names, settings.header_prefix)
    for path, handler, documented in (
        ("/proxy", invoke, True),
        ("/proxy/{tail}", invoke_path, True),
        ("/proxy/{tail:.*}", invoke_path, False),
    ):
        for method in METHODS:
            api.route(
                method,
                path,
                auth=False,
                tag=TAG,
                summary=f"Invoke the proxy ({method})",
                response=bytes,
                response_content_type="*/*",
                description=description,
                problems=as_proxy_error,
                documented=documented,
                openapi_extra=_invoke_openapi(names, path != "/proxy"),
            )(handler)


_install_invocation_routes()


# ---- POST /detokenize -----------------------------------------------------------------------------

DetokenizeDocument = Annotated[
    dict[str, Any] | list[Any],
    Field(description="Any JSON object or array; token expressions in its strings are replaced by token data."),
]


@api.route(
    "POST",
    "/detokenize",
    body=DetokenizeDocument,
    response=DetokenizeDocument,
    tag=TAG,
    summary="Detokenize a JSON document",
    errors=(400, 401, 403),
    description="Permission, per token read: its use right `token:<classification>:use:proxy` and, since "
    "the data is answered to the caller, its read right `token:<classification>:read:<impact_level>` at or "
    "above the token's impact level (403 naming the missing one); a body without expressions needs none.\n\n"
    "A decision of this implementation, for the official client libraries: answers the "
    "body (a JSON object or array) with the same structure, every token expression in any string of any "
    "object or array replaced by the token's data, read by the proxy's expression engine: "
    "`{{ <token_id> }}`, `{{ <token_id> | json: '$.number' }}`, `{{ token: <token_id> | json: "
    "'$.data.number' }}` and the engine's filters. A string that is one whole expression becomes the "
    "value itself (an object, a number, a string); an expression inside a longer string is written as "
    "text. Only token values are read here (network tokens, token intents, wallet tokens and "
    f"`encrypted` answer 400). At most {MAX_TOKENS} distinct tokens per request, as the proxy (400). A "
    "card's `cvc` is never answered. Errors are problem objects (not `proxy_error`), keyed `body`. Logged "
    "like a proxy invocation (a log row with entity type `proxy`, entity id `detokenize`, operation "
    "`invoke`; never the body), and the tokens count as used this month in the usage report.",
)
async def detokenize_document(call: Call):
    try:
        return await call.db_grouped(service.detokenize_document, call.caller, call.payload)
    except ProxyError as error:
        raise Problem(error.status, error.detail, title=error.title, errors=error.errors) from None
