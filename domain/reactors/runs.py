"""Invocations of reactor code, run in workers as jobs (``reactors.run``), never in the api.

Core document section 4 (Reactors: ``react`` and ``react-async``; shapes "not shown", ours), section 6
(the reactor webhook events), section 7 (invocation errors) and section 8 (1 MB payload, 30 s
synchronous wait, runtime timeout 1 to 30 s).

An invocation is a :class:`~storage.models_reactors.ReactorRun` and a job in one transaction
(:func:`start_run`). The worker's job task reads it (:func:`perform_run`): the arguments are
detokenized with the proxy's expression engine (:func:`domain.proxy.detokenize.detokenize`, the
invoker's rights), the code runs in the warm Node.js process of its version
(:mod:`domain.reactors.runtime`), and :func:`apply_run` writes the answer in the job's completing
transaction: the ``tokenize`` block of the code's answer becomes tokens of the tenant (with the
rights of ``runtime.permissions``, the permissions granted to the code), then ``{tokens, raw}`` or
the problem, sealed. ``react-async`` runs emit ``reactor.invocation.completed`` /
``reactor.invocation.failed`` with ``{reactor_id, request_id}``.

A worker killed mid-run: the job's lease expires, the job is queued again, and its next attempt
does not run the code a second time (customer code may have charged a card): the run ends
``failed`` with a 500 saying so. Until then the run is ``pending``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete
from sqlmodel import Session, col, select

from domain.proxy.detokenize import INVOKE, detokenize
from domain.proxy.values import SqlValueLoader
from domain.reactors import service
from domain.reactors.runtime import Reactor as RuntimeReactor
from domain.reactors.runtime import Runtime, reactor_runtime, require_sandbox
from domain.tenancy import audit
from domain.tenancy.auth import row_tenant
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import effective_permissions
from domain.tokens import service as tokens
from domain.webhooks import events
from infra import jobs
from infra.errors import Problem, not_found
from infra.node_runtime import owners
from infra.node_runtime.packages import AuditUnavailable, InstallFailed, dependency_key
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import Job, Tenant
from storage.models_reactors import Reactor, ReactorRun
from storage.states import ReactorRunStatus, ReactorState
from storage.types import utcnow

RUN_TASK = "reactors.run"
RUN_PURPOSE = "reactor-run"
REACT, ASYNC, TRANSFORM = "react", "async", "transform"
INVOCATION_BLOCKED = "Proxy invocation blocked"

#: The states of a reactor that has a version to run.
SERVING_STATES = (ReactorState.ACTIVE, ReactorState.UPDATING, ReactorState.OUTDATED)


# ---- sealing and the invoker ---------------------------------------------------------------------


def _seal(session: Session, tenant_id: uuid.UUID, run_id: uuid.UUID, value: Any) -> bytes:
    plain = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_jsonable).encode()
    return get_keyring().encrypt(session, tenant_id, RUN_PURPOSE, str(run_id), plain)


def _jsonable(value: Any) -> str:
    """Ids and times of token objects (a ``tokenize`` answer) as JSON text."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _open(session: Session, run: ReactorRun, sealed: bytes) -> Any:
    return json.loads(get_keyring().decrypt(session, run.tenant_id, RUN_PURPOSE, str(run.id), sealed))


def caller_record(caller: Caller) -> dict:
    """What a run keeps of its invoker: ids, type and permission names (never a key)."""
    return {
        "application_id": str(caller.application_id) if caller.application_id else None,
        "application_type": caller.application_type,
        "permissions": sorted(caller.permissions),
        "actor_type": caller.actor_type,
    }


def _invoker(
    tenant: Tenant, record: dict, *, trace_id: str | None, permissions: frozenset[str] | None = None
) -> Caller:
    """The run's invoker again (``permissions`` replaces its rights when given)."""
    application_id = record.get("application_id")
    return Caller(
        tenant_id=tenant.id,
        tenant_type=tenant.type,
        application_id=uuid.UUID(application_id) if application_id else None,
        application_type=record.get("application_type"),
        permissions=permissions if permissions is not None else frozenset(record.get("permissions") or ()),
        tenant_settings=dict(tenant.settings or {}),
        trace_id=trace_id,
        actor_type=record.get("actor_type") or "application",
    )


def problem_record(problem: Problem) -> dict:
    """A problem as a run stores it: ``{status, title, detail, errors}``."""
    return {"status": problem.status, "title": problem.title, "detail": problem.detail, "errors": problem.errors}


