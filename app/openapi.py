"""The OpenAPI 3.1 description, built from the endpoint declarations (``app/api.py``).

Every operation states its permission, its request and response shapes and its error statuses;
schemas come from the pydantic models the endpoints validate with, so the description cannot drift
from what the server enforces. Design decisions taken where the reference documents say "not shown"
are written into the operations' descriptions.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from app.api import AllOf, AnyOf, Route
from app.examples import REQUEST_EXAMPLES, RESPONSE_EXAMPLES
from config import __version__
from config.settings import Settings
from domain.webhooks.events import EVENT_TYPES
from storage.states import RailStatus

_PATH_PARAM = re.compile(r"{(\w+)}")
_REF = "#/components/schemas/{model}"

PROBLEM_SCHEMA = {
    "type": "object",
    "description": "RFC 7807 problem (application/problem+json). Outside `/agentic/` `type` is `about:blank`; under "
    "it `type` is a stable code of the agentic error catalogue "
    "(`VALIDATION_ERROR`, `INVALID_TOKEN`, `PROVIDER_ENROLLMENT_FAILED` ...) and `title` the first failing "
    "field for VALIDATION_ERROR. Members beyond the standard ones appear where the operation says so.",
    "properties": {
        "type": {"type": "string", "description": "`about:blank`, or an agentic catalogue code."},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string", "description": "What went wrong and what to do."},
        "instance": {"type": "string", "description": "The request path."},
        "errors": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
            "description": "Per-property validation messages, keyed by property path (`data.number`, `[2].data`, "
            "`start` for a cursor).",
        },
        "code": {
            "type": "string",
            "description": "Why an invitation link cannot be used (410): "
            "`invitation_already_accepted`, `invitation_expired`, `invitation_link_superseded`, "
            "`invitation_withdrawn`.",
        },
        "member_id": {"type": "string", "description": "The existing member (409 on an invitation)."},
        "token_id": {"type": "string", "description": "The token an intent already became (409 on convert)."},
        "debug": {
            "type": "object",
            "properties": {"provider_correlation": {"type": "string"}},
            "description": "Agentic provider failures: the provider's correlation id when it sent one.",
        },
    },
    "required": ["type", "title", "status"],
    "example": {
        "type": "about:blank",
        "title": "One or more validation errors occurred.",
        "status": 400,
        "detail": "The request is invalid; see errors.",
        "instance": "/applications",
        "errors": {"name": ["must not be empty"]},
    },
}

#: Decisions taken where the reference documents are silent (see also each operation's description).
_DECISIONS = (
    "Request bodies: JSON under any JSON media type (`application/json` or any `application/*+json`), except merge "
    "patches, which require `application/merge-patch+json`. A body nested deeper than 200 levels, an integer of "
    "more than 4,300 digits, a number beyond a double's range, a lone UTF-16 surrogate or a NUL character anywhere "
    "(also in a path segment or a query value) answers 400 and changes nothing. An API key header that is not "
    "ASCII text answers 401. Cursors (`pagination.next`, sent back as `start`) are signed for the tenant and the "
    "list: a forged, altered or another list's cursor answers 400 naming `start`; cursors do not expire. "
    "Validation messages speak one voice (`is required`, `must be a string`, `must be at most 100` ...), keyed by "
    "property path in `errors`."
)

_ERROR_TEXT = {
    400: "Invalid request (validation failures list each property in `errors`).",
    401: "Missing or invalid API key.",
    403: "The key lacks the required permission.",
    404: "Not found (also for another tenant's resources).",
    409: "Conflict.",
    410: "Gone: the feature was shut down; the problem names its replacement.",
    413: "Request body too large.",
    415: "Unsupported content type.",
    422: "The request cannot be processed.",
    429: "Rate limited; see Retry-After.",
    503: "Unavailable.",
}


_COMPONENT_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _component(name: str) -> str:
    """A component name OpenAPI accepts (``CursorPage[TokenOut]`` -> ``CursorPage_TokenOut_``)."""
    return _COMPONENT_NAME.sub("_", name)


class _Schemas:
    """Collects component schemas from pydantic types (request forms get an ``Input`` suffix)."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {"Problem": PROBLEM_SCHEMA}

    def _add(self, annotation: Any, mode: JsonSchemaMode, suffix: str) -> dict:
        schema = TypeAdapter(annotation).json_schema(ref_template=_REF, mode=mode)
        for name, definition in schema.pop("$defs", {}).items():
            self.components.setdefault(name, definition)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            name = _component(annotation.__name__) + suffix
            self.components.setdefault(name, schema)
            return {"$ref": _REF.format(model=name)}
        return schema

    def of(self, annotation: Any) -> dict:
        """The response schema of ``annotation`` (a reference for models)."""
        return self._add(annotation, "serialization", "")

    def request_of(self, annotation: Any) -> dict:
        """The request schema of ``annotation`` (a reference for models)."""
        return self._add(annotation, "validation", "Input")


