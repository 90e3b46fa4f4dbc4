"""The ``node22`` reactor runtime: builds a reactor's dependencies and runs its code.

Core spec section 2 (Reactor, Runtime, Requested and Reactor response objects), section 7 (reactor
invocation errors), section 8 (limits) and section 9 (``node-svc`` refused for new reactors).

* :class:`Runtime` validates the spec's Runtime object.
* :meth:`ReactorRuntime.build` installs the pinned dependencies (cached by dependency set) and scans
  them: ``vulnerabilities_detected`` when a HIGH or CRITICAL advisory applies.
* :meth:`ReactorRuntime.invoke` runs the code in a warm sandboxed Node.js 22 process
  (``infra.node_runtime``) on the request object ``{args, configuration}`` and answers the
  :class:`ReactorResponse` (``raw`` and the ``tokenize`` block for the platform to act on), or
  raises the :class:`~infra.errors.Problem` of section 7.

The code ``require('@tessera/reactor')`` for the error classes of :data:`REACTOR_ERRORS`; the module
ships in ``node_modules/`` beside this file and is the one directory on the process's ``NODE_PATH``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from config.settings import get_settings
from domain.reactors.liveness import dead_keys
from domain.tenancy.permissions import modern_names, permission_errors
from infra.errors import Problem
from infra.node_runtime import packages
from infra.node_runtime.owners import owner_prefix
from infra.node_runtime.pool import NodePool, retire_everywhere
from infra.node_runtime.process import CodeLoadError, InvocationTimeout, NodeRuntimeError, Returned
from infra.node_runtime.sandbox import MemoryLimit, NodeProgram, SandboxUnavailable, availability

#: Where ``@tessera/reactor`` lives (``NODE_PATH`` of every reactor process).
REACTOR_MODULES = Path(__file__).resolve().parent / "node_modules"

#: Memory per ``runtime.resources``: V8 heap and the whole process's writable memory, in MiB.
RESOURCES: dict[str, MemoryLimit] = {
    "standard": MemoryLimit(heap_mib=256, data_mib=768),
    "large": MemoryLimit(heap_mib=512, data_mib=1280),
    "xlarge": MemoryLimit(heap_mib=1024, data_mib=2304),
}

#: The classes of ``@tessera/reactor`` and the status and title each answers (section 7).
REACTOR_ERRORS: dict[str, tuple[int, str]] = {
    "BadRequestError": (400, "Bad Request"),
    "InvalidReactorConfigurationError": (400, "Invalid Reactor Configuration"),
    "AuthenticationError": (401, "Authentication Failed"),
    "AuthorizationError": (401, "Not Authorized"),
    "InvalidPaymentMethodError": (402, "Invalid Payment Method"),
    "RateLimitError": (429, "Rate Limit Exceeded"),
    "VendorError": (500, "Vendor Error"),
    "ReactorRuntimeError": (500, "Reactor Runtime Error"),
}

#: The most warm processes one reactor may ask for (the spec sets no bound; each costs memory).
MAX_WARM_CONCURRENCY = 10


class Runtime(BaseModel):
    """The runtime of a ``node22`` reactor; ``node-svc`` and an omitted image are refused
    (``node-svc`` is deprecated since October 5, 2026).

    ``timeout`` in seconds (1 to 30, default 10); ``resources`` one of ``standard``, ``large``, ``xlarge``;
    ``warm_concurrency`` the processes kept warm (0 up to the platform's maximum; the pool keeps
    at least one process hot); ``dependencies`` and ``resolutions`` map npm
    package names to exact versions. Raises pydantic's ``ValidationError`` with a message per field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = Field(None, validate_default=True)
    dependencies: dict[str, str] = Field(default_factory=dict)
    resolutions: dict[str, str] = Field(default_factory=dict)
    timeout: int = Field(10, ge=1, le=30)
    resources: Literal["standard", "large", "xlarge"] = "standard"
    warm_concurrency: int = Field(0, ge=0, le=MAX_WARM_CONCURRENCY)
    permissions: list[str] = Field(default_factory=list)

    @field_validator("image")
    @classmethod
    def _node22_only(cls, value: str | None) -> str:
        if value is None or value == "node-svc":
            raise ValueError(
                "a Node runtime image is required: node-svc is deprecated for new reactors since "
                "October 5, 2026 (an omitted image means node-svc); use node22"
            )
        if value != "node22":
            raise ValueError("must be node22")
        return value

    @field_validator("permissions")
    @classmethod
    def _known_permissions(cls, value: list[str]) -> list[str]:
        modern, _legacy = modern_names(value)
        errors = permission_errors(modern)
        if errors:
            raise ValueError("; ".join(errors))
        return modern

    @field_validator("dependencies", "resolutions")
    @classmethod
    def _pinned(cls, value: dict[str, str], info) -> dict[str, str]:
        errors = packages.dependency_errors(info.field_name, value)
        if errors:
            raise ValueError("; ".join(f"{key} {msg}" for key, msgs in errors.items() for msg in msgs))
        return value


