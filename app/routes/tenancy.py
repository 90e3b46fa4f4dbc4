"""Tenancy: the tenant's members, invitations, usage report and security contact (spec, core document
sections 2-4 and 8).

Paths: ``/tenants/self/members``, ``/tenants/self/invitations``, ``/invitations/accept`` (the invitee,
no API key), ``/tenants/self/reports/usage``, ``/tenants/self/security-contact``. Handlers are thin:
the domain work lives in ``domain.tenancy.members``, ``domain.tenancy.invitations`` and
``domain.tenancy.usage``. The tenant itself is in :mod:`app.routes.tenants`, its applications in
:mod:`app.routes.applications`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, EmailStr, Field

from app.api import FORM, AllOf, Api, Call
from app.invitation_pages import NAME_MAX, accepted_page, invitation_page, problem_page, wants_html
from app.pagination import OffsetPage, offset_page, offset_query
from app.schemas import Audited, RequestModel, ResponseModel
from domain.tenancy import invitations, members, usage
from infra.errors import Problem
from storage.states import InvitationStatus

TENANT_TAG, MEMBER_TAG, INVITATION_TAG = "Tenants", "Tenant members", "Tenant invitations"

api = Api()


# ---- shapes --------------------------------------------------------------------------------------


class UserOut(ResponseModel):
    """A user ; every field but id is optional."""

    id: uuid.UUID
    email: str | None
    first_name: str | None
    last_name: str | None
    picture: str | None


class MemberOut(Audited):
    """A tenant member: a user and its role."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    role: Literal["OWNER", "ADMIN", "READ_ONLY"]
    user: UserOut


class InvitationIn(RequestModel):
    """The body of POST /tenants/self/invitations."""

    email: EmailStr = Field(description="The invitee's address, well-formed per RFC 5322.")
    role: Literal["ADMIN", "READ_ONLY"] = Field("ADMIN", description="The member's role once accepted.")


