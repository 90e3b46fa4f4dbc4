"""The OpenAPI 3.1 description, built from the endpoint declarations (``app/api.py``).

Every operation states its permission, its request and response shapes and its error statuses;
schemas come from the pydantic models the endpoints validate with, so the description cannot drift
from what the server enforces. Design decisions taken where the reference documents say "not shown"
are written into the operations' descriptions.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, TypeAdapter

from app.api import RAW_JSON, AllOf, AnyOf, Route
from config import __version__
from config.settings import Settings

_PATH_PARAM = re.compile(r"{(\w+)}")
_REF = "#/components/schemas/{model}"

PROBLEM_SCHEMA = {
    "type": "object",
    "description": "RFC 7807 problem (application/problem+json).",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
        "errors": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
            "description": "Per-property validation messages, keyed by property path.",
        },
    },
    "required": ["type", "title", "status"],
}

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


class _Schemas:
    """Collects component schemas from pydantic models."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {"Problem": PROBLEM_SCHEMA}

    def of(self, annotation: Any) -> dict:
        if annotation is None or annotation is RAW_JSON:
            return {}
        schema = TypeAdapter(annotation).json_schema(ref_template=_REF, mode="serialization")
        for name, definition in schema.pop("$defs", {}).items():
            self.components.setdefault(name, definition)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            self.components.setdefault(annotation.__name__, schema)
            return {"$ref": _REF.format(model=annotation.__name__)}
        return schema

    def request_of(self, model: type[BaseModel]) -> dict:
        schema = TypeAdapter(model).json_schema(ref_template=_REF, mode="validation")
        for name, definition in schema.pop("$defs", {}).items():
            self.components.setdefault(name, definition)
        self.components.setdefault(model.__name__ + "Input", schema)
        return {"$ref": _REF.format(model=model.__name__ + "Input")}


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
        body_schema = {} if route.body is RAW_JSON else schemas.request_of(route.body)
        operation["requestBody"] = {
            "required": not route.body_optional,
            "content": {route.request_content_type: {"schema": body_schema}},
        }
    if route.status == 204:
        operation["responses"]["204"] = {"description": "No content."}
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
    operation.update({k: v for k, v in route.openapi_extra.items() if k != "parameters"})
    return operation


def build_openapi(settings: Settings, routes: list[Route]) -> dict:
    """The OpenAPI 3.1 document for ``routes`` (every declared route of the application)."""
    schemas = _Schemas()
    paths: dict[str, dict] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schemas, settings)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tessera API",
            "version": __version__,
            "description": (
                "Self-hosted tokenization platform. Authenticate with the "
                f"`{settings.header('API-KEY')}` header. Errors are RFC 7807 problems. "
                f"Every response carries `{settings.header('TRACE-ID')}`."
            ),
        },
        "servers": [{"url": settings.public_base_url or f"http://{settings.api_host}:{settings.api_port}"}],
        "paths": paths,
        "components": {
            "schemas": schemas.components,
            "securitySchemes": {"ApiKey": {"type": "apiKey", "in": "header", "name": settings.header("API-KEY")}},
        },
    }