# ---- examples ------------------------------------------------------------------------------------

_FORMAT_EXAMPLES = {
    "uuid": "3fa85f64-5717-4562-b3fc-2c963f66afa6",
    "date-time": "2026-01-01T12:00:00Z",
    "date": "2026-01-01",
    "email": "user@example.com",
    "uri": "https://example.com/hook",
    "binary": "...",
}
_PATTERN_CANDIDATES = ("01", "2031", "abc", "alias-1", "/pci/high/", "general", "x")
_EXAMPLE_ID = "3fa85f64-5717-4562-b3fc-2c963f66afa6"
#: Realistic strings by property name (exact name first, then its last ``_`` part), for schemas that
#: give no format, enum or example of their own.
_NAMED_EXAMPLES = {
    "id": _EXAMPLE_ID,
    "email": "user@example.com",
    "notify_email": "ops@example.com",
    "name": "Acme",
    "display_name": "Acme shop",
    "first_name": "Ada",
    "last_name": "Lovelace",
    "last4": "4242",
    "bin": "42424242",
    "brand": "visa",
    "funding": "credit",
    "currency": "USD",
    "value": "50.00",
    "domain": "shop.example.com",
    "url": "https://example.com/hooks/tessera",
    "destination_url": "https://api.example.com/charges",
    "upload_url": "https://s3.example.com/tessera/account-updater/request.csv?X-Amz-Signature=...",
    "download_url": "https://s3.example.com/tessera/account-updater/response.csv?X-Amz-Signature=...",
    "content_type": "application/pdf",
    "cryptogram": "AgAAAAAABk4DWZ4C28yUQAAAAAA=",
    "eci": "05",
    "key": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "public_key": "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE...",
    "public_key_hash": "hX3G2vYzFl1kq0c8iK6Zs6Hc1fE3oCj1bEXAMPLE4=",
    "fingerprint": "EYzjMr7H9k4uTgqrQ8pA1Bf9cH3",
    "status": "active",
    "type": "card",
    "role": "ADMIN",
    "code": "PROVIDER_ENROLLMENT_FAILED",
    "title": "Provider enrollment failed",
    "detail": "The provider refused the enrollment.",
    "provider": "vic",
    "operation": "enroll",
    "event_type": "token.created",
    "entity_type": "token",
    "action": "create",
    "description": "Groceries for the week",
    "ip_address": "203.0.113.7",
    "country_code": "US",
    "language_code": "en",
    "token": "c3e1f8a4b2d94e0f9a7b6c5d4e3f2a1b",
    "number": "4242 XXXX XXXX 4242",
    "mask": "{{ data.number | reveal_last: 4 }}",
    "background_color": "#1a1f71",
    "height": "64",
    "image": "node22",
    "ingest_source": "wallet-a",
    "error": "The destination did not answer.",
    "message": "The destination did not answer.",
    "check": "database",
    "routing_number": "021000021",
    "account_number": "XXXXXXXXX0001",
    "network_reference": "DNITHE302035112345678",
    "merchant_id": "merchant.com.example.shop",
    "container": "/pci/high/",
    "search_index": "{{ data.number }}",
    "event": "token.created",
    "enrollment_id": "enr_7fQ2mK9x",
    "brand_name": "Acme",
}


