"""Reactors: create, read, list, update, merge-patch, delete; their builds as jobs.

Core document section 2 (Reactor, Runtime and Requested objects), section 3 (states), section 4
(Reactors: permissions ``reactor:create``, ``reactor:read``, ``reactor:update``, ``reactor:delete``),
section 8 (name max 200, code max 50,000 characters) and section 9 (``node-svc`` and an omitted image
answer 400 since October 5, 2026; ``application.id`` belongs to ``node-svc`` only).

States of a ``node22`` reactor (the spec names ``creating``, ``updating``, ``failed`` and ``outdated``;
the rest is ours):

* create: ``creating`` (the configuration pending in ``requested``), then the build job
  (``reactors.build``) ends it ``active``, or ``failed`` with ``requested.error_code``;
* update (PUT or PATCH) of a reactor that serves: ``updating``, then ``active`` (the new version
  serves) or ``outdated`` (the previous version keeps serving; ``requested`` keeps the refused one);
  an update of a reactor whose creation failed is a new creation (``creating``);
* update and delete are refused (409) while a build runs (``creating``, ``updating``);
* an update that asks for the version that serves (a rename, or a return from ``outdated``) builds
  nothing: the reactor is ``active`` at once.

The ``name`` is not part of a version: a new name applies at once. Functions run inside the caller's
unit of work (``fn(session, caller, ...)``) and never commit; every change and single read writes a
log row (entity type ``reactor``). ``configuration`` (often vendor credentials) is sealed under the
tenant's data key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import func
from sqlmodel import Session, col, select

from domain.reactors.runtime import Build, Runtime, require_sandbox
from domain.reactors.runtime import Reactor as RuntimeReactor
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import require_grantable
from domain.tokens.validation import merge_patch
from infra import jobs
from infra.errors import Problem, validation_problem
from infra.lookup import get_owned
from infra.node_runtime.owners import REACTOR, end_owner_after_commit
from infra.node_runtime.packages import AuditRefused
from storage.crypto import get_keyring
from storage.models import Job
from storage.models_reactors import Reactor
from storage.states import ReactorState
from storage.types import utcnow

ENTITY_TYPE = "reactor"
CONFIGURATION_PURPOSE = "reactor-configuration"
BUILD_TASK = "reactors.build"
MAX_CODE_LENGTH = 50_000
"""Longest reactor code, in characters (section 8)."""
MAX_CONFIGURATION_ENTRIES = 100

#: The states in which a reactor may be updated or deleted (no build is running).
SETTLED_STATES = (ReactorState.ACTIVE, ReactorState.FAILED, ReactorState.OUTDATED)
VULNERABILITIES_DETECTED = "vulnerabilities_detected"
BUILD_FAILED = "build_failed"
#: ``requested.error_code`` of a version whose code did not load in the sandbox at its build (ours).
INVALID_CODE = "invalid_code"


class ApplicationRef(BaseModel):
    """``application`` of a node-svc reactor: refused for node22 (a node22 reactor
    runs with the permissions of its runtime)."""

    id: Any = None

    @field_validator("id", mode="before")
    @classmethod
    def _node_svc_only(cls, value: Any) -> Any:
        raise ValueError(
            "application.id is accepted only for the node-svc runtime; node22 code gets its rights "
            "from runtime.permissions"
        )


class ReactorRequest(BaseModel):
    """The body of ``POST /reactors`` and ``PUT /reactors/{id}``, and the result of a
    merge patch. An omitted ``runtime`` or image is the deprecated ``node-svc`` (400 at
    ``runtime.image``); legacy permission names in ``runtime.permissions`` are mapped to their
    granular names; ``application`` is refused (``node-svc`` only). Raises pydantic's
    ``ValidationError``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    code: str = Field(min_length=1, max_length=MAX_CODE_LENGTH)
    configuration: dict[str, str] = Field(default_factory=dict, max_length=MAX_CONFIGURATION_ENTRIES)
    runtime: Runtime = Field(default_factory=dict, validate_default=True)
    application: ApplicationRef | None = None

    @field_validator("runtime", mode="before")
    @classmethod
    def _omitted_image(cls, value: Any) -> Any:
        return {} if value is None else value


#: Validates a merged body (``PATCH``): returns the request or raises the 400 problem of its errors.
Parse = Callable[[Any], ReactorRequest]


# ---- storage helpers -----------------------------------------------------------------------------


