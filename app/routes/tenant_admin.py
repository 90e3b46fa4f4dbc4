"""Tenant administration: members, invitations, client encryption keys, documents, the usage report and
the security contact (spec, core document sections 2-4, 7 and 8).

Paths: ``/tenants/self/members``, ``/tenants/self/invitations``, ``/invitations/accept`` (the invitee,
no API key), ``/keys``, ``/documents``, ``/tenants/self/reports/usage``,
``/tenants/self/security-contact``. Handlers are thin: the domain work lives in
``domain.tenancy.members``, ``domain.tenancy.invitations``, ``domain.client_keys.service``,
``domain.documents.service`` and ``domain.tenancy.usage``.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import logging
import re
import uuid
from typing import Annotated, Any, Literal

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ConfigDict, EmailStr, Field, ValidationError

from app.api import FORM, AllOf, Api, Call, parse_json
from app.context import SETTINGS
from app.invitation_pages import NAME_MAX, accepted_page, invitation_page, problem_page, wants_html
from app.pagination import OffsetPage, offset_page, offset_query
from app.ratelimit import RateLimiter, Rule
from app.schemas import Audited, RequestModel, ResponseModel
from domain.client_keys import service as client_keys
from domain.documents import service as documents
from domain.tenancy import invitations, members, usage
from infra.errors import Problem, validation_errors, validation_problem
from storage.states import InvitationStatus

TENANT_TAG, MEMBER_TAG, INVITATION_TAG = "Tenants", "Tenant members", "Tenant invitations"
KEY_TAG, DOCUMENT_TAG = "Client encryption keys", "Documents"
log = logging.getLogger("tessera.api.tenant_admin")

#: The documents limiter of an application (spec section 8: 25 requests per minute per application).
DOCUMENT_LIMITER: web.AppKey[RateLimiter] = web.AppKey("document_limiter", RateLimiter)
DOCUMENT_RULE = "documents"
#: Multipart framing allowed beyond ``document_max_bytes`` in a declared Content-Length.
MULTIPART_SLACK = 64 * 1024
#: Largest ``request`` part of a document upload.
REQUEST_PART_MAX_BYTES = 64 * 1024
READ_SIZE = 256 * 1024
_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9!#$&^_.+-]{1,127}/[A-Za-z0-9!#$&^_.+-]{1,127}(\s*;.{0,200})?$")


class _AdminApi(Api):
    """This module's registry; installing it also gives the application its documents rate limiter."""

    def install(self, app: web.Application) -> None:
        """Add the routes and the limiter's lifetime (``cleanup_ctx``) to ``app``."""
        super().install(app)
        app.cleanup_ctx.append(_document_limiter)


api = _AdminApi()


async def _document_limiter(app: web.Application):
    """A :class:`RateLimiter` counting per application in windows of one minute (blocked for one minute
    past the limit), in Redis when ``TESSERA_REDIS_URL`` is set, else in process."""
    settings = app[SETTINGS]
    client = None
    if settings.redis_url:
        import redis.asyncio as aioredis

        client = aioredis.from_url(settings.redis_url)
    minute = settings.model_copy(update={"rate_limit_window_seconds": 60, "rate_limit_block_seconds": 60})
    app[DOCUMENT_LIMITER] = RateLimiter(minute, client)
    yield
    await app[DOCUMENT_LIMITER].close()


async def _limit_documents(call: Call) -> None:
    limit = call.settings.rate_limit_documents_per_minute
    limiter = call.request.app.get(DOCUMENT_LIMITER)
    application_id = call.require_caller().application_id
    if limiter is None or limit <= 0 or application_id is None:
        return
    wait = await limiter.hit(str(application_id), [Rule(DOCUMENT_RULE, limit)])
    if wait:
        raise Problem(
            429,
            f"The Documents API allows {limit} requests per minute per application; retry after {wait} s.",
            headers={"Retry-After": str(wait)},
        )


async def _blocking(fn, *args):
    """Run a blocking S3 or crypto call on the default thread pool (not the database pool: a large
    upload must not hold database threads), in the request's context (its log fields)."""
    return await asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, fn, *args)


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


class KeyIn(RequestModel):
    """The body of POST /keys."""

    expires_at: dt.datetime | None = Field(
        None,
        description="ISO 8601; default TESSERA_CLIENT_KEY_DEFAULT_DAYS (182 days, about 6 months) after creation; "
        "at most 1 year after creation. A time without an offset is UTC.",
    )


