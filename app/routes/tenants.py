"""The caller's tenant: ``/tenants/self`` (spec, core document section 4, Tenants)."""

from __future__ import annotations

import uuid

from pydantic import Field

from app.api import Api, Call
from app.schemas import Audited, Name, RequestModel
from domain.tenancy import tenants as service

api = Api()
TAG = "Tenants"


class TenantUpdate(RequestModel):
    name: Name
    settings: dict[str, str] | None = Field(
        None,
        description="fingerprint_tokens, disable_ephemeral_proxy, deduplicate_tokens: the strings 'true' or "
        "'false'; token_deduplication_behavior: 'update_existing' or 'read_existing'. Settings not sent keep "
        "their values.",
    )


class TenantOut(Audited):
    id: uuid.UUID
    owner_id: uuid.UUID | None
    name: str
    type: str
    settings: dict[str, str]


@api.route(
    "GET",
    "/tenants/self",
    permission="tenant:read",
    response=TenantOut,
    tag=TAG,
    summary="Get the caller's tenant",
    errors=(401, 403),
)
async def get(call: Call):
    return await call.db(service.read_tenant, call.caller)


@api.route(
    "PUT",
    "/tenants/self",
    permission="tenant:update",
    body=TenantUpdate,
    response=TenantOut,
    tag=TAG,
    summary="Update the caller's tenant",
    errors=(400, 401, 403),
)
async def update(call: Call):
    return await call.db(service.update_tenant, call.caller, name=call.body.name, settings=call.body.settings)


@api.route(
    "DELETE",
    "/tenants/self",
    permission="tenant:delete",
    status=204,
    tag=TAG,
    summary="Delete the caller's tenant",
    errors=(401, 403),
    description="The tenant and every API key of it stop working at once.",
)
async def delete(call: Call):
    await call.db(service.delete_tenant, call.caller)