class InvitationOut(Audited):
    """An invitation to join the tenant, with the role it grants."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    email: str
    role: Literal["ADMIN", "READ_ONLY"]
    status: InvitationStatus
    expires_at: dt.datetime


class AcceptIn(RequestModel):
    """The body of POST /invitations/accept: the link's token and the invitee's names."""

    token: str = Field(min_length=1, max_length=invitations.MAX_TOKEN_LENGTH, description="The link's token.")
    first_name: str | None = Field(None, max_length=NAME_MAX)
    last_name: str | None = Field(None, max_length=NAME_MAX)


class TenantRef(ResponseModel):
    """The tenant an invitation is for."""

    id: uuid.UUID
    name: str


class InvitationPreviewOut(ResponseModel):
    """What an invitation link invites to (GET /invitations/accept)."""

    tenant: TenantRef
    email: str
    role: Literal["ADMIN", "READ_ONLY"]
    expires_at: dt.datetime


class AcceptQuery(BaseModel):
    """The query of GET /invitations/accept."""

    model_config = ConfigDict(extra="ignore")

    token: str = Field(min_length=1, max_length=invitations.MAX_TOKEN_LENGTH, description="The link's token.")


class SecurityContactIn(RequestModel):
    """The body of PUT /tenants/self/security-contact."""

    email: Annotated[EmailStr, Field(max_length=200)]


class SecurityContactOut(ResponseModel):
    """The security contact (the owner's email when none is set)."""

    email: str | None


class TypeMetrics(ResponseModel):
    """Live tokens of one type: how many, and when the newest was created."""

    count: int
    last_created_at: dt.datetime | None


class TokenReport(ResponseModel):
    """The token part of the usage report."""

    metrics_by_type: dict[str, TypeMetrics]
    included_monthly_active_tokens: int
    monthly_active_tokens: int


class UsageReportOut(ResponseModel):
    """The usage report."""

    token_report: TokenReport


MembersQuery = offset_query(
    50,
    user_id=(list[uuid.UUID], Field(default_factory=list, description="Only these users' memberships (repeatable).")),
)
InvitationsQuery = offset_query(100)


# ---- tenant: security contact, usage report ------------------------------------------------------


@api.route(
    "GET",
    "/tenants/self/security-contact",
    permission="tenant:read",
    response=SecurityContactOut,
    tag=TENANT_TAG,
    summary="Get the tenant's security contact",
    description="When no contact was set, the tenant owner's email is returned.",
)
async def get_security_contact(call: Call):
    """``GET /tenants/self/security-contact``."""
    return await call.db(members.read_security_contact, call.caller)


@api.route(
    "PUT",
    "/tenants/self/security-contact",
    permission="tenant:update",
    body=SecurityContactIn,
    response=SecurityContactOut,
    tag=TENANT_TAG,
    summary="Set the tenant's security contact",
    errors=(400,),
    description="`email` is required, well-formed (RFC 5322) and at most 200 characters.",
)
async def put_security_contact(call: Call):
    """``PUT /tenants/self/security-contact``."""
    return await call.db(members.update_security_contact, call.caller, email=call.body.email)


@api.route(
    "GET",
    "/tenants/self/reports/usage",
    permission="report:read",
    response=UsageReportOut,
    tag=TENANT_TAG,
    summary="Get the tenant's usage report",
    description="`metrics_by_type`: per token type, the live tokens (`count`) and the newest one's creation time. "
    "`monthly_active_tokens`: distinct tokens created, read or used in the current calendar month (UTC), counted "
    "exactly. `included_monthly_active_tokens`: the allowance (TESSERA_INCLUDED_MONTHLY_ACTIVE_TOKENS, default "
    "10,000).",
)
async def usage_report(call: Call):
    """``GET /tenants/self/reports/usage``."""
    return await call.db(usage.usage_report, call.caller, included=call.settings.included_monthly_active_tokens)


# ---- members -------------------------------------------------------------------------------------


@api.route(
    "GET",
    "/tenants/self/members",
    permission="tenant:member:read",
    query=MembersQuery,
    response=OffsetPage[MemberOut],
    tag=MEMBER_TAG,
    summary="List the tenant's members",
    errors=(400,),
    description="Offset pagination (page from 1; size 20 by default, at most 50), oldest first. `user_id` "
    "(repeatable) keeps only those users' memberships. The OWNER member is the owner named when the tenant was "
    "created.",
)
async def list_members(call: Call):
    """``GET /tenants/self/members``: offset-paginated members."""
    q = call.query
    data, total = await call.db(members.list_members, call.caller, user_ids=q.user_id, page=q.page, size=q.size)
    return offset_page(data, total=total, page=q.page, size=q.size)


@api.route(
    "DELETE",
    "/tenants/self/members/{id}",
    permission="tenant:member:delete",
    status=204,
    tag=MEMBER_TAG,
    summary="Remove a member",
    errors=(404, 422),
    description="Revokes all of the user's access to the tenant. The OWNER member cannot be removed (422).",
)
async def delete_member(call: Call):
    """``DELETE /tenants/self/members/{id}``: 204; 422 for the OWNER."""
    await call.db(members.delete_member, call.caller, call.uuid_param(what="member"))


# ---- invitations ---------------------------------------------------------------------------------

_INVITATION_TEXT = (
    "Each create and resend mails the invitee a one-time link `<base>/invitations/accept?token=<token>` (base: "
    "TESSERA_PUBLIC_BASE_URL, else the api's host and port), sent by a worker after the commit and retried while "
    "the mail server fails transiently. The invitation expires `expires_at` (72 hours, "
    "TESSERA_INVITATION_TTL_HOURS); a PENDING invitation past it reads EXPIRED. An accepted invitation becomes a "
    "member and is removed."
)


@api.route(
    "POST",
    "/tenants/self/invitations",
    permission="tenant:invitation:create",
    body=InvitationIn,
    status=201,
    response=InvitationOut,
    tag=INVITATION_TAG,
    summary="Invite someone to the tenant",
    errors=(400, 409),
    description="`role` is ADMIN (default) or READ_ONLY. 409 when the address is already a member or already has "
    "a PENDING invitation (resend that one). " + _INVITATION_TEXT,
)
async def create_invitation(call: Call):
    """``POST /tenants/self/invitations``: 201 with the invitation; its mail follows."""
    b = call.body
    return await call.db(
        invitations.create_invitation,
        call.caller,
        email=b.email,
        role=b.role,
        ttl_hours=call.settings.invitation_ttl_hours,
    )


@api.route(
    "GET",
    "/tenants/self/invitations",
    permission="tenant:invitation:read",
    query=InvitationsQuery,
    response=OffsetPage[InvitationOut],
    tag=INVITATION_TAG,
    summary="List the tenant's invitations",
    errors=(400,),
    description="Offset pagination (page from 1; size 20 by default, at most 100), oldest first.",
)
async def list_invitations(call: Call):
    """``GET /tenants/self/invitations``: offset-paginated invitations."""
    q = call.query
    data, total = await call.db(invitations.list_invitations, call.caller, page=q.page, size=q.size)
    return offset_page(data, total=total, page=q.page, size=q.size)


@api.route(
    "GET",
    "/tenants/self/invitations/{id}",
    permission="tenant:invitation:read",
    response=InvitationOut,
    tag=INVITATION_TAG,
    summary="Get an invitation",
    errors=(404,),
)
async def get_invitation(call: Call):
    """``GET /tenants/self/invitations/{id}``."""
    return await call.db(invitations.read_invitation, call.caller, call.uuid_param(what="invitation"))


@api.route(
    "POST",
    "/tenants/self/invitations/{id}/resend",
    permission=AllOf("tenant:invitation:create", "tenant:invitation:update"),
    response=InvitationOut,
    tag=INVITATION_TAG,
    summary="Send an invitation again",
    errors=(404,),
    description="No body. A PENDING or EXPIRED invitation becomes PENDING with `expires_at` 72 hours from now; "
    "links mailed earlier stop working and a new mail is sent.",
)
async def resend_invitation(call: Call):
    """``POST /tenants/self/invitations/{id}/resend``: 200 with the invitation."""
    return await call.db(
        invitations.resend_invitation,
        call.caller,
        call.uuid_param(what="invitation"),
        ttl_hours=call.settings.invitation_ttl_hours,
    )


@api.route(
    "DELETE",
    "/tenants/self/invitations/{id}",
    permission="tenant:invitation:delete",
    status=204,
    tag=INVITATION_TAG,
    summary="Delete an invitation",
    errors=(404,),
    description="Every link mailed for it stops working.",
)
async def delete_invitation(call: Call):
    """``DELETE /tenants/self/invitations/{id}``: 204."""
    await call.db(invitations.delete_invitation, call.caller, call.uuid_param(what="invitation"))


_ACCEPT_ERRORS = (
    "404: the token was never issued. 410 Gone with `code`: `invitation_already_accepted` (a link works once), "
    "`invitation_link_superseded` (the invitation was sent again: use the newest mail), `invitation_withdrawn` "
    "(deleted), `invitation_expired`. "
)


def _html_answers(*statuses: int) -> dict:
    """``openapi_extra`` documenting the HTML pages a browser or an HTML form gets at these statuses."""
    page = {"text/html": {"schema": {"type": "string", "description": "An HTML page."}}}
    return {"responses": {str(status): {"description": "An HTML page.", "content": page} for status in statuses}}


@api.route(
    "GET",
    "/invitations/accept",
    auth=False,
    query=AcceptQuery,
    response=InvitationPreviewOut,
    tag=INVITATION_TAG,
    summary="See what an invitation link invites to",
    errors=(400, 404, 410),
    openapi_extra=_html_answers(200, 404, 409, 410),
    description="The target of the link in the invitation mail. Does not use the link up: accept with "
    "POST /invitations/accept. A browser (`Accept` naming `text/html`, JSON not first) gets an HTML page "
    "instead: the tenant, the role and a form posting the token and the invitee's names to "
    "POST /invitations/accept; an unusable link gets a page with the status below. " + _ACCEPT_ERRORS,
)
async def preview_invitation(call: Call):
    """``GET /invitations/accept?token=``: the invitation, without using the link (a page for a browser)."""
    if not wants_html(call.request):
        return await call.db(invitations.preview_invitation, token=call.query.token)
    try:
        preview = await call.db(invitations.preview_invitation, token=call.query.token)
    except Problem as problem:
        return problem_page(problem)
    return invitation_page(preview, call.query.token)


@api.route(
    "POST",
    "/invitations/accept",
    auth=False,
    body=AcceptIn,
    request_content_type=("application/json", FORM),
    status=201,
    response=MemberOut,
    tag=INVITATION_TAG,
    summary="Accept an invitation",
    errors=(400, 404, 409, 410),
    openapi_extra=_html_answers(201, 404, 409, 410),
    description="No API key: the token from the invitation mail's link is the credential. Creates the user when the "
    "address is new (with the names given) and the tenant member with the invited role, once; the invitation is "
    "removed. 409 when the user is already a member. The same fields sent as an HTML form "
    "(`application/x-www-form-urlencoded`, the page of GET /invitations/accept) are answered with an HTML page "
    "(201 accepted, or the status below with its reason). " + _ACCEPT_ERRORS,
)
async def accept_invitation(call: Call):
    """``POST /invitations/accept``: 201 with the new member (a page when the body is an HTML form)."""
    b = call.body
    accept = invitations.accept_invitation
    if call.request.content_type != FORM:
        return await call.db(accept, token=b.token, first_name=b.first_name, last_name=b.last_name)
    try:
        member = await call.db(accept, token=b.token, first_name=b.first_name, last_name=b.last_name)
    except Problem as problem:
        return problem_page(problem)
    return accepted_page(member)