def _named_example(name: str | None) -> str | None:
    """A realistic string for a property called ``name`` (``token_id`` -> an id), or None."""
    if not name:
        return None
    if name in _NAMED_EXAMPLES:
        return _NAMED_EXAMPLES[name]
    last = name.rsplit("_", 1)[-1]
    if last in ("id", "ids"):
        return _EXAMPLE_ID
    if last in ("at", "date"):
        return _FORMAT_EXAMPLES["date-time"]
    return _NAMED_EXAMPLES.get(last)


def example_of(schema: dict, components: dict, depth: int = 0, name: str | None = None) -> Any:
    """A value that fits ``schema`` (a JSON schema of this description), built from its defaults,
    examples, enums, formats and required properties, and for plain strings from the property's
    ``name`` (``email``, ``*_id``, ``currency`` ...); None where nothing fits. Used to give every
    operation an example in the description."""
    if depth > 8:
        return None
    if "$ref" in schema:  # a named enum is a leaf: it costs no depth
        target = components.get(schema["$ref"].rsplit("/", 1)[-1], {})
        return example_of(target, components, depth + (0 if "enum" in target else 1), name)
    for key in ("example", "const"):
        if key in schema:
            return schema[key]
    if schema.get("examples"):
        return schema["examples"][0]
    if "default" in schema and schema["default"] is not None:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [option for option in schema.get(key, []) if option.get("type") != "null"]
        if options:
            return example_of(options[0], components, depth + 1, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = schema.get("required", list(properties)[:3])
        return {key: example_of(properties[key], components, depth + 1, key) for key in required if key in properties}
    if kind == "array":
        item = example_of(schema.get("items", {}), components, depth + 1, name[:-1] if name else None)
        return [] if item is None else [item]
    if kind == "integer":
        return max(int(schema.get("minimum", 1)), 1) if "maximum" not in schema else int(schema.get("minimum", 1))
    if kind == "number":
        return schema.get("minimum", 1.5)
    if kind == "boolean":
        return True
    if kind == "string":
        if schema.get("format") in _FORMAT_EXAMPLES:
            return _FORMAT_EXAMPLES[schema["format"]]
        pattern = schema.get("pattern")
        if pattern:
            return next((c for c in _PATTERN_CANDIDATES if re.search(pattern, c)), None)
        named = _named_example(name)
        if named is not None and len(named) <= int(schema.get("maxLength", len(named))):
            return named
        text = name.replace("_", " ") if name else "text"
        length = max(int(schema.get("minLength", 0)), min(len(text), int(schema.get("maxLength", len(text)))))
        return text[:length].ljust(length, "x")
    return None


def _stated_permission(route: Route) -> str | None:
    """The "Permission: ..." sentence a route without a fixed permission opens its description with."""
    if route.description.startswith("Permission"):
        return route.description.split("\n\n", 1)[0].strip()
    return None


def _permission_text(route: Route) -> str:
    permission = route.permission
    if not route.auth:
        return "No API key required."
    if permission is None:
        return _stated_permission(route) or (
            "Requires an API key; the permission depends on the request (see the description)."
        )
    if isinstance(permission, AnyOf | AllOf):
        return f"Permission: {permission.describe()}."
    return f"Permission: {permission}."


def _parameters(route: Route, settings: Settings) -> list[dict]:
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAM.findall(route.path)
    ]
    if route.query is not None:
        schema = TypeAdapter(route.query).json_schema(ref_template=_REF)
        required = set(schema.get("required", []))
        for name, prop in schema.get("properties", {}).items():
            params.append({"name": name, "in": "query", "required": name in required, "schema": prop})
    params += route.openapi_extra.get("parameters", [])
    if route.method in ("POST", "PUT", "PATCH", "DELETE"):
        params.append(
            {
                "name": settings.header("TRACE-ID"),
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "Correlation id (a uuid); generated when absent; returned on every response.",
            }
        )
    return params


