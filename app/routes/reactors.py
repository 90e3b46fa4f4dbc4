"""Reactors: ``/reactors`` and their invocation, and the shut-down ``/reactor-formulas`` (core document
sections 2, 4, 7, 8 and 9)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from app.api import Api, Call
from app.pagination import OffsetPage, offset_page, offset_query
from app.schemas import Audited, RequestModel, ResponseModel
from domain.reactors import runs, service
from infra.errors import Problem, validation_errors, validation_problem
from storage.states import ReactorRunStatus, ReactorState

api = Api()
TAG = "Reactors"
MERGE_PATCH = "application/merge-patch+json"


class RuntimeOut(ResponseModel):
    image: Literal["node22"]
    dependencies: dict[str, str]
    resolutions: dict[str, str]
    timeout: int
    resources: Literal["standard", "large", "xlarge"]
    warm_concurrency: int
    permissions: list[str]


class VulnerabilityOut(ResponseModel):
    name: str
    version: str
    severity: Literal["LOW", "MEDIUM", "HIGH", "CRITICAL"]
    id: str
    dependency_path: list[str]


class ErrorDetailsOut(ResponseModel):
    vulnerabilities: list[VulnerabilityOut] | None = None


class PendingReactorOut(ResponseModel):
    code: str
    runtime: RuntimeOut
    configuration: dict[str, str]


class RequestedOut(ResponseModel):
    reactor: PendingReactorOut
    error_code: str | None = Field(
        None,
        description="`vulnerabilities_detected`; `invalid_code` (a decision of this "
        "implementation) when the code does not load (a syntax error, a failing "
        "`require`, no "
        "exported function), `error_message` saying why and on which line; or "
        "`build_failed` when npm could not install the dependencies or no vulnerability "
        "scan could be made (a registry that refuses the scan with a 4xx fails the build "
        "at once, naming the `TESSERA_REACTOR_ADVISORIES` setting).",
    )
    error_message: str | None = None
    error_details: ErrorDetailsOut | None = None


class ReactorOut(Audited):
    id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    state: ReactorState
    code: str
    configuration: dict[str, str]
    runtime: RuntimeOut
    requested: RequestedOut | None = None


ReactorBody = service.ReactorRequest
BODY_TEXT = (
    "Body: `name` (1-200 characters), `code` (at most 50,000 characters), `configuration` (map of strings), "
    "`runtime` (`image` `node22`; `dependencies` and `resolutions` map npm names to exact versions; `timeout` "
    "1-30 s, default 10; `resources` standard, large or xlarge; `warm_concurrency` 0-10; `permissions` granted "
    "to the code, legacy names mapped). An omitted runtime or image, or `node-svc`, answers 400 (deprecated "
    "October 5, 2026); `application.id` answers 400 (node-svc only).\n\n"
)


def _parse(payload: Any) -> service.ReactorRequest:
    """A merged body validated like a PUT body (400 with per-field errors)."""
    try:
        return service.ReactorRequest.model_validate(payload)
    except ValidationError as exc:
        raise validation_problem(validation_errors(exc)) from None


BUILD_TEXT = (
    "Asynchronous (node22): the answer shows the reactor `creating` (or `updating`) with the version in "
    "`requested`; a build job installs the pinned dependencies (npm, scripts disabled) and scans them for known "
    "vulnerabilities, then the reactor is `active`, or `failed` (create) / `outdated` (update: the previous "
    "version keeps serving) with `requested.error_code` `vulnerabilities_detected` and "
    "`requested.error_details.vulnerabilities` when a HIGH or CRITICAL advisory applies. The build then loads the "
    "code once in the sandbox: code that does not load is refused the same way with `requested.error_code` "
    "`invalid_code` (a decision of this implementation: a syntax error fails the build rather than every invocation). "
    "Update and delete answer "
    "409 while a build runs (`creating`, `updating`). An update of a reactor whose creation failed is a new "
    "creation (`creating`). The name applies at once."
)

ListQuery = offset_query(100, id=(list[uuid.UUID], Field(default_factory=list)), name=(str | None, None))


@api.route(
    "POST",
    "/reactors",
    permission="reactor:create",
    body=ReactorBody,
    status=201,
    response=ReactorOut,
    tag=TAG,
    summary="Create a reactor",
    errors=(400, 401, 403),
    description=BODY_TEXT + BUILD_TEXT,
)
async def create(call: Call):
    return await call.db(service.create_reactor, call.caller, call.body)


@api.route(
    "GET",
    "/reactors",
    permission="reactor:read",
    query=ListQuery,
    response=OffsetPage[ReactorOut],
    tag=TAG,
    summary="List reactors",
    errors=(400, 401, 403),
    description="Offset pagination, oldest first; `id` (repeatable) keeps those ids; `name` is a wildcard "
    "(`*` matches any characters; without `*` the name contains it; case-insensitive).",
)
async def list_(call: Call):
    q = call.query
    data, total = await call.db(service.list_reactors, call.caller, ids=q.id, name=q.name, page=q.page, size=q.size)
    return offset_page(data, total=total, page=q.page, size=q.size)


@api.route(
    "GET",
    "/reactors/{id}",
    permission="reactor:read",
    response=ReactorOut,
    tag=TAG,
    summary="Get a reactor",
    errors=(401, 403, 404),
)
async def get(call: Call):
    return await call.db(service.read_reactor, call.caller, call.params["id"])


@api.route(
    "PUT",
    "/reactors/{id}",
    permission="reactor:update",
    body=ReactorBody,
    response=ReactorOut,
    tag=TAG,
    summary="Update a reactor",
    errors=(400, 401, 403, 404, 409),
    description=BODY_TEXT + BUILD_TEXT,
)
async def update(call: Call):
    return await call.db(service.update_reactor, call.caller, call.params["id"], call.body)


@api.route(
    "PATCH",
    "/reactors/{id}",
    permission="reactor:update",
    body=Annotated[
        dict[str, Any],
        Field(description="An RFC 7396 merge patch of name, code, configuration and runtime; every field optional."),
    ],
    request_content_type=MERGE_PATCH,
    status=204,
    tag=TAG,
    summary="Update a reactor (merge patch)",
    errors=(400, 401, 403, 404, 409, 415),
    description="Content-Type must be `application/merge-patch+json` (415 otherwise). The patch merges over "
    "the latest version asked for (the pending or refused one, else the serving one) and the result is "
    "validated like a PUT body. Answers 204. " + BUILD_TEXT,
)
async def patch(call: Call):
    await call.db(service.patch_reactor, call.caller, call.params["id"], call.payload, parse=_parse)


@api.route(
    "DELETE",
    "/reactors/{id}",
    permission="reactor:delete",
    status=204,
    tag=TAG,
    summary="Delete a reactor",
    errors=(401, 403, 404, 409),
    description="409 while a build runs (`creating`, `updating`).",
)
async def delete(call: Call):
    await call.db(service.delete_reactor, call.caller, call.params["id"])


# ---- invocation ----------------------------------------------------------------------------------


class ReactIn(RequestModel):
    args: Any = Field(
        None,
        description="Any JSON; `{{ ... }}` expressions are detokenized (the proxy's forms) "
        "with the caller's rights to use each token.",
    )
    callback_url: Any = Field(
        None, description="Shut down on January 15, 2025: 400. Use react-async and the reactor webhook events."
    )


class ReactorResponseOut(ResponseModel):
    tokens: Any = Field(
        None,
        description="The tokens made from the `tokenize` block of the code's answer "
        "(the structure of the block, each token request replaced by its token).",
    )
    raw: Any = Field(None, description="The `raw` output of the code.")


class AsyncReactOut(ResponseModel):
    async_reactor_request_id: uuid.UUID


INVOKE_ERRORS = (
    "Errors, in the problem format: 400 (`BadRequestError`, `InvalidReactorConfigurationError` thrown "
    "by the code, or arguments that do not detokenize), 401 (`AuthenticationError`, `AuthorizationError`), 402 "
    "(`InvalidPaymentMethodError`), 422 (code that is not a valid function), 429 (`RateLimitError`), 500 (any "
    "other thrown value, `VendorError`, the runtime timeout, a process that ran out of memory). Of any other "
    "thrown value the `detail` gives the name and the first line of the message (at most 500 characters), each "
    "string of the request it quotes replaced by `[redacted]` (a decision of this implementation). 409 while no "
    "version serves (`creating`, or a creation that `failed`). A `tokenize` block in the code's answer is "
    "tokenized with the permissions granted to the code (`runtime.permissions`)."
)


def _refuse_callback(call: Call) -> None:
    if call.body.callback_url is not None:
        raise validation_problem(
            {
                "callback_url": [
                    "callback_url was shut down on January 15, 2025; use POST /reactors/{id}/react-async "
                    "and the reactor.invocation.completed / reactor.invocation.failed webhook events."
                ]
            }
        )


@api.route(
    "POST",
    "/reactors/{id}/react",
    permission="reactor:invoke",
    body=ReactIn,
    body_optional=True,
    response=ReactorResponseOut,
    tag=TAG,
    summary="Invoke a reactor and wait for its answer",
    errors=(400, 401, 402, 403, 404, 409, 413, 422, 429, 500, 504),
    description="Runs the code in a worker and waits for its answer up to 30 seconds "
    "(`TESSERA_REACTOR_WAIT_SECONDS`); the body "
    "is at most 1 MB (413 beyond). Answers `{tokens, raw}`. When no answer came within the wait (a queue "
    "backlog: the runtime timeout itself is at most 30 s) the answer is 504 with `request_id`: the result "
    "will be at GET /reactors/{id}/results/{request_id}. " + INVOKE_ERRORS,
)
async def react(call: Call):
    _refuse_callback(call)
    run = await call.db(runs.start_run, call.caller, call.params["id"], args=call.body.args, kind=runs.REACT)
    await call.wait_for_jobs([run.job_id], timeout=call.settings.reactor_wait_seconds)
    status, answer = await call.db(runs.settled_answer, run.id)
    if status == ReactorRunStatus.PENDING:
        raise Problem(
            504,
            "The reactor did not answer within the synchronous wait; its result will be at "
            f"GET /reactors/{run.reactor_id}/results/{run.id}.",
            title="Reactor Timeout",
            extra={"request_id": str(run.id)},
        )
    return answer


@api.route(
    "POST",
    "/reactors/{id}/react-async",
    permission="reactor:invoke",
    body=ReactIn,
    body_optional=True,
    status=202,
    response=AsyncReactOut,
    tag=TAG,
    summary="Invoke a reactor without waiting",
    errors=(400, 401, 403, 404, 409, 413),
    description="Answers 202 at once with `async_reactor_request_id`; the answer (or its problem) is at "
    "GET /reactors/{id}/results/{request_id} once the invocation ended, and the event "
    "`reactor.invocation.completed` or `reactor.invocation.failed` carries `{reactor_id, request_id, status}`.",
)
async def react_async(call: Call):
    _refuse_callback(call)
    run = await call.db(runs.start_run, call.caller, call.params["id"], args=call.body.args, kind=runs.ASYNC)
    return {"async_reactor_request_id": run.id}


@api.route(
    "GET",
    "/reactors/{id}/results/{request_id}",
    permission="reactor:invoke",
    response=ReactorResponseOut,
    tag=TAG,
    summary="Get the result of an asynchronous invocation",
    errors=(400, 401, 402, 403, 404, 422, 429, 500),
    description="404 until the invocation has ended; then its answer `{tokens, raw}`, or the problem it ended "
    "in with that problem's status (the answer the synchronous react would have given).",
)
async def result(call: Call):
    return await call.db(runs.read_result, call.caller, call.params["id"], call.params["request_id"])


# ---- reactor formulas: shut down -------------------------------------------------------------------

FORMULAS_GONE = (
    "Reactor formulas were shut down on February 14, 2024; use reactors with a code attribute (POST /reactors)."
)


FORMULAS_TEXT = (
    "Shut down on February 14, 2024: answers 410 whatever the key or body. Replacement: reactors with a code attribute."
)


def _formulas_route(method: str, path: str, summary: str):
    return api.route(
        method,
        path,
        status=410,
        tag=TAG,
        summary=summary,
        errors=(410,),
        deprecated=True,
        auth=False,
        description=FORMULAS_TEXT,
    )


def _gone() -> Problem:
    return Problem(410, FORMULAS_GONE, title="Gone")


@_formulas_route("POST", "/reactor-formulas", "Create a reactor formula (shut down)")
async def create_formula(call: Call):
    raise _gone()


@_formulas_route("GET", "/reactor-formulas", "List reactor formulas (shut down)")
async def list_formulas(call: Call):
    raise _gone()


@_formulas_route("GET", "/reactor-formulas/{id}", "Get a reactor formula (shut down)")
async def get_formula(call: Call):
    raise _gone()


@_formulas_route("PUT", "/reactor-formulas/{id}", "Update a reactor formula (shut down)")
async def update_formula(call: Call):
    raise _gone()