def problem_of(record: dict) -> Problem:
    """The :class:`Problem` a run stored (:func:`problem_record`)."""
    return Problem(int(record["status"]), record.get("detail"), title=record.get("title"), errors=record.get("errors"))


# ---- starting a run ------------------------------------------------------------------------------


def start_run(session: Session, caller: Caller, reactor_id: object, *, args: Any, kind: str) -> ReactorRun:
    """Record an invocation of the caller's reactor ``reactor_id`` on ``args`` and its job (sent on
    commit). ``kind`` is :data:`REACT` or :data:`ASYNC`. 403 without ``reactor:invoke``; 404; 503
    where customer code cannot be confined; 409 when no version of the reactor serves yet
    (``creating``, or its creation ``failed``)."""
    caller.require("reactor:invoke")
    reactor = service.get_reactor(session, caller, reactor_id)
    require_sandbox()
    if reactor.deployed_at is None or reactor.state not in SERVING_STATES:
        raise Problem(409, f"The reactor has no version to run yet (state {reactor.state}).", title="Conflict")
    audit.record(session, caller, entity_type=service.ENTITY_TYPE, entity_id=reactor.id, operation="invoke")
    return _record(session, caller, reactor_id=reactor.id, kind=kind, program=None, request={"args": args})


def start_transform(
    session: Session, caller: Caller, *, proxy_id: object, code: str, runtime: dict | None, request: dict
) -> ReactorRun:
    """Record a run of a code transform of the proxy ``proxy_id`` (``code`` on ``runtime``, the
    transform's own) on ``request`` (``{args, configuration}``, what the code receives) and its job.
    503 where customer code cannot be confined."""
    require_sandbox()
    return _record(
        session,
        caller,
        reactor_id=None,
        kind=TRANSFORM,
        program={"proxy_id": str(proxy_id), "code": code, "runtime": runtime},
        request=request,
    )


def _record(
    session: Session, caller: Caller, *, reactor_id: uuid.UUID | None, kind: str, program: dict | None, request: dict
) -> ReactorRun:
    run = ReactorRun(
        tenant_id=caller.tenant_id,
        reactor_id=reactor_id,
        kind=kind,
        program=program,
        caller=caller_record(caller),
        request_ct=b"",
        trace_id=caller.trace_id,
    )
    run.request_ct = _seal(session, caller.tenant_id, run.id, request)
    session.add(run)
    session.flush()
    job = jobs.record(
        session,
        kind=RUN_TASK,
        tenant_id=caller.tenant_id,
        subject_type="reactor_run",
        subject_id=str(run.id),
        trace_id=caller.trace_id,
        max_attempts=1,
    )
    run.job_id = job.id
    session.add(run)
    return run


# ---- the worker side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOutcome:
    """What the code answered (``value``) or the problem the run ended in."""

    value: Any = None
    problem: Problem | None = None


def _transform_reactor(tenant_id: uuid.UUID, program: dict) -> RuntimeReactor:
    """The code transform as the runtime runs it: owned by its tenant and proxy (its processes
    serve that proxy alone; the version digest covers code and runtime)."""
    runtime = Runtime.model_validate({"image": "node22", **(program.get("runtime") or {})})
    return RuntimeReactor(
        program.get("proxy_id") or "-", program["code"], runtime, tenant_id=str(tenant_id), kind=owners.PROXY
    )