def _operation(route: Route, schemas: _Schemas, settings: Settings) -> dict:
    description = route.description if _stated_permission(route) else _permission_text(route)
    if route.description and description is not route.description:
        description += "\n\n" + route.description
    operation: dict[str, Any] = {
        "operationId": f"{route.method.lower()}_{route.handler.__module__.rsplit('.', 1)[-1]}_{route.handler.__name__}",
        "summary": route.summary,
        "description": description,
        "tags": [route.tag],
        "parameters": _parameters(route, settings),
        "responses": {},
    }
    if route.auth:
        operation["security"] = [{"ApiKey": []}]
        operation["x-permission"] = _permission_text(route)
    if route.deprecated:
        operation["deprecated"] = True
    if route.body is not None:
        body_schema = schemas.request_of(route.body)
        operation["requestBody"] = {
            "required": not route.body_optional,
            "content": {kind: {"schema": body_schema} for kind in route.request_content_types},
        }
    if route.status == 204:
        operation["responses"]["204"] = {"description": "No content."}
    elif route.response is None:  # an operation that only answers problems (shut down: 410)
        pass
    else:
        content = {route.response_content_type: {"schema": schemas.of(route.response)}}
        operation["responses"][str(route.status)] = {"description": "Success.", "content": content}
    errors = set(route.errors)
    if route.auth:
        errors |= {401, 403} if route.permission is not None else {401}
    if route.method in ("POST", "PUT", "PATCH", "DELETE"):
        errors.add(400)
    errors.add(429)
    for status in sorted(errors):
        operation["responses"][str(status)] = {
            "description": _ERROR_TEXT.get(status, "Error."),
            "content": {"application/problem+json": {"schema": {"$ref": _REF.format(model="Problem")}}},
        }
    operation.update({k: v for k, v in route.openapi_extra.items() if k not in ("parameters", "responses")})
    for status, answer in route.openapi_extra.get("responses", {}).items():  # merged: more media types
        target = operation["responses"].setdefault(status, {"description": answer.get("description", "")})
        target.setdefault("content", {}).update(answer.get("content", {}))
    return operation


_EXAMPLES = {"request": REQUEST_EXAMPLES, "response": RESPONSE_EXAMPLES}


def _add_examples(operation: dict, route: Route, components: dict) -> None:
    """Give the operation's request body, its success answer and its first problem an example (the
    route's own ``examples`` when it declares them, else ``app.examples``' one, else one built from the
    schema)."""
    for key, where in (
        ("request", operation.get("requestBody")),
        ("response", operation["responses"].get(str(route.status))),
    ):
        for kind, media in ((where or {}).get("content") or {}).items():
            if key in route.examples:
                media["example"] = route.examples[key]
            elif f"{route.method} {route.path}" in (table := _EXAMPLES[key]):
                media["example"] = table[f"{route.method} {route.path}"]
            elif "example" not in media and ("json" in kind or "form" in kind):
                value = example_of(media.get("schema", {}), components)
                if value is not None:
                    media["example"] = value
    for status, answer in operation["responses"].items():
        if status.startswith(("4", "5")) and "content" in answer:
            for media in answer["content"].values():
                media["example"] = {
                    "type": "about:blank",
                    "title": HTTPStatus(int(status)).phrase,
                    "status": int(status),
                    "detail": _ERROR_TEXT.get(int(status), "Error."),
                    "instance": route.path,
                }
            break


def _webhooks() -> dict:
    """The top-level ``webhooks`` section: one entry per event type, its envelope and its payload."""
    entries = {}
    for event_type in EVENT_TYPES:
        data = _EVENT_DATA[event_type.split(".", 1)[0] if not event_type.startswith("agentic.") else event_type]
        envelope = {
            "type": "object",
            "required": ["event", "delivered_at"],
            "properties": {
                "event": {
                    "type": "object",
                    "required": ["id", "type", "timestamp", "tenant_id", "trace_id", "data"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "type": {"const": event_type},
                        "timestamp": {"type": "string", "format": "date-time"},
                        "tenant_id": {"type": "string", "format": "uuid"},
                        "trace_id": {"type": ["string", "null"]},
                        "data": data,
                    },
                },
                "delivered_at": {"type": "string", "format": "date-time"},
            },
        }
        entries[event_type] = {
            "post": {
                "summary": f"The {event_type} event",
                "description": _WEBHOOK_TEXT,
                "operationId": "webhook_" + re.sub(r"\W", "_", event_type),
                "parameters": [
                    {"name": name, "in": "header", "required": True, "schema": {"type": "string"}, "description": text}
                    for name, text in _SIGNATURE_HEADERS
                ],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": envelope, "example": example_of(envelope, {})}},
                },
                "responses": {
                    "2XX": {
                        "description": "Received; any other answer (or none within the timeout) is "
                        "retried with backoff."
                    }
                },
            }
        }
    return entries