@dataclass(frozen=True)
class Reactor:
    """A deployed version of customer code as the runtime needs it: its owner (``tenant_id``, and
    ``kind`` ``reactor`` or ``proxy`` with that resource's ``id``), code and runtime. Processes are
    pooled by owner and version (:attr:`key`), never shared between tenants or resources."""

    id: str
    code: str
    runtime: Runtime
    tenant_id: str = "-"
    kind: str = "reactor"

    @property
    def owner_prefix(self) -> str:
        """The start of every pool key of this resource's versions (``<tenant>:<kind>:<id>:``)."""
        return owner_prefix(self.tenant_id, self.kind, self.id)

    @property
    def key(self) -> str:
        """The pool key of this version."""
        return f"{self.owner_prefix}{self.version}"

    @functools.cached_property
    def version(self) -> str:
        """A digest of everything that shapes its processes (code, dependency set, timeout, memory,
        warm processes)."""
        rt = self.runtime
        parts = [
            self.code,
            packages.dependency_key(rt.dependencies, rt.resolutions),
            str(rt.timeout),
            rt.resources,
            str(rt.warm_concurrency),
        ]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ReactorResponse:
    """What the code returned: ``raw`` (any JSON, the spec's raw output) and ``tokenize`` (the
    block of tokens to create, as the code wrote it; the caller creates them in the tenant and
    answers them as ``tokens``). Both None when the code returned nothing."""

    raw: object = None
    tokenize: object = None


@dataclass(frozen=True)
class Build:
    """A build's outcome: ``state`` ``ok``, ``vulnerabilities_detected`` (a HIGH or CRITICAL
    advisory applies; section 2: create ends ``failed``, update ``outdated``) or ``invalid_code``
    (the code did not load in the sandbox: ``message`` says why, with the line of a syntax error);
    ``vulnerabilities`` lists every finding, any severity; ``dependency_key`` names the installed set."""

    state: Literal["ok", "vulnerabilities_detected", "invalid_code"]
    dependency_key: str
    vulnerabilities: list[packages.Vulnerability] = field(default_factory=list)
    message: str | None = None

    def error_details(self) -> dict:
        """The Requested object's ``error_details``: ``{"vulnerabilities": [{name, version,
        severity, id, dependency_path}]}``."""
        return {"vulnerabilities": [v.as_dict() for v in self.vulnerabilities]}