def _seal(session: Session, tenant_id: uuid.UUID, reactor_id: uuid.UUID, configuration: dict[str, str]) -> bytes | None:
    if not configuration:
        return None
    plain = json.dumps(configuration, separators=(",", ":"), ensure_ascii=False).encode()
    return get_keyring().encrypt(session, tenant_id, CONFIGURATION_PURPOSE, str(reactor_id), plain)


def _open(session: Session, reactor: Reactor, sealed: bytes | None) -> dict[str, str]:
    if sealed is None:
        return {}
    return json.loads(get_keyring().decrypt(session, reactor.tenant_id, CONFIGURATION_PURPOSE, str(reactor.id), sealed))


def configuration_of(session: Session, reactor: Reactor) -> dict[str, str]:
    """The configuration of the version that serves (plain)."""
    return _open(session, reactor, reactor.configuration_ct)


def runtime_of(reactor: Reactor) -> Runtime:
    """The :class:`Runtime` of the version that serves."""
    return Runtime.model_validate(reactor.runtime)


def _runtime_json(runtime: Runtime) -> dict:
    return runtime.model_dump(mode="json")


def reactor_view(session: Session, reactor: Reactor) -> dict:
    """The Reactor object: ``id, tenant_id, name, state, code, configuration, runtime, requested
    (while a version is pending or refused: {reactor: {code, runtime, configuration}, error_code,
    error_message, error_details}), created_by, created_at, modified_by, modified_at``."""
    view: dict[str, Any] = {
        "id": reactor.id,
        "tenant_id": reactor.tenant_id,
        "name": reactor.name,
        "state": reactor.state,
        "code": reactor.code,
        "configuration": configuration_of(session, reactor),
        "runtime": reactor.runtime,
        "created_by": reactor.created_by,
        "created_at": reactor.created_at,
        "modified_by": reactor.modified_by,
        "modified_at": reactor.modified_at,
    }
    if reactor.requested is not None:
        requested = dict(reactor.requested)
        requested["reactor"] = {
            **requested.get("reactor", {}),
            "configuration": _open(session, reactor, reactor.requested_configuration_ct),
        }
        view["requested"] = requested
    return view


def get_reactor(session: Session, caller: Caller, reactor_id: object, *, lock: bool = False) -> Reactor:
    """The caller's tenant's reactor ``reactor_id``; 404 when absent, malformed or another tenant's."""
    return get_owned(session, Reactor, reactor_id, caller.tenant_id, what="reactor", lock=lock)


def _request_build(session: Session, caller: Caller, reactor: Reactor, request: ReactorRequest) -> None:
    """Put ``request``'s version in ``requested`` and record its build job."""
    reactor.requested = {"reactor": {"code": request.code, "runtime": _runtime_json(request.runtime)}}
    reactor.requested_configuration_ct = _seal(session, reactor.tenant_id, reactor.id, request.configuration)
    if reactor.deployed_at is None:
        reactor.state = ReactorState.CREATING
        reactor.code = request.code
        reactor.runtime = _runtime_json(request.runtime)
        reactor.configuration_ct = reactor.requested_configuration_ct
    else:
        reactor.state = ReactorState.UPDATING
    session.add(reactor)
    session.flush()
    job = jobs.record(
        session,
        kind=BUILD_TASK,
        tenant_id=reactor.tenant_id,
        subject_type="reactor",
        subject_id=str(reactor.id),
        trace_id=caller.trace_id,
    )
    reactor.build_job_id = job.id


# ---- CRUD ----------------------------------------------------------------------------------------


def create_reactor(session: Session, caller: Caller, request: ReactorRequest) -> dict:
    """``POST /reactors``: store the reactor ``creating`` and record its build; its object.
    403 without ``reactor:create``."""
    caller.require("reactor:create")
    _check_grants(caller, request)
    reactor = Reactor(
        tenant_id=caller.tenant_id,
        name=request.name,
        state=ReactorState.CREATING,
        code=request.code,
        runtime=_runtime_json(request.runtime),
        created_by=caller.application_id,
    )
    session.add(reactor)
    session.flush()
    _request_build(session, caller, reactor, request)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=reactor.id, operation="create")
    return reactor_view(session, reactor)


def read_reactor(session: Session, caller: Caller, reactor_id: object) -> dict:
    """``GET /reactors/{id}``: 403 without ``reactor:read``; 404."""
    caller.require("reactor:read")
    reactor = get_reactor(session, caller, reactor_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=reactor.id, operation="read")
    return reactor_view(session, reactor)