class KeyOut(ResponseModel):
    """A client encryption key without its public key."""

    key_id: str
    expires_at: dt.datetime
    created_by: uuid.UUID | None
    created_at: dt.datetime


class PublicJwk(ResponseModel):
    """The public key as a JWK (RFC 8037, X25519) for JWE ECDH-ES."""

    kty: Literal["OKP"]
    crv: Literal["X25519"]
    x: str
    kid: str
    use: Literal["enc"]
    alg: Literal["ECDH-ES"]


class KeyCreatedOut(KeyOut):
    """A new client encryption key with its public key (shown only once)."""

    public_key_pem: str = Field(description="SubjectPublicKeyInfo PEM of the X25519 public key; shown only here.")
    public_key_jwk: PublicJwk = Field(description="The same public key as a JWK; shown only here.")


class DocumentOut(ResponseModel):
    """A document's metadata."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    metadata: dict[str, str]
    content_type: str
    created_by: uuid.UUID | None
    created_at: dt.datetime


class DocumentRequest(RequestModel):
    """The optional `request` part of POST /documents."""

    metadata: dict[Annotated[str, Field(min_length=1, max_length=255)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=100
    )


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


# ---- client encryption keys ----------------------------------------------------------------------

_KEY_TEXT = (
    "Keys are X25519 key pairs for JWE `ECDH-ES` (direct key agreement) with `A256GCM`. Encrypt a token request "
    'object (`{"data": ..., "metadata": ...}`) as a compact JWE whose protected header has `alg` ECDH-ES, `enc` '
    "A256GCM and `kid` = `key_id`, then send it in the proxy's encrypted header. Compression (`zip`), other "
    "algorithms, JWEs over 64 KiB and keys that expired or were deleted are refused. Private keys never leave the "
    "platform and are destroyed after expiry."
)


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    return value.replace(tzinfo=dt.UTC) if value is not None and value.tzinfo is None else value


@api.route(
    "POST",
    "/keys",
    permission="keys:create",
    body=KeyIn,
    body_optional=True,
    status=201,
    response=KeyCreatedOut,
    tag=KEY_TAG,
    summary="Create a client encryption key",
    errors=(400,),
    description="Returns the public key once, as `public_key_pem` (SubjectPublicKeyInfo) and `public_key_jwk`. "
    "The body is optional (no body: the default life). `expires_at` in the past or more than 1 year after "
    "creation: 400. " + _KEY_TEXT,
)
async def create_key(call: Call):
    """``POST /keys``: 201 with the key and its public key."""
    return await call.db(
        client_keys.create_key,
        call.caller,
        expires_at=_aware(call.body.expires_at),
        default_days=call.settings.client_key_default_days,
    )


@api.route(
    "GET",
    "/keys",
    permission="keys:read",
    response=list[KeyOut],
    tag=KEY_TAG,
    summary="List the client encryption keys",
    description="A plain array (not paginated), oldest first, without public keys; expired keys are listed until "
    "deleted.",
)
async def list_keys(call: Call):
    """``GET /keys``: a plain array."""
    return await call.db(client_keys.list_keys, call.caller)


@api.route(
    "GET",
    "/keys/{id}",
    permission="keys:read",
    response=KeyOut,
    tag=KEY_TAG,
    summary="Get a client encryption key",
    errors=(404,),
    description="Without the public key.",
)
async def get_key(call: Call):
    """``GET /keys/{id}``."""
    return await call.db(client_keys.read_key, call.caller, call.uuid_param(what="client encryption key"))


@api.route(
    "DELETE",
    "/keys/{id}",
    permission="keys:delete",
    status=204,
    tag=KEY_TAG,
    summary="Delete a client encryption key",
    errors=(404,),
    description="Its private key is destroyed at once: payloads encrypted with it can no longer be decrypted.",
)
async def delete_key(call: Call):
    """``DELETE /keys/{id}``: 204."""
    await call.db(client_keys.delete_key, call.caller, call.uuid_param(what="client encryption key"))


# ---- documents -----------------------------------------------------------------------------------

_DOCUMENT_LIMIT_TEXT = (
    "Every Documents endpoint counts against 25 requests per minute per application "
    "(TESSERA_RATE_LIMIT_DOCUMENTS_PER_MINUTE); past it: 429 with Retry-After."
)
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["document"],
                    "properties": {
                        "document": {"type": "string", "format": "binary", "description": "The file."},
                        "request": {
                            "type": "string",
                            "description": 'Optional JSON: {"metadata": {string: string}} (at most 100 pairs; '
                            "keys up to 255 characters, values up to 1024).",
                        },
                    },
                },
                "encoding": {"document": {"contentType": "*/*"}, "request": {"contentType": "application/json"}},
            }
        },
    }
}


async def _read_small(part, limit: int, field: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(8192):
        data += chunk
        if len(data) > limit:
            raise validation_problem({field: [f"At most {limit} bytes."]})
    return bytes(data)


def _parse_request_part(raw: bytes) -> dict:
    try:
        payload: Any = parse_json(raw) if raw.strip() else {}
    except Problem as problem:
        raise validation_problem(problem.errors or {"request": [problem.detail or "Not valid JSON."]}) from None
    try:
        return DocumentRequest.model_validate(payload).metadata
    except ValidationError as exc:
        raise validation_problem(validation_errors(exc, prefix="request")) from None


def _check_filename(part) -> None:
    """A part's filename, when sent, is printable UTF-8 text (no NUL or other control characters)."""
    name = part.filename
    if name is not None and not (name.isprintable() and _encodable(name)):
        raise validation_problem({"document": ["The part's filename must be printable UTF-8 text (no NUL)."]})


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # undecodable bytes arrive as lone surrogates
        return False
    return True