class ReactorRuntime:
    """Builds and runs reactors under ``root`` (``dependencies/<key>`` installs, ``code/<version>``).

    ``advisories``: a JSON file of ``{name, version, severity, id}`` advisories to scan against
    instead of ``npm audit``; ``audit_registry``: the registry ``npm audit`` asks (default: npm's
    configured one). ``pool``: the warm processes (one is made when omitted). Thread-safe.
    """

    def __init__(
        self,
        root: Path,
        *,
        advisories: Path | None = None,
        audit_registry: str | None = None,
        pool: NodePool | None = None,
    ):
        self.root = Path(root)
        self.advisories = advisories
        self.audit_registry = audit_registry
        self.pool = pool or NodePool()
        self._programs: dict[str, NodeProgram] = {}
        self._lock = threading.Lock()

    @property
    def dependencies_dir(self) -> Path:
        return self.root / "dependencies"

    def build(self, runtime: Runtime, *, version: Reactor | None = None) -> Build:
        """Install ``runtime``'s dependencies (cached by set) and scan them; then, when the scan
        passes and ``version`` is given (the code on that runtime), load the code once in a sandboxed
        process and end it: code that does not load (a syntax error, a failing ``require``, no
        exported function, no load within the timeout) builds ``invalid_code``.

        Raises ``packages.InstallFailed`` (npm could not install them), ``packages.AuditUnavailable``
        (``npm audit`` gave no report: the build must not pass unscanned, so it is retried or failed
        by the caller; ``packages.AuditRefused`` when the registry refused the request) and
        ``SandboxUnavailable`` (the code cannot be confined on this host).
        """
        installation = self._install(runtime)
        if self.advisories is not None:
            found = packages.scan_with_advisories(installation, packages.load_advisories(self.advisories))
        else:
            found = packages.npm_audit(installation, registry=self.audit_registry)
        if packages.blocking(found):
            return Build("vulnerabilities_detected", installation.key, found)
        if version is not None:
            try:
                self.pool.load(replace(self._program(version), key=f"{version.key}:build"))
            except CodeLoadError as exc:
                return Build("invalid_code", installation.key, found, message=_invalid_code(exc).detail)
            except InvocationTimeout as exc:
                return Build(
                    "invalid_code",
                    installation.key,
                    found,
                    message=f"The reactor code did not load within its timeout of {exc.timeout:g} s.",
                )
        return Build("ok", installation.key, found)

    def invoke(self, reactor: Reactor, *, args: object, configuration: dict[str, str] | None = None) -> ReactorResponse:
        """Run ``reactor`` once on the request object ``{args, configuration}``.

        Raises :class:`~infra.errors.Problem`: 422 when the code is not a valid function; the status
        of a ``@tessera/reactor`` error it threw (:data:`REACTOR_ERRORS`); 500 for any other thrown
        value, a timeout (``runtime.timeout``), a process that ended (memory exhausted) or a result
        that is not an object (section 7).
        """
        value = self.call(reactor, {"args": args, "configuration": configuration or {}})
        if value is None:
            return ReactorResponse()
        if not isinstance(value, dict):
            raise Problem(
                500, "The reactor code must return an object with raw and/or tokenize.", title="Reactor Runtime Error"
            )
        return ReactorResponse(raw=value.get("raw"), tokenize=value.get("tokenize"))

    def call(self, reactor: Reactor, request: object) -> object:
        """Run ``reactor``'s function once on ``request`` (any JSON) and return what it returned
        (JSON; None for nothing). Raises the problems of :meth:`invoke` but the last one."""
        try:
            program = self._program(reactor)
            outcome = self.pool.invoke(program, request)
        except SandboxUnavailable as exc:
            raise sandbox_problem(str(exc)) from None
        except CodeLoadError as exc:
            raise _invalid_code(exc) from None
        except InvocationTimeout as exc:
            raise Problem(
                500, f"The reactor did not answer within its timeout of {exc.timeout:g} s.", title="Reactor Timeout"
            ) from None
        except NodeRuntimeError:
            raise Problem(
                500,
                "The reactor's process ended before answering (for example out of memory).",
                title="Reactor Runtime Error",
            ) from None
        if isinstance(outcome, Returned):
            return outcome.value
        if outcome.marked and outcome.name in REACTOR_ERRORS:
            status, title = REACTOR_ERRORS[outcome.name]
            raise Problem(status, outcome.message or title, title=title, errors=_error_map(outcome.errors))
        raise Problem(500, unhandled_detail(outcome.name, outcome.message), title="Reactor Runtime Error")

    def warm(self, reactor: Reactor) -> int:
        """Start the reactor's warm processes (``max(1, warm_concurrency)``); how many are idle.
        Raises :class:`~infra.errors.Problem` 422 when the code is not a valid function."""
        try:
            return self.pool.warm(self._program(reactor))
        except SandboxUnavailable as exc:
            raise sandbox_problem(str(exc)) from None
        except CodeLoadError as exc:
            raise _invalid_code(exc) from None

    def retire(self, reactor: Reactor) -> None:
        """End the processes of this version now (idle) or when their call returns (busy)."""
        with self._lock:
            self._programs.pop(reactor.key, None)
        self.pool.retire(reactor.key)

    def loads(self, reactor: Reactor) -> int:
        """How many processes loaded this version's code so far."""
        return self.pool.started[reactor.key]

    def close(self) -> None:
        """End every idle process."""
        self.pool.close()

    def _install(self, runtime: Runtime) -> packages.Installation:
        return packages.install(runtime.dependencies, runtime.resolutions, cache_dir=self.dependencies_dir)

    def _program(self, reactor: Reactor) -> NodeProgram:
        program = self._programs.get(reactor.key)
        if program is not None:
            return program
        installation = self._install(reactor.runtime)
        workdir = self.root / "code" / reactor.version
        if not (workdir / "index.js").exists():
            workdir.mkdir(parents=True, exist_ok=True)
            staged = workdir / f".index.js.{os.getpid()}.{threading.get_ident()}"
            staged.write_text(reactor.code)
            staged.rename(workdir / "index.js")
        program = NodeProgram(
            key=reactor.key,
            entry=workdir / "index.js",
            timeout=float(reactor.runtime.timeout),
            memory=RESOURCES[reactor.runtime.resources],
            node_modules=installation.node_modules,
            module_paths=(REACTOR_MODULES,),
            keep_warm=max(1, reactor.runtime.warm_concurrency),
        )
        with self._lock:
            return self._programs.setdefault(reactor.key, program)

    def forget(self, prefix: str) -> None:
        """Drop the cached programs of keys starting with ``prefix`` (their processes are retired
        by the pool)."""
        with self._lock:
            for key in [k for k in self._programs if k.startswith(prefix)]:
                del self._programs[key]


