"""Applications and their keys: ``/applications`` (spec, core document section 4, Applications)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Literal

from pydantic import Field

from app.api import Api, Call
from app.pagination import OffsetPage, offset_page, offset_query
from app.schemas import Audited, Name, RequestModel, ResponseModel
from domain.tenancy import applications as service
from domain.tenancy.applications import APPLICATION_TYPES
from domain.tenancy.permissions import LEGACY_SHUTDOWN_DATE, modern_names
from infra.errors import Problem

api = Api()
TAG = "Applications"
ApplicationType = Literal[APPLICATION_TYPES]  # type: ignore[valid-type]


class ApplicationIn(RequestModel):
    name: Name
    type: ApplicationType
    permissions: list[str] = Field(default_factory=list, max_length=300)


class ApplicationUpdate(RequestModel):
    name: Name
    permissions: list[str] = Field(default_factory=list, max_length=300)


class ApplicationOut(Audited):
    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    type: str
    permissions: list[str]
    key: str | None = Field(None, description="The API key; returned only when the application is created.")


class ApplicationKeyOut(ResponseModel):
    id: uuid.UUID
    application_id: uuid.UUID
    created_at: dt.datetime
    key: str | None = Field(None, description="The API key; returned only when the key is created.")


#: RFC 9745: a grant naming a legacy permission is answered with this header.
LEGACY_DEPRECATION = {"Deprecation": f"@{int(LEGACY_SHUTDOWN_DATE.timestamp())}"}
GRANT_TEXT = (
    "Legacy permission names (shut down on January 3, 2022: `token:create`, `token:read`, "
    "`token:decrypt`, `token:update`, "
    "`token:delete`, `token:use` and their `card:` and `bank:` forms) are taken and mapped to their granular "
    "replacements (`token:create` -> `token:general:create`, `card:read` -> `token:pci:read:low`, `bank:decrypt` "
    "-> `token:bank:read:high`, `token:use` -> `token:general:use:proxy` ...); the new names are stored and "
    "returned, and the answer carries `Deprecation: " + LEGACY_DEPRECATION["Deprecation"] + "` (the legacy "
    "names were retired on January 3, 2022). `card:decrypt` never existed: 400."
)


def _granted(call: Call, requested: list[str]) -> list[str]:
    """The permissions to grant: legacy names mapped (and the answer marked deprecated)."""
    permissions, legacy = modern_names(requested)
    if legacy:
        call.headers.update(LEGACY_DEPRECATION)
    return permissions


ListQuery = offset_query(100, id=(list[uuid.UUID], Field(default_factory=list)))


@api.route(
    "POST",
    "/applications",
    permission="application:create",
    body=ApplicationIn,
    status=201,
    response=ApplicationOut,
    tag=TAG,
    summary="Create an application",
    errors=(400, 401, 403),
    description="Returns the application with its API key; the key is shown only this once. " + GRANT_TEXT,
)
async def create(call: Call):
    b = call.body
    permissions = _granted(call, b.permissions)
    return await call.db(service.create_application, call.caller, name=b.name, type=b.type, permissions=permissions)


@api.route(
    "GET",
    "/applications",
    permission="application:read",
    query=ListQuery,
    response=OffsetPage[ApplicationOut],
    tag=TAG,
    summary="List applications",
    errors=(400, 401, 403),
    description="Offset pagination; `id` (repeatable) filters by application id.",
)
async def list_(call: Call):
    q = call.query
    data, total = await call.db(service.list_applications, call.caller, ids=q.id, page=q.page, size=q.size)
    return offset_page(data, total=total, page=q.page, size=q.size)


@api.route(
    "GET",
    "/applications/key",
    permission="application:read",
    response=ApplicationOut,
    tag=TAG,
    summary="Get the application of the calling key",
    errors=(401, 403),
)
async def of_key(call: Call):
    return await call.db(service.application_of_caller, call.caller)


@api.route(
    "GET",
    "/applications/{id}",
    permission="application:read",
    response=ApplicationOut,
    tag=TAG,
    summary="Get an application",
    errors=(401, 403, 404),
)
async def get(call: Call):
    return await call.db(service.read_application, call.caller, call.uuid_param(what="application"))


@api.route(
    "PUT",
    "/applications/{id}",
    permission="application:update",
    body=ApplicationUpdate,
    response=ApplicationOut,
    tag=TAG,
    summary="Update an application",
    errors=(400, 401, 403, 404),
    description="Replaces the name and the permissions. The type cannot change. " + GRANT_TEXT,
)
async def update(call: Call):
    b = call.body
    return await call.db(
        service.update_application,
        call.caller,
        call.uuid_param(what="application"),
        name=b.name,
        permissions=_granted(call, b.permissions),
    )


@api.route(
    "DELETE",
    "/applications/{id}",
    permission="application:delete",
    status=204,
    tag=TAG,
    summary="Delete an application",
    errors=(401, 403, 404),
    description="Every key of the application stops working at once.",
)
async def delete(call: Call):
    await call.db(service.delete_application, call.caller, call.uuid_param(what="application"))


@api.route(
    "POST",
    "/applications/{id}/keys",
    permission="application:update",
    status=201,
    response=ApplicationKeyOut,
    tag=TAG,
    summary="Create a further key for an application",
    errors=(401, 403, 404),
    description="Key rotation (replaces the retired regenerate operation): create a new key, move "
    "callers to it, then delete the old one. The key is shown only in this answer.",
)
async def create_key(call: Call):
    return await call.db(service.create_key, call.caller, call.uuid_param(what="application"))


@api.route(
    "GET",
    "/applications/{id}/keys",
    permission="application:read",
    response=list[ApplicationKeyOut],
    tag=TAG,
    summary="List an application's keys",
    errors=(401, 403, 404),
    description="Ids and creation dates only; keys are never shown again.",
)
async def list_keys(call: Call):
    return await call.db(service.list_keys, call.caller, call.uuid_param(what="application"))


@api.route(
    "DELETE",
    "/applications/{id}/keys/{key_id}",
    permission="application:update",
    status=204,
    tag=TAG,
    summary="Delete one key of an application",
    errors=(401, 403, 404),
)
async def delete_key(call: Call):
    key_id = call.uuid_param("key_id", what="application key")
    await call.db(service.delete_key, call.caller, call.uuid_param(what="application"), key_id)


@api.route(
    "POST",
    "/applications/{id}/regenerate",
    permission="application:update",
    status=410,
    tag=TAG,
    summary="Regenerate an application key (shut down)",
    errors=(410,),
    deprecated=True,
    description="Shut down on October 17, 2024: answers 410. Create a new key with "
    "POST /applications/{id}/keys, then delete the old one.",
)
async def regenerate(call: Call):
    raise Problem(
        410,
        "Key regeneration was shut down on October 17, 2024; create a new key with "
        "POST /applications/{id}/keys, then delete the old one with DELETE /applications/{id}/keys/{key_id}.",
    )