def _part_content_type(part) -> str:
    value = (part.headers.get("Content-Type") or documents.DEFAULT_CONTENT_TYPE).strip()
    if not _CONTENT_TYPE.match(value) or len(value) > 255:
        raise validation_problem({"document": ["The part's Content-Type is not a valid media type."]})
    return value


class _Upload:
    """One document upload in flight: its row id, its sealed writer and what to undo on failure."""

    def __init__(self, call: Call):
        self.call = call
        self.document_id: uuid.UUID | None = None
        self.writer: documents.SealedWriter | None = None

    async def begin(self, content_type: str) -> None:
        """Record the ``uploading`` row and open a sealed writer for it."""
        caller = self.call.require_caller()
        document_id = self.document_id = uuid.uuid4()
        data_key = await self.call.db(
            documents.begin_upload, caller, document_id=document_id, content_type=content_type
        )
        self.writer = await _blocking(
            lambda: documents.SealedWriter(
                tenant_id=caller.tenant_id,
                document_id=document_id,
                data_key=data_key,
                key=documents.object_key(caller.tenant_id, document_id),
            )
        )

    async def write(self, chunk: bytes) -> None:
        """Seal and upload one chunk; note the multipart upload id once it exists."""
        writer = self.writer
        if writer is None:
            raise RuntimeError("a chunk written before the upload began")
        if await _blocking(writer.write, chunk):
            await self.call.db(documents.note_upload_id, self.document_id, writer.upload_id)

    async def stream(self, part, max_bytes: int) -> None:
        """Read the file part in pieces, sealing and uploading each full chunk as it fills."""
        pending = bytearray()
        total = 0
        while piece := await part.read_chunk(READ_SIZE):
            total += len(piece)
            if total > max_bytes:
                raise Problem(413, f"The document is larger than {max_bytes} bytes (TESSERA_DOCUMENT_MAX_BYTES).")
            pending += piece
            while len(pending) >= documents.CHUNK_SIZE:
                chunk = bytes(pending[: documents.CHUNK_SIZE])
                del pending[: documents.CHUNK_SIZE]
                await self.write(chunk)
        if pending:
            await self.write(bytes(pending))

    async def undo(self) -> None:
        """Remove what a failed upload wrote to S3 and its row."""
        if self.writer is not None:
            try:
                await _blocking(self.writer.abort)
            except Exception:  # the documents sweep removes what is left
                log.warning("could not remove a failed upload's S3 object; the sweep will", exc_info=True)
        if self.document_id is not None:
            await self.call.db(documents.discard_upload, self.document_id)


