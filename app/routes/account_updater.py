"""Account updater jobs: ``/account-updater/jobs`` (second document, section 4 "Account updater jobs";
section 6 event 1). Handlers are thin: the rules live in :mod:`domain.account_updater.service`."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from pydantic import Field

from app.api import Api, Call
from app.pagination import CursorPage, cursor_page, cursor_query, decode_cursor
from app.schemas import ResponseModel
from domain.account_updater import service
from storage.states import AccountUpdaterStatus

api = Api()
#: An S3 event (``{"Records": [...]}``) or an SNS envelope carrying one; any JSON object is taken (a
#: notification is only a hint).
S3Notification = Annotated[dict[str, Any], Field(description="An S3 event or an SNS envelope carrying one.")]
TAG = "Account updater"


class ProgressOut(ResponseModel):
    """How far processing has come (this implementation's addition)."""

    rows_done: int = Field(description="Data rows of the request file processed so far.")
    rows_total: int | None = Field(description="Data rows in the request file; null until the file has been read.")


class JobOut(ResponseModel):
    """The account updater job, with `progress`."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    status: AccountUpdaterStatus
    created_by: uuid.UUID | None = Field(None, description="The application that created the job.")
    created_at: dt.datetime
    errors: list[str] = Field(description="Messages from processing (why a job failed).")
    upload_url: str | None = Field(
        None, description="Only while pending: a pre-signed S3 PUT URL, valid until expires_at."
    )
    expires_at: dt.datetime | None = Field(None, description="Only while pending: the end of the upload window.")
    progress: ProgressOut | None = Field(None, description="From processing on (this implementation's addition).")
    download_url: str | None = Field(
        None,
        description="Only when completed: a pre-signed S3 GET URL of the result "
        "file, valid one hour from the read that returned it.",
    )


JobPage = CursorPage[JobOut]


ListQuery = cursor_query(100)

_PROCESS = (
    "Upload the request CSV with a plain `PUT` of the file to `upload_url` (send `Content-Type: "
    "application/octet-stream` or none; at most 30 MB) before `expires_at`, one hour after creation. Header "
    "`token,expiration_year,expiration_month,merchant_id` (`token` required; the other columns optional and in any "
    "order; names are trimmed and case-insensitive); UTF-8, optional BOM; every row must have one field per "
    "column; blank lines are skipped. `expiration_year` and `expiration_month` are two digits each, given together "
    "or both left empty (then the token's stored expiration is sent; the row's values win when both exist); "
    "`merchant_id` is passed to the networks (a test tenant: empty or `SANDBOX`).\n\n"
    "The platform notices the file (a sweep every few seconds, an S3 ObjectCreated notification to "
    "`POST /account-updater/notifications/s3`, and each poll of the pending job) and moves the job to "
    "`processing`; a job still pending at `expires_at` is removed and reads 404 from that moment. A file over "
    "30 MB, without the header, not UTF-8 CSV, or with a row of the wrong width fails the job with messages in "
    "`errors`; so does a production tenant on a deployment without a card network (TESSERA_CARD_NETWORK_URL). "
    "`progress` shows rows done of rows total while processing. When every row is done the job is `completed` "
    "and `download_url` points at the result CSV "
    "`token,expiration_year,expiration_month,new_token,new_expiration_year,new_expiration_month,result_code` "
    "(rows in file order; rows without an update omitted; expirations two digits: the row's, else the token's; "
    "an `UPD_*` row creates a new card token with the new number and/or expiration, keeping the old token's "
    "containers, metadata and cardholder name, reported as `new_token`; the old token is untouched). A token cell "
    "naming no live card token of the tenant is `ERR_INVALID_TOKEN`; malformed expiration cells are "
    "`ERR_INVALID_EXP_DATE`. Completed and failed jobs deliver `account-updater.job.completed` with "
    "`{job: {id, status}}`; the new tokens deliver `token.created` too. Jobs and results are kept."
)


@api.route(
    "POST",
    "/account-updater/jobs",
    permission="account-updater:job:create",
    status=201,
    response=JobOut,
    tag=TAG,
    summary="Create an account updater job",
    description="No body (any body is ignored). Answers 201 with a `pending` job carrying `upload_url` and "
    "`expires_at`.\n\n" + _PROCESS,
)
async def create(call: Call):
    """``POST /account-updater/jobs``."""
    return await call.db(service.create_job, call.caller)


@api.route(
    "GET",
    "/account-updater/jobs",
    permission="account-updater:job:read",
    query=ListQuery,
    response=JobPage,
    tag=TAG,
    summary="List account updater jobs",
    errors=(400,),
    description="Cursor pagination, newest first; `size` 1 to 100, default 20; `start` is `pagination.next`. "
    "Expired pending jobs are not listed.",
)
async def list_(call: Call):
    """``GET /account-updater/jobs``."""
    q = call.query
    data, following = await call.db(service.list_jobs, call.caller, size=q.size, after=decode_cursor(call, q.start))
    return cursor_page(call, data, size=q.size, next_position=following)


@api.route(
    "GET",
    "/account-updater/jobs/{id}",
    permission="account-updater:job:read",
    response=JobOut,
    tag=TAG,
    summary="Get an account updater job (poll it)",
    errors=(404,),
    description="404 for an unknown job, another tenant's, or a job still pending after its upload window "
    "(it is removed). Each `upload_url`/`download_url` is signed afresh by the read.\n\n" + _PROCESS,
)
async def get(call: Call):
    """``GET /account-updater/jobs/{id}``."""
    return await call.db(service.read_job, call.caller, call.uuid_param(what="account updater job"))


@api.route(
    "POST",
    "/account-updater/notifications/s3",
    auth=False,
    status=204,
    tag=TAG,
    summary="Receive an S3 ObjectCreated notification",
    errors=(400, 415),
    body=S3Notification,
    request_content_type=("application/json", "text/plain"),
    description="This implementation's addition. Point the bucket's event notifications (ObjectCreated) here through "
    "a bridge that POSTs JSON (`application/json` or `text/plain`), e.g. an SNS HTTP subscription (the "
    "`Notification` envelope is opened; a `SubscriptionConfirmation` is logged with its SubscribeURL for an "
    "operator to confirm), EventBridge API destinations or a MinIO webhook target; the body is the S3 event "
    '`{"Records": [{"eventName": "ObjectCreated:Put", "s3": {"bucket": {"name"}, "object": '
    '{"key"}}}]}`. No API key: a '
    "notification is only a hint, the platform checks the object itself before starting the job, and the "
    "answer is 204 whatever the records name. Without notifications the sweep finds files within seconds.",
)
async def s3_notification(call: Call):
    """``POST /account-updater/notifications/s3``: a hint that a request file was uploaded."""
    await call.db(service.notify_objects, call.payload)