_WEBHOOK_TEXT = (
    "POSTed to each enabled webhook subscribed to the type, signed per Standard Webhooks (the headers below; "
    "the signing key is GET /webhooks/signing-key). At least once: deduplicate on `webhook-id`. Event data carries "
    "ids and states only, never token data. `reactor.invocation.*` carry `{reactor: {id}, invocation: {id, status}}`."
)
_SIGNATURE_HEADERS = (
    ("webhook-id", "The message id, the same on every retry of a message."),
    ("webhook-timestamp", "Unix seconds when the attempt was signed."),
    ("webhook-signature", "Space-separated `v1,<base64 HMAC-SHA256>` of `<id>.<timestamp>.<body>`."),
)


def _ids(*names: str, status: bool = True) -> dict:
    properties = {"id": {"type": "string"}}
    if status:
        properties["status"] = {"type": "string"}
    return {"type": "object", "required": list(properties), "properties": properties}


_EVENT_DATA: dict[str, dict] = {
    "token": {
        "type": "object",
        "required": ["token"],
        "properties": {
            "token": {
                "type": "object",
                "required": ["id", "type"],
                "properties": {"id": {"type": "string"}, "type": {"enum": ["token", "card", "bank"]}},
            }
        },
    },
    "network-token": {"type": "object", "required": ["network_token"], "properties": {"network_token": _ids()}},
    "account-updater": {"type": "object", "required": ["job"], "properties": {"job": _ids()}},
    "agentic.payment-method.rail.retried": {
        "type": "object",
        "required": ["payment_method", "rail"],
        "properties": {
            "payment_method": _ids(),
            "rail": {
                "type": "object",
                "required": ["rail", "provider", "status", "provider_ids"],
                "properties": {
                    "rail": {"enum": ["agentic-token", "spt"]},
                    "provider": {"enum": ["vic", "agentpay", "psp"]},
                    "status": {"enum": [status.value for status in RailStatus]},
                    "provider_ids": {"type": "object", "additionalProperties": {"type": "string"}},
                    "error": {"type": "object", "properties": {"code": {"type": "string"}}},
                },
            },
        },
    },
    "agentic.allowance.updated": {"type": "object", "required": ["allowance"], "properties": {"allowance": _ids()}},
    "agentic.credential.created": {
        "type": "object",
        "required": ["credential", "allowance"],
        "properties": {"credential": _ids(status=False), "allowance": _ids()},
    },
    "reactor": {
        "type": "object",
        "required": ["reactor", "invocation"],
        "properties": {"reactor": _ids(status=False), "invocation": _ids()},
    },
}


def build_openapi(settings: Settings, routes: list[Route]) -> dict:
    """The OpenAPI 3.1 document for ``routes`` (every declared route of the application), with a
    top-level ``webhooks`` section (every event type of ``domain/webhooks/events.py``) and an example
    on every operation."""
    schemas = _Schemas()
    paths: dict[str, dict] = {}
    documented = [route for route in routes if route.documented]
    for route in documented:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schemas, settings)
    for route in documented:
        _add_examples(paths[route.path][route.method.lower()], route, schemas.components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tessera API",
            "version": __version__,
            "description": (
                "Self-hosted tokenization platform. Authenticate with the "
                f"`{settings.header('API-KEY')}` header. Errors are RFC 7807 problems. "
                f"Every response carries `{settings.header('TRACE-ID')}`.\n\n" + _DECISIONS
            ),
        },
        "servers": [{"url": settings.public_base_url or f"http://{settings.api_host}:{settings.api_port}"}],
        "paths": paths,
        "webhooks": _webhooks(),
        "components": {
            "schemas": schemas.components,
            "securitySchemes": {"ApiKey": {"type": "apiKey", "in": "header", "name": settings.header("API-KEY")}},
        },
    }
