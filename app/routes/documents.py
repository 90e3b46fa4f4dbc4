"""Documents: ``/documents`` (spec, core document sections 2 and 4, Documents; section 8: 25 requests
per minute per application).

Handlers are thin: the upload is streamed into S3 by ``domain.documents.uploads``, the rows and the
sealed content are ``domain.documents.service``'s. The per-application limiter
(:data:`app.context.DOCUMENT_LIMITER`) and the file thread pool (:data:`app.context.FILE_EXECUTOR`) are
the application's (``app/main.py``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import uuid
from typing import Annotated, Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import Field, ValidationError

from app.api import Api, Call, parse_json
from app.context import DOCUMENT_LIMITER, FILE_EXECUTOR
from app.ratelimit import DOCUMENTS_RULE, Rule
from app.schemas import RequestModel, ResponseModel
from domain.documents import service as documents
from domain.documents.errors import CorruptDocument
from domain.documents.uploads import Upload
from infra.errors import Problem, validation_errors, validation_problem

DOCUMENT_TAG = "Documents"
#: Multipart framing allowed beyond ``document_max_bytes`` in a declared Content-Length.
MULTIPART_SLACK = 64 * 1024
#: Largest ``request`` part of a document upload.
REQUEST_PART_MAX_BYTES = 64 * 1024
_UNKNOWN_PART = "Unknown part: send `document` and optionally `request`."
_CONTENT_TYPE = re.compile(r"^[A-Za-z0-9!#$&^_.+-]{1,127}/[A-Za-z0-9!#$&^_.+-]{1,127}(\s*;.{0,200})?$")

api = Api()


async def _limit_documents(call: Call) -> None:
    """Count the request against its application's Documents limit; 429 with Retry-After past it."""
    limit = call.settings.rate_limit_documents_per_minute
    limiter = call.request.app.get(DOCUMENT_LIMITER)
    application_id = call.require_caller().application_id
    if limiter is None or limit <= 0 or application_id is None:
        return
    wait = await limiter.hit(str(application_id), [Rule(DOCUMENTS_RULE, limit)])
    if wait:
        raise Problem(
            429,
            f"The Documents API allows {limit} requests per minute per application; retry after {wait} s.",
            headers={"Retry-After": str(wait)},
        )


def _file_runner(call: Call):
    """The runner of blocking S3 and crypto calls: the application's file pool (not the database pool:
    a large upload must not hold database threads), in the request's context (its log fields)."""

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(call.request.app[FILE_EXECUTOR], fn, *args)

    return run


# ---- shapes --------------------------------------------------------------------------------------


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
    upload = Upload(call.require_caller(), db=call.db, blocking=_file_runner(call))
    metadata: dict | None = None
    try:
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):  # a nested multipart has no name: an unknown part
                raise validation_problem({"body": [_UNKNOWN_PART]})
            name = part.name
            if name == "request" and metadata is None:
                metadata = _parse_request_part(await _read_small(part, REQUEST_PART_MAX_BYTES, "request"))
            elif name == "document" and upload.writer is None:
                _check_filename(part)
                await upload.begin(_part_content_type(part))
                await upload.stream(part, max_bytes)
            elif name in ("request", "document"):
                raise validation_problem({name: ["Send this part once."]})
            else:
                raise validation_problem({name or "body": [_UNKNOWN_PART]})
        if upload.writer is None:
            raise validation_problem({"document": ["The file part `document` is required."]})
        if upload.writer.size == 0:
            raise validation_problem({"document": ["The document is empty."]})
        return await upload.finish(metadata or {})
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
    blocking = _file_runner(call)
    try:
        await blocking(reader.open)
        chunk = await blocking(reader.next_chunk)  # the first chunk is checked before the answer starts
    except CorruptDocument:
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
            chunk = await blocking(reader.next_chunk)
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