def list_reactors(
    session: Session, caller: Caller, *, ids: list[uuid.UUID], name: str | None, page: int, size: int
) -> tuple[list[dict], int]:
    """``GET /reactors``: one page (oldest first) and the total. ``ids`` keeps those ids; ``name``
    is a wildcard: ``*`` matches any run of characters, and a name without ``*`` matches reactors
    whose name contains it (case-insensitive). 403 without ``reactor:read``."""
    caller.require("reactor:read")
    query = select(Reactor).where(Reactor.tenant_id == caller.tenant_id)
    if ids:
        query = query.where(col(Reactor.id).in_(ids))
    if name:
        escaped = name.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = escaped.replace("*", "%") if "*" in name else f"%{escaped}%"
        query = query.where(func.lower(Reactor.name).like(pattern, escape="\\"))
    total = session.exec(select(func.count()).select_from(query.subquery())).one()
    rows = session.exec(
        query.order_by(col(Reactor.created_at), col(Reactor.id)).offset((page - 1) * size).limit(size)
    ).all()
    return [reactor_view(session, r) for r in rows], total


def _settled(session: Session, reactor: Reactor, action: str) -> None:
    """409 while a build runs; a build job that ended without writing its outcome (cancelled by an
    operator) no longer holds the reactor."""
    if reactor.state in SETTLED_STATES:
        return
    build = session.get(Job, reactor.build_job_id) if reactor.build_job_id else None
    if build is None or build.status not in jobs.TERMINAL:
        raise Problem(
            409,
            f"The reactor cannot be {action} while it is {reactor.state}; retry once its build has ended.",
            title="Conflict",
        )


def _serves(session: Session, reactor: Reactor, request: ReactorRequest) -> bool:
    """True when ``request`` asks for the version that serves already (same code, runtime and
    configuration)."""
    return (
        reactor.deployed_at is not None
        and reactor.code == request.code
        and reactor.runtime == _runtime_json(request.runtime)
        and configuration_of(session, reactor) == request.configuration
    )


def _check_grants(caller: Caller, request: ReactorRequest) -> None:
    """403 when ``runtime.permissions`` names a permission the calling key does not hold: the code
    acts with these rights (its ``tokenize`` answer), so they can be no more than its creator's.
    Then 503 where customer code cannot be confined (nothing would ever build or run)."""
    require_grantable(
        caller.permissions, request.runtime.permissions, field="runtime.permissions", what="a reactor's code"
    )
    require_sandbox()


def _update(session: Session, caller: Caller, reactor: Reactor, request: ReactorRequest) -> dict:
    _check_grants(caller, request)
    _settled(session, reactor, "updated")
    reactor.name = request.name
    reactor.modified_by = caller.application_id
    reactor.modified_at = utcnow()
    if _serves(session, reactor, request):  # a rename, or back to the serving version: nothing to build
        reactor.state = ReactorState.ACTIVE
        reactor.requested = None
        reactor.requested_configuration_ct = None
        reactor.build_job_id = None
        session.add(reactor)
    else:
        _request_build(session, caller, reactor, request)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=reactor.id, operation="update")
    return reactor_view(session, reactor)


def update_reactor(session: Session, caller: Caller, reactor_id: object, request: ReactorRequest) -> dict:
    """``PUT /reactors/{id}``: request a new version (``updating``, or ``creating`` when none ever
    served). 403 without ``reactor:update``; 404; 409 while a build runs."""
    caller.require("reactor:update")
    return _update(session, caller, get_reactor(session, caller, reactor_id, lock=True), request)


def patch_reactor(session: Session, caller: Caller, reactor_id: object, patch: Any, *, parse: Parse) -> None:
    """``PATCH /reactors/{id}``: an RFC 7396 merge patch over the latest version asked for (the
    pending or refused one in ``requested``, else the serving one), validated like a PUT body
    (400, nothing changed). 403, 404, 409 as :func:`update_reactor`."""
    caller.require("reactor:update")
    if not isinstance(patch, dict):
        raise validation_problem({"body": ["A merge patch must be a JSON object."]})
    reactor = get_reactor(session, caller, reactor_id, lock=True)
    _settled(session, reactor, "updated")
    latest = (reactor.requested or {}).get("reactor")
    current = {
        "name": reactor.name,
        "code": latest["code"] if latest else reactor.code,
        "runtime": latest["runtime"] if latest else reactor.runtime,
        "configuration": _open(
            session, reactor, reactor.requested_configuration_ct if latest else reactor.configuration_ct
        ),
    }
    _update(session, caller, reactor, parse(merge_patch(current, patch)))