def perform_run(job: Job) -> RunOutcome | None:
    """Run the code of the run the job names (outside any transaction but its reads); None when the
    run is gone or already settled. A second attempt (the first one's worker died) does not run the
    code again: it answers the 500 of an interrupted invocation."""
    with session_scope() as session:
        run = session.get(ReactorRun, uuid.UUID(job.subject_id))
        if run is None or run.status != ReactorRunStatus.PENDING:
            return None
        if job.attempts > 1:
            return RunOutcome(
                problem=Problem(
                    500,
                    "The invocation was interrupted (its worker stopped) and was not run again.",
                    title="Reactor Runtime Error",
                )
            )
        tenant = row_tenant(session, run.tenant_id)
        request = _open(session, run, run.request_ct)
        if run.kind == TRANSFORM:
            program = run.program or {}
            try:
                reactor = _transform_reactor(run.tenant_id, program)
            except ValueError as exc:
                return RunOutcome(
                    problem=Problem(
                        400, f"The transform's runtime is invalid: {exc}", title="Invalid Reactor Configuration"
                    )
                )
        else:
            stored = session.get(Reactor, run.reactor_id)
            if stored is None:
                return RunOutcome(problem=not_found("reactor"))
            reactor = RuntimeReactor(
                str(stored.id),
                stored.code,
                service.runtime_of(stored),
                tenant_id=str(stored.tenant_id),
                kind=owners.REACTOR,
            )
            invoker = _invoker(tenant, run.caller, trace_id=run.trace_id)
            try:
                args = detokenize_args(session, invoker, request.get("args"))
            except Problem as problem:
                return RunOutcome(problem=problem)
            request = {"args": args, "configuration": service.configuration_of(session, stored)}
    try:
        if run.kind == TRANSFORM:
            _check_transform_dependencies(reactor.runtime)
            return RunOutcome(value=reactor_runtime().call(reactor, request))
        answer = reactor_runtime().invoke(reactor, args=request["args"], configuration=request["configuration"])
        return RunOutcome(value={"raw": answer.raw, "tokenize": answer.tokenize})
    except Problem as problem:
        return RunOutcome(problem=problem)
    except (InstallFailed, AuditUnavailable) as exc:
        return RunOutcome(
            problem=Problem(
                500, f"The code's dependencies could not be prepared: {str(exc)[:300]}", title="Reactor Runtime Error"
            )
        )


#: Seconds a worker process trusts the scan of a code transform's dependency set.
SCAN_TRUST_SECONDS = 600.0
_scans: dict[tuple[str, str], tuple[float, list]] = {}


def _check_transform_dependencies(runtime: Runtime) -> None:
    """A code transform's dependencies are installed and scanned before its code runs (the scan of
    a dependency set is trusted for :data:`SCAN_TRUST_SECONDS` by a worker process); an unremediated
    CRITICAL vulnerability answers 403 ``Proxy invocation blocked`` (section 7)."""
    if not runtime.dependencies and not runtime.resolutions:
        return
    key = (dependency_key(runtime.dependencies, runtime.resolutions), str(reactor_runtime().advisories))
    known = _scans.get(key)
    if known is None or known[0] < time.monotonic() - SCAN_TRUST_SECONDS:
        known = _scans[key] = (time.monotonic(), reactor_runtime().build(runtime).vulnerabilities)
    critical = [v for v in known[1] if v.severity == "CRITICAL"]
    if critical:
        names = ", ".join(f"{v.name}@{v.version} ({v.id})" for v in critical)
        raise Problem(
            403,
            f"The transform's dependencies have unremediated critical vulnerabilities: {names}.",
            title=INVOCATION_BLOCKED,
        )


def detokenize_args(session: Session, invoker: Caller, args: Any) -> Any:
    """``args`` with its ``{{ ... }}`` expressions replaced by the values they read (the proxy's
    engine on the arguments as a JSON body), with the invoker's rights to use each value
    (``token:<classification>:use:proxy``; holding ``reactor:invoke`` stands for ``proxy:invoke``).
    Raises a :class:`Problem` (400 unknown id or malformed expression, 403 missing right)."""
    body = json.dumps(args, separators=(",", ":"), ensure_ascii=False).encode()
    if b"{{" not in body:
        return args
    caller = dataclasses.replace(invoker, permissions=invoker.permissions | {INVOKE})
    try:
        done = detokenize(caller, SqlValueLoader(session), headers=[], body=body, content_type="application/json")
    except Problem as problem:  # the proxy's wrapped form becomes a plain problem here
        raise Problem(problem.status, problem.detail, title=problem.title, errors=problem.errors) from None
    return json.loads(done.body) if done.body else None


def apply_run(session: Session, job: Job, outcome: RunOutcome | None) -> dict:
    """Write the run's answer in the job's completing transaction: the ``tokenize`` block becomes
    tokens (a problem there fails the run, nothing created), then ``{tokens, raw}`` (or the
    transform's value) or the problem is sealed in the run; ``react-async`` runs emit their event.
    The job result: ``{"status": <HTTP status of the answer>}``."""
    run = session.get(ReactorRun, uuid.UUID(job.subject_id), with_for_update=True) if outcome else None
    if outcome is None or run is None or run.status != ReactorRunStatus.PENDING:
        return {"skipped": True}
    problem = outcome.problem
    answer: Any = None
    if problem is None and run.kind == TRANSFORM:
        answer = {"value": outcome.value}
    elif problem is None:
        answer = {"raw": outcome.value.get("raw")}
        block = outcome.value.get("tokenize")
        if block is not None:
            try:
                with session.begin_nested():
                    answer["tokens"] = tokens.tokenize(session, _code_caller(session, run), block)
            except Problem as raised:
                problem = raised
    _settle(session, run, answer=answer, problem=problem)
    return {"status": problem.status if problem else 200}


