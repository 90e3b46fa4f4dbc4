"""The pre-configured proxies' management: ``/proxies`` (core document section 4 "Proxy"; errors in
section 7). Their invocation, ``/proxy`` and ``/proxy/**``, is in :mod:`app.routes.proxy`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, cursor_query, decode_cursor
from app.schemas import Audited, ResponseModel
from domain.proxy import service
from domain.proxy.models import ProxyRequest, request_errors
from infra.errors import validation_problem

api = Api()
MANAGEMENT_TAG = "Proxies"
MERGE_PATCH = "application/merge-patch+json"


class ApplicationRefOut(ResponseModel):
    id: uuid.UUID


class ProxyOut(Audited):
    """A pre-configured proxy."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    destination_url: str
    request_transforms: list[dict[str, Any]]
    response_transforms: list[dict[str, Any]]
    configuration: dict[str, str]
    require_auth: bool
    application: ApplicationRefOut | None = None
    key: str | None = Field(None, description="The proxy key, returned only by POST /proxies.")


class ProxyPatch(BaseModel):
    """An RFC 7396 merge patch of a proxy (``name``, ``destination_url``, ``request_transforms``,
    ``response_transforms``, ``configuration``, ``require_auth``, ``application``; the deprecated
    singular transforms too); the result is validated like a PUT body."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": True})
    name: Any = None
    destination_url: Any = None
    request_transforms: Any = None
    response_transforms: Any = None
    configuration: Any = None
    require_auth: Any = None
    application: Any = None


ListQuery = cursor_query(
    100,
    name=(
        str | None,
        Field(None, max_length=200, description=("Keeps proxies whose name contains this text (case-insensitive).")),
    ),
)

_FIELDS_TEXT = (
    "Fields: `name` (1-200 characters), `destination_url` (HTTPS, a DNS host, no IP address, no query; trailing "
    "slashes removed), `request_transforms` and `response_transforms` (at most 20 each, run in order; types "
    "`tokenize`, `mask`, `append_json`, `append_text`, `append_header`, `code`; a new `code` transform needs "
    "`runtime.image` `node22`: an omitted runtime or image, or `node-svc`, answers 400 since October 5, 2026, and "
    "code transforms a proxy already stores are kept by a merge patch), `configuration` (a map of "
    "strings, encrypted at rest), `require_auth` (default true; false lets a caller knowing only the key invoke "
    "it), `application` (`{id}`: the application whose permissions apply to callers without an API key). "
    "Deprecated since October 8, 2025 and still accepted: `request_transform` / `response_transform` (one "
    "transform, stored as a one-item list; not together with the list; the answer carries `Deprecation`; "
    '`{"code": ...}` without a `type` is a code transform, under the same runtime image rule). '
    "Shut down on March 31, 2023: "
    "`request_reactor_id` / `response_reactor_id` answer 400."
)


_CHANGE_APPLIES = (
    " A change applies to the next invocation through the api process that made it, and within "
    "`TESSERA_AUTH_CACHE_SECONDS` (2 s by default) through the others (each keeps a proxy it has looked up by key "
    "as long as an API key)."
)


#: RFC 9745 ``Deprecation`` of the singular ``request_transform`` / ``response_transform`` (October 8, 2025;
#: no shutdown announced, so no ``Sunset``), sent when a body uses them.
SINGULAR_DEPRECATION = {"Deprecation": f"@{int(dt.datetime(2025, 10, 8, tzinfo=dt.UTC).timestamp())}"}


def _deprecated_fields(call: Call) -> None:
    if isinstance(call.payload, dict) and {"request_transform", "response_transform"} & set(call.payload):
        call.headers.update(SINGULAR_DEPRECATION)


class _ProxyBody:
    """Validates a proxy body with the transform-aware error paths of
    :func:`domain.proxy.models.request_errors` (``request_transforms[0].location``)."""

    def validate_python(self, payload: Any) -> ProxyRequest:
        try:
            return ProxyRequest.model_validate(payload)
        except ValidationError as exc:
            raise validation_problem(request_errors(exc)) from None


_PROXY_BODY = _ProxyBody()


@api.route(
    "POST",
    "/proxies",
    permission="proxy:create",
    body=ProxyRequest,
    body_adapter=_PROXY_BODY,
    status=201,
    response=ProxyOut,
    tag=MANAGEMENT_TAG,
    summary="Create a proxy",
    errors=(400,),
    description="Answers the proxy with its `key` (shown only here; send it in the proxy key header or query "
    "parameter to invoke it). " + _FIELDS_TEXT,
)
async def create(call: Call):
    _deprecated_fields(call)
    return await call.db(service.create_proxy, call.caller, call.body)


@api.route(
    "GET",
    "/proxies",
    permission="proxy:read",
    query=ListQuery,
    response=CursorPage[ProxyOut],
    tag=MANAGEMENT_TAG,
    summary="List proxies",
    errors=(400,),
    description="Cursor pagination (size 1..100, default 20; `start` from `pagination.next`), newest first.",
)
async def list_(call: Call):
    q = call.query
    data, following = await call.db(
        service.list_proxies, call.caller, size=q.size, after=decode_cursor(call, q.start), name=q.name
    )
    return cursor_page(call, data, size=q.size, next_position=following)


@api.route(
    "GET",
    "/proxies/{id}",
    permission="proxy:read",
    response=ProxyOut,
    tag=MANAGEMENT_TAG,
    summary="Get a proxy",
    errors=(404,),
    description="The key is not returned.",
)
async def get(call: Call):
    return await call.db(service.read_proxy, call.caller, call.uuid_param(what="proxy"))


@api.route(
    "PUT",
    "/proxies/{id}",
    permission="proxy:update",
    body=ProxyRequest,
    body_adapter=_PROXY_BODY,
    response=ProxyOut,
    tag=MANAGEMENT_TAG,
    summary="Replace a proxy",
    errors=(400, 404),
    description="Replaces every field (omitted ones take their defaults); the key stays. "
    + _FIELDS_TEXT
    + _CHANGE_APPLIES,
)
async def update(call: Call):
    _deprecated_fields(call)
    return await call.db(service.update_proxy, call.caller, call.uuid_param(what="proxy"), call.body)


@api.route(
    "PATCH",
    "/proxies/{id}",
    permission="proxy:update",
    body=ProxyPatch,
    request_content_type=MERGE_PATCH,
    response=ProxyOut,
    tag=MANAGEMENT_TAG,
    summary="Update a proxy (merge patch)",
    errors=(400, 404, 415),
    description="Content-Type must be `application/merge-patch+json` (415 otherwise). Objects merge "
    "(`configuration` by key), null removes (a removed field takes its default); the result is validated "
    "like a PUT body (400 with per-field errors, nothing changed). " + _FIELDS_TEXT + _CHANGE_APPLIES,
)
async def patch(call: Call):
    _deprecated_fields(call)
    return await call.db(service.patch_proxy, call.caller, call.uuid_param(what="proxy"), call.payload)


@api.route(
    "DELETE",
    "/proxies/{id}",
    permission="proxy:delete",
    status=204,
    tag=MANAGEMENT_TAG,
    summary="Delete a proxy",
    errors=(404,),
    description="Its key stops working at once through the api process that deletes it, and within "
    "`TESSERA_AUTH_CACHE_SECONDS` (2 s by default) through the others (each keeps a proxy it has looked up "
    "by key as long as an API key).",
)
async def delete(call: Call):
    await call.db(service.delete_proxy, call.caller, call.uuid_param(what="proxy"))