def delete_reactor(session: Session, caller: Caller, reactor_id: object) -> None:
    """``DELETE /reactors/{id}``: 403 without ``reactor:delete``; 404; 409 while a build runs."""
    caller.require("reactor:delete")
    reactor = get_reactor(session, caller, reactor_id, lock=True)
    _settled(session, reactor, "deleted")
    session.delete(reactor)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=reactor.id, operation="delete")
    end_owner_after_commit(session, reactor.tenant_id, REACTOR, reactor.id)


# ---- builds (the reactors.build job) --------------------------------------------------------------


def build_input(session: Session, job: Job) -> RuntimeReactor | None:
    """The version the build job ``job`` installs, scans and loads (its code and runtime); None
    when there is nothing to build (the reactor was deleted, or another build replaced this one)."""
    reactor = session.get(Reactor, uuid.UUID(job.subject_id))
    if reactor is None or reactor.build_job_id != job.id or reactor.requested is None:
        return None
    pending = reactor.requested["reactor"]
    return RuntimeReactor(
        id=str(reactor.id),
        code=pending["code"],
        runtime=Runtime.model_validate(pending["runtime"]),
        tenant_id=str(reactor.tenant_id),
        kind=REACTOR,
    )


def audit_refused_message(error: AuditRefused) -> str:
    """Why a build failed when the registry refused the vulnerability scan, and what to set."""
    return (
        f"The vulnerability scan was refused by the npm registry (HTTP {error.status}: {str(error)[:300]}); "
        "it has no advisory service for this platform. Set TESSERA_REACTOR_ADVISORIES to a JSON file of "
        "advisories to scan against instead, or use a registry that answers npm audit."
    )


def _locked_subject(session: Session, job: Job) -> Reactor | None:
    reactor = session.get(Reactor, uuid.UUID(job.subject_id), with_for_update=True)
    if reactor is None or reactor.build_job_id != job.id:
        return None
    return reactor


def _refuse(reactor: Reactor, error_code: str, message: str, details: dict | None) -> None:
    reactor.state = ReactorState.OUTDATED if reactor.deployed_at is not None else ReactorState.FAILED
    reactor.requested = {
        **(reactor.requested or {}),
        "error_code": error_code,
        "error_message": message,
        "error_details": details,
    }


def apply_build(session: Session, job: Job, build: Build | None) -> dict:
    """Write a build's outcome: the requested version serves (``active``), or it is refused with
    ``vulnerabilities_detected`` or ``invalid_code`` (``failed`` on create, ``outdated`` on update:
    the previous version keeps serving). The job result: ``{"status": <state>}``."""
    reactor = _locked_subject(session, job) if build is not None else None
    if build is None or reactor is None:
        return {"skipped": True}
    if build.state == "ok":
        if reactor.requested is None:
            raise LookupError(f"reactor {reactor.id} is building without a requested version")
        pending = reactor.requested["reactor"]
        reactor.code = pending["code"]
        reactor.runtime = pending["runtime"]
        reactor.configuration_ct = reactor.requested_configuration_ct
        reactor.requested = None
        reactor.requested_configuration_ct = None
        reactor.state = ReactorState.ACTIVE
        if reactor.deployed_at is not None:  # the previous version's processes end on every worker
            end_owner_after_commit(session, reactor.tenant_id, REACTOR, reactor.id)
        reactor.deployed_at = utcnow()
    elif build.state == INVALID_CODE:
        _refuse(reactor, INVALID_CODE, build.message or "The reactor code does not load.", None)
    else:
        _refuse(
            reactor,
            VULNERABILITIES_DETECTED,
            "The dependencies have HIGH or CRITICAL vulnerabilities; remediate them (pin fixed versions "
            "or add resolutions) and update the reactor.",
            build.error_details(),
        )
    session.add(reactor)
    return {"status": reactor.state}


def build_failed(session: Session, job: Job, error: Exception) -> None:
    """A build that could not complete (npm could not install the dependencies, or no vulnerability
    scan could be made): ``failed`` / ``outdated`` with ``requested.error_code`` ``build_failed``."""
    reactor = _locked_subject(session, job)
    if reactor is None:
        return
    _refuse(reactor, BUILD_FAILED, f"The build did not complete: {str(error)[:500]}", None)
    session.add(reactor)
