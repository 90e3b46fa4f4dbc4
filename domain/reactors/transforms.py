"""Proxy code transforms on the reactor runtime (core document section 4, Proxy rule 10; section 7,
proxy errors).

:func:`code_transform_runner` gives the proxy a :data:`CodeRunner`: it records the transform's run as
a job (the path ``react`` takes, :mod:`domain.reactors.runs`), waits for a worker to run the code in
its warm Node.js process, and returns the new message. The code's function receives
``{args: {body, headers}, configuration}`` (``body`` parsed JSON when it is JSON, else the text;
``headers`` a map of name to value; ``configuration`` the proxy's) and returns ``{body, headers}``:
a member left out keeps its value, a body that is not a string is written as JSON, a function that
returns nothing leaves the message unchanged.

Failures are ``proxy_error`` (:class:`~domain.proxy.errors.ProxyError`): the code's thrown error or
timeout with its status (section 7's classes) and the title ``Proxy transform failed``; 503
``Proxy request transform is initializing`` when no worker answered within the wait (a cold runtime
still installing its dependencies: retry shortly); 403 ``Proxy invocation blocked`` when the
transform's dependencies have an unremediated CRITICAL vulnerability (nothing runs).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from config.settings import get_settings
from domain.proxy.errors import TRANSFORM_FAILED, TRANSFORM_INITIALIZING, ProxyError
from domain.proxy.transforms import CodeTransform, Message
from domain.reactors import runs
from domain.tenancy.caller import Caller
from infra.errors import Problem
from infra.wait import JobWaits, Outcome, read_outcomes
from storage.db import session_scope
from storage.states import ReactorRunStatus

CodeRunner = Callable[[CodeTransform, Message, str], Awaitable[Message]]
"""Runs one code transform on a message; the third argument is ``"request"`` or ``"response"``."""
#: ``db(fn, *args, **kwargs)``: runs ``fn(session, *args, **kwargs)`` in one transaction (``Call.db``).
Db = Callable[..., Awaitable[Any]]
#: ``wait(job_ids, timeout=seconds)``: waits for the jobs to settle (``Call.wait_for_jobs``).
Wait = Callable[..., Awaitable[dict[uuid.UUID, Outcome]]]
INVOCATION_BLOCKED = runs.INVOCATION_BLOCKED


async def _db(fn: Callable[..., Any], /, *args, **kwargs) -> Any:
    def unit() -> Any:
        with session_scope() as session:
            return fn(session, *args, **kwargs)

    return await asyncio.to_thread(unit)


def code_transform_runner(
    caller: Caller,
    *,
    proxy_id: object,
    configuration: dict[str, str] | None = None,
    db: Db | None = None,
    wait: Wait | None = None,
    timeout: float | None = None,
) -> CodeRunner:
    """A :data:`CodeRunner` for one invocation by ``caller`` of the proxy ``proxy_id``.

    ``proxy_id``: the proxy whose transforms run (its processes serve it alone, never another
    proxy or tenant with the same code). ``configuration``: the proxy's configuration map, given to
    the code. ``db`` and ``wait``: the request's ``Call.db`` and ``Call.wait_for_jobs`` in the api
    (woken by the job's outcome message); by default a thread with its own unit of work and a
    database poll. ``timeout``: seconds to wait
    for the worker (default ``TESSERA_REACTOR_WAIT_SECONDS``, 30). Raises
    :class:`~domain.proxy.errors.ProxyError` as the module says.
    """
    db = db or _db
    if wait is None:
        waits = JobWaits(None, poll_seconds=get_settings().job_wait_poll_seconds)

        async def wait(job_ids, *, timeout: float):
            return await waits.wait(job_ids, lambda ids: db(read_outcomes, ids), timeout=timeout)

    async def run(transform: CodeTransform, message: Message, side: str) -> Message:
        where = f"{side}_transforms"
        request = {
            "args": {"body": _body_value(message, where), "headers": dict(message.headers)},
            "configuration": dict(configuration or {}),
        }
        started = await db(
            runs.start_transform,
            caller,
            proxy_id=proxy_id,
            code=transform.code,
            runtime=transform.runtime,
            request=request,
        )
        await wait([started.job_id], timeout=timeout or get_settings().reactor_wait_seconds)
        try:
            status, answer = await db(runs.settled_answer, started.id)
        except Problem as problem:
            title = INVOCATION_BLOCKED if problem.title == INVOCATION_BLOCKED else TRANSFORM_FAILED
            detail = problem.detail or problem.title
            raise ProxyError(
                problem.status, detail, title=title, errors={where: [detail], **(problem.errors or {})}
            ) from None
        if status == ReactorRunStatus.PENDING:
            raise ProxyError(
                503,
                "The code transform's runtime is initializing; retry shortly.",
                title=TRANSFORM_INITIALIZING,
                errors={where: ["runtime initializing"]},
            )
        return _message(message, answer.get("value"), where)

    return run


def _body_value(message: Message, where: str) -> Any:
    if not message.body:
        return None
    try:
        text = message.body.decode("utf-8")
    except UnicodeDecodeError:
        raise ProxyError(
            400,
            "The body is not UTF-8 text, so a code transform cannot read it.",
            title=TRANSFORM_FAILED,
            errors={where: ["body is not UTF-8 text"]},
        ) from None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message(message: Message, value: Any, where: str) -> Message:
    """The new message from what the code returned."""
    if value is None:
        return message
    if not isinstance(value, dict):
        detail = "A code transform must return an object with body and/or headers."
        raise ProxyError(500, detail, title=TRANSFORM_FAILED, errors={where: [detail]})
    body = message.body
    if "body" in value:
        new = value["body"]
        body = (
            None
            if new is None
            else new.encode("utf-8")
            if isinstance(new, str)
            else json.dumps(new, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        )
    headers = message.headers
    if "headers" in value:
        given = value["headers"]
        pairs = given.items() if isinstance(given, dict) else given if isinstance(given, list) else None
        try:
            if pairs is None:
                raise TypeError("headers are neither an object nor a list of pairs")
            headers = [(str(name), str(item)) for name, item in pairs]
        except (TypeError, ValueError):
            detail = "A code transform's headers must be an object of names to values."
            raise ProxyError(500, detail, title=TRANSFORM_FAILED, errors={where: [detail]}) from None
        if any(ch in name + item for name, item in headers for ch in "\r\n\0"):
            detail = "A code transform's header may not hold line breaks or NUL."
            raise ProxyError(500, detail, title=TRANSFORM_FAILED, errors={where: [detail]})
    return Message(headers, body, message.content_type)