SANDBOX_UNAVAILABLE = "Sandbox Unavailable"


def sandbox_problem(reason: str) -> Problem:
    """The 503 answered where customer code cannot be confined (``reason``: what is missing, one
    line). Customer code never runs unconfined."""
    return Problem(503, f"Customer code cannot run here: {reason}.", title=SANDBOX_UNAVAILABLE)


def require_sandbox() -> None:
    """Raise :func:`sandbox_problem` unless this host can confine customer code (checked once per
    process, with ``TESSERA_REACTOR_BWRAP``)."""
    reason = availability(get_settings().reactor_bwrap)
    if reason is not None:
        raise sandbox_problem(reason)


def _invalid_code(exc: CodeLoadError) -> Problem:
    """The 422 of code that does not load or exports no function (section 7). Only the first line
    of Node.js's message is kept: the rest (a require stack) names the platform's folders."""
    first_line = (exc.message.splitlines() or [""])[0][:MAX_MESSAGE]
    where = f" at line {exc.line}" if exc.line is not None else ""
    return Problem(
        422,
        f"The reactor code is not a valid function ({exc.kind}{where}: {exc.name}: {first_line}).",
        title="Invalid Reactor Code",
    )


#: The longest error name and message quoted in a problem's detail (characters).
MAX_NAME, MAX_MESSAGE = 100, 500


def unhandled_detail(name: str, message: str | None) -> str:
    """The detail of a 500 for an error the code threw that is not one of :data:`REACTOR_ERRORS`:
    its name and the first line of its message, each bounded (the runner already replaced any
    string of the request the message quoted)."""
    name = name[:MAX_NAME]
    first_line = ((message or "").splitlines() or [""])[0][:MAX_MESSAGE].strip()
    if not first_line:
        return f"The reactor code threw an unhandled {name}."
    return f"The reactor code threw an unhandled {name}: {first_line}"


def _error_map(errors: object) -> dict[str, list[str]] | None:
    """The ``errors`` a thrown error carried, as the problem's property path -> messages map
    (a single message becomes a one-item list; anything else is dropped)."""
    if not isinstance(errors, dict):
        return None
    result = {}
    for key, value in errors.items():
        if isinstance(value, str):
            result[str(key)] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            result[str(key)] = value
    return result or None


_default: ReactorRuntime | None = None
_made_with: tuple | None = None
_default_lock = threading.Lock()


def reactor_runtime() -> ReactorRuntime:
    """The process's runtime: under ``<TESSERA_DATA_DIR>/reactors``, scanning against the advisory
    file named by ``TESSERA_REACTOR_ADVISORIES`` when that is set, else with ``npm audit``; its pool
    confined with the ``TESSERA_REACTOR_*`` sandbox settings. Made again (the old one closed) when
    any of these settings changed since."""
    global _default, _made_with
    settings = get_settings()
    shape = (
        settings.data_dir / "reactors",
        settings.reactor_advisories,
        settings.reactor_bwrap,
        settings.reactor_egress_allowlist,
        settings.reactor_tmp_mib,
        settings.reactor_idle_seconds,
    )
    with _default_lock:
        if _default is None or _made_with != shape:
            if _default is not None:
                _default.close()
            pool = NodePool(
                bwrap=settings.reactor_bwrap,
                egress_allow=settings.reactor_egress_allowlist,
                tmp_mib=settings.reactor_tmp_mib,
                idle_seconds=settings.reactor_idle_seconds,
                owner_check=dead_keys,
            )
            _default, _made_with = ReactorRuntime(shape[0], advisories=shape[1], pool=pool), shape
        return _default


def retire_owner(prefix: str) -> int:
    """End this process's processes of the keys starting with ``prefix`` (:func:`owner_prefix`) and
    forget their programs; how many keys. Runs in workers, on the broadcast of an update or delete."""
    if _default is not None:
        _default.forget(prefix)
    return retire_everywhere(prefix)