def _code_caller(session: Session, run: ReactorRun) -> Caller:
    """Who creates the tokens of a ``tokenize`` block: the invoker's application, with the
    permissions granted to the code (``runtime.permissions``)."""
    reactor = session.get(Reactor, run.reactor_id)
    granted = effective_permissions(service.runtime_of(reactor).permissions) if reactor else frozenset()
    return _invoker(row_tenant(session, run.tenant_id), run.caller, trace_id=run.trace_id, permissions=granted)


def _settle(session: Session, run: ReactorRun, *, answer: Any, problem: Problem | None) -> None:
    run.status = ReactorRunStatus.FAILED if problem else ReactorRunStatus.COMPLETED
    run.error_status = problem.status if problem else None
    run.result_ct = _seal(session, run.tenant_id, run.id, {"problem": problem_record(problem)} if problem else answer)
    run.completed_at = utcnow()
    session.add(run)
    if run.kind == ASYNC:
        events.emit(
            session,
            tenant_id=run.tenant_id,
            type="reactor.invocation.failed" if problem else "reactor.invocation.completed",
            data={
                "reactor_id": str(run.reactor_id),
                "request_id": str(run.id),
                "status": problem.status if problem else 200,
            },
            trace_id=run.trace_id,
        )


def run_failed(session: Session, job: Job, error: Exception) -> None:
    """The run's job failed for good: the run ends ``failed`` with a 500."""
    run = session.get(ReactorRun, uuid.UUID(job.subject_id), with_for_update=True)
    if run is not None and run.status == ReactorRunStatus.PENDING:
        _settle(
            session,
            run,
            answer=None,
            problem=Problem(500, "The invocation could not be run.", title="Reactor Runtime Error"),
        )


# ---- reading a result ----------------------------------------------------------------------------


def run_answer(session: Session, run: ReactorRun) -> Any:
    """A settled run's answer: ``{tokens?, raw}`` (``{"value"}`` for a transform); raises the
    :class:`Problem` it ended in. None while pending."""
    if run.status == ReactorRunStatus.PENDING or run.result_ct is None:
        return None
    stored = _open(session, run, run.result_ct)
    if run.status == ReactorRunStatus.FAILED:
        raise problem_of(stored["problem"])
    return stored


def read_result(session: Session, caller: Caller, reactor_id: object, request_id: object) -> dict:
    """``GET /reactors/{id}/results/{request_id}``: the answer of an invocation of the caller's
    reactor (``{tokens?, raw}``), or the problem it ended in with its status. 404 while it runs,
    and for an unknown id. 403 without ``reactor:invoke``."""
    caller.require("reactor:invoke")
    reactor = service.get_reactor(session, caller, reactor_id)
    try:
        run = session.get(ReactorRun, uuid.UUID(str(request_id)))
    except ValueError:
        run = None
    if (
        run is None
        or run.reactor_id != reactor.id
        or run.tenant_id != caller.tenant_id
        or run.status == ReactorRunStatus.PENDING
    ):
        raise Problem(404, "No result exists for this request id (yet): an invocation answers here once it has ended.")
    return run_answer(session, run)


def settled_answer(session: Session, run_id: uuid.UUID) -> tuple[str, Any]:
    """``(status, answer)`` of run ``run_id`` for the request that started it (``pending`` with
    None while it runs); raises the problem of a failed run."""
    run = session.get(ReactorRun, run_id)
    if run is None:
        raise not_found("reactor")
    return run.status, run_answer(session, run)


# ---- retention -----------------------------------------------------------------------------------

PURGE_TASK = "reactors.purge_results"


def purge_results(session: Session, *, before: dt.datetime, batch: int = 500) -> int:
    """Delete up to ``batch`` settled invocations (their sealed arguments and answers) that ended
    before ``before``; rows locked by a concurrent sweep are skipped. Returns how many; call again
    while it returns ``batch``. A result asked for afterwards answers 404."""
    ids = session.exec(
        select(ReactorRun.id)
        .where(col(ReactorRun.status) != ReactorRunStatus.PENDING, col(ReactorRun.completed_at) < before)
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    if ids:
        session.exec(delete(ReactorRun).where(col(ReactorRun.id).in_(ids)))
    return len(ids)