@api.route(
    "POST",
    "/documents",
    permission="document:create",
    status=201,
    response=DocumentOut,
    tag=DOCUMENT_TAG,
    summary="Upload a document",
    errors=(400, 413, 415),
    openapi_extra=_UPLOAD_BODY,
    description="multipart/form-data with the part `document` (the file, required; its Content-Type is kept, "
    'default application/octet-stream) and the part `request` (optional JSON `{"metadata": {...}}`). The file is '
    "streamed, encrypted in 1 MiB chunks under the tenant's data key and stored in S3. Files over "
    "TESSERA_DOCUMENT_MAX_BYTES (25 MB): 413. Empty files and unknown parts: 400. " + _DOCUMENT_LIMIT_TEXT,
)
async def create_document(call: Call):
    """``POST /documents``: stream the `document` part into S3, sealed in chunks; 201."""
    await _limit_documents(call)
    request = call.request
    if request.content_type != "multipart/form-data":
        raise Problem(415, "Send the document as multipart/form-data.")
    max_bytes = call.settings.document_max_bytes
    if request.content_length is not None and request.content_length > max_bytes + MULTIPART_SLACK:
        raise Problem(413, f"The document is larger than {max_bytes} bytes (TESSERA_DOCUMENT_MAX_BYTES).")
    upload = _Upload(call)
    metadata: dict | None = None
    try:
        reader = await request.multipart()
        async for part in reader:
            name = getattr(part, "name", None)
            if name == "request" and metadata is None:
                metadata = _parse_request_part(await _read_small(part, REQUEST_PART_MAX_BYTES, "request"))
            elif name == "document" and upload.writer is None:
                _check_filename(part)
                await upload.begin(_part_content_type(part))
                await upload.stream(part, max_bytes)
            elif name in ("request", "document"):
                raise validation_problem({name: ["Send this part once."]})
            else:
                raise validation_problem({name or "body": ["Unknown part: send `document` and optionally `request`."]})
        if upload.writer is None:
            raise validation_problem({"document": ["The file part `document` is required."]})
        if upload.writer.size == 0:
            raise validation_problem({"document": ["The document is empty."]})
        await _blocking(upload.writer.finish)
        return await call.db(
            documents.finish_upload,
            call.caller,
            upload.document_id,
            size=upload.writer.size,
            chunk_count=upload.writer.chunks,
            metadata=metadata or {},
        )
    except (ValueError, HttpProcessingError) as exc:  # malformed multipart framing or part headers
        await upload.undo()
        reason = exc.message if isinstance(exc, HttpProcessingError) else exc
        raise Problem(400, f"The multipart body is malformed: {reason}", title="Invalid body") from None
    except BaseException:
        await upload.undo()
        raise


@api.route(
    "GET",
    "/documents/{id}",
    permission="document:read",
    response=DocumentOut,
    tag=DOCUMENT_TAG,
    summary="Get a document's metadata",
    errors=(404,),
    description=_DOCUMENT_LIMIT_TEXT,
)
async def get_document(call: Call):
    """``GET /documents/{id}``: the metadata."""
    await _limit_documents(call)
    return await call.db(documents.read_document, call.caller, call.uuid_param(what="document"))


@api.route(
    "GET",
    "/documents/{id}/data",
    permission="document:reveal",
    response=bytes,
    response_content_type="application/octet-stream",
    tag=DOCUMENT_TAG,
    summary="Download a document's content",
    errors=(404,),
    description="The raw, decrypted content, streamed, with the Content-Type it was uploaded with, its "
    "Content-Length, `Content-Disposition: attachment` and `X-Content-Type-Options: nosniff`. " + _DOCUMENT_LIMIT_TEXT,
)
async def get_document_data(call: Call):
    """``GET /documents/{id}/data``: the decrypted content, streamed."""
    await _limit_documents(call)
    source = await call.db(documents.open_document, call.caller, call.uuid_param(what="document"))
    reader = documents.SealedReader(source)
    try:
        await _blocking(reader.open)
        chunk = await _blocking(reader.next_chunk)  # the first chunk is checked before the answer starts
    except documents.CorruptDocument:
        reader.close()
        raise Problem(500, "The document's stored content is damaged.") from None
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": source.content_type,
            "Content-Disposition": "attachment",
            "X-Content-Type-Options": "nosniff",
            call.settings.header("TRACE-ID"): call.trace_id,
        },
    )
    response.content_length = source.size
    try:
        await response.prepare(call.request)
        while chunk:
            await response.write(chunk)
            chunk = await _blocking(reader.next_chunk)
        await response.write_eof()
    finally:
        reader.close()
    return response


@api.route(
    "DELETE",
    "/documents/{id}",
    permission="document:delete",
    status=204,
    tag=DOCUMENT_TAG,
    summary="Delete a document",
    errors=(404,),
    description="Gone at once; the stored content is removed from S3 by a worker. " + _DOCUMENT_LIMIT_TEXT,
)
async def delete_document(call: Call):
    """``DELETE /documents/{id}``: 204."""
    await _limit_documents(call)
    await call.db(documents.delete_document, call.caller, call.uuid_param(what="document"))
