"""npm dependencies of customer code: validated, installed once per dependency set, scanned.

* **Pinned**: every dependency and resolution names an exact version (``1.2.3``, ``1.2.3-rc.1``);
  ranges, tags, URLs, paths and git specs are refused (:func:`dependency_errors`).
* **Installed** with npm on Node.js 22, ``--ignore-scripts`` (no package code runs at install),
  into a directory of the cache named by :func:`dependency_key` (a hash of the sorted dependency
  and resolution maps), so equal sets share one install. Resolutions are written as npm
  ``overrides``. The install is staged beside the cache and renamed into place, under a file lock,
  so concurrent builds of one set install it once and readers never see a half-made directory.
* **Scanned** for known vulnerabilities against the installed tree (``package-lock.json``): with
  ``npm audit --json`` by default, or against a JSON file of ``{name, version, severity, id}``
  advisories (:func:`load_advisories`). Each finding names the installed version and the
  ``dependency_path`` from a direct dependency to the vulnerable package (core spec section 2,
  Requested object).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.node_runtime.binary import NodeInstallation, node_installation

#: Severities in the spec's spelling (core spec section 2), lowest first.
SEVERITIES = ("LOW", "MEDIUM", "HIGH", "CRITICAL")
_NPM_SEVERITY = {"info": "LOW", "low": "LOW", "moderate": "MEDIUM", "high": "HIGH", "critical": "CRITICAL"}

# npm's package name rules: lower case, URL-safe, an optional @scope/, at most 214 characters.
_NAME = re.compile(r"^(?:@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9][a-z0-9._~-]*$")
# An exact semantic version: MAJOR.MINOR.PATCH with optional pre-release and build metadata.
_EXACT = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(?:\+[0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*)?$"
)
_COMPLETE = ".installed"
_GHSA = re.compile(r"GHSA(?:-[23456789cfghjmpqrvwx]{4}){3}")


class InstallFailed(RuntimeError):
    """npm could not install the dependency set; the message is the end of npm's error output."""


class AuditUnavailable(RuntimeError):
    """``npm audit`` gave no report (its registry has no advisory service, or is unreachable).

    A build must not pass unscanned: the caller retries later or fails the build.
    """


class AuditRefused(AuditUnavailable):
    """The registry answered ``npm audit`` with a 4xx (it has no advisory service, or refuses this
    client): asking again gives the same answer, so the build fails at once. ``status`` is the
    registry's HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


#: 4xx answers worth asking again (a timeout, a rate limit): not a refusal.
_TRANSIENT_4XX = frozenset({408, 425, 429})


def dependency_errors(field: str, pins: object) -> dict[str, list[str]]:
    """Per-field errors of a dependency or resolution map (``{}`` when valid).

    ``pins`` must map npm package names to exact versions; ``field`` prefixes the error keys
    (``runtime.dependencies.lodash``).
    """
    if not isinstance(pins, Mapping):
        return {field: ["must be an object mapping package names to exact versions"]}
    errors: dict[str, list[str]] = {}
    for name, version in pins.items():
        problems = []
        if not isinstance(name, str) or len(name) > 214 or not _NAME.match(name):
            problems.append("is not a valid npm package name")
        if not isinstance(version, str) or not _EXACT.match(version):
            problems.append("must be an exact pinned version such as 1.2.3 (no ranges, tags, URLs or paths)")
        if problems:
            errors[f"{field}.{name}"] = problems
    return errors


def dependency_key(dependencies: Mapping[str, str], resolutions: Mapping[str, str]) -> str:
    """The cache key of a dependency set: SHA-256 (hex) of the sorted dependency and resolution maps."""
    canonical = json.dumps(
        {"dependencies": dict(dependencies), "resolutions": dict(resolutions)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Installation:
    """An installed dependency set: ``directory`` holds ``package.json``, ``package-lock.json`` and
    ``node_modules``; ``key`` is its :func:`dependency_key`."""

    directory: Path
    key: str

    @property
    def node_modules(self) -> Path:
        return self.directory / "node_modules"

    def lockfile(self) -> dict:
        """The parsed ``package-lock.json`` (lockfile version 3)."""
        return json.loads((self.directory / "package-lock.json").read_text())


@dataclass(frozen=True)
class Advisory:
    """A known vulnerability of one package version; ``severity`` in :data:`SEVERITIES`."""

    name: str
    version: str
    severity: str
    id: str


@dataclass(frozen=True)
class Vulnerability:
    """An advisory that applies to the installed tree (the spec's vulnerability object)."""

    name: str
    version: str
    severity: str
    id: str
    dependency_path: tuple[str, ...]

    def as_dict(self) -> dict:
        """``{name, version, severity, id, dependency_path}`` as the API shows it."""
        return {
            "name": self.name,
            "version": self.version,
            "severity": self.severity,
            "id": self.id,
            "dependency_path": list(self.dependency_path),
        }


def npm_environment() -> dict[str, str]:
    """This process's environment without the platform's own settings and cloud credentials
    (``TESSERA_*``, ``AWS_*``): npm keeps the operator's proxy, CA and registry configuration."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "AWS_"))}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def install(
    dependencies: Mapping[str, str],
    resolutions: Mapping[str, str],
    *,
    cache_dir: Path,
    node: NodeInstallation | None = None,
    timeout: float = 600.0,
) -> Installation:
    """The installed dependency set, from the cache or installed now with npm ``--ignore-scripts``.

    Raises ``ValueError`` for a set :func:`dependency_errors` refuses, :class:`InstallFailed` when
    npm fails (unknown package or version, registry unreachable) or exceeds ``timeout`` seconds.
    """
    errors = {**dependency_errors("dependencies", dependencies), **dependency_errors("resolutions", resolutions)}
    if errors:
        raise ValueError(f"invalid dependency set: {errors}")
    key = dependency_key(dependencies, resolutions)
    target = cache_dir / key
    if (target / _COMPLETE).exists():
        return Installation(target, key)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f".{key}.lock"):
        if (target / _COMPLETE).exists():
            return Installation(target, key)
        staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
        try:
            _install_into(staging, dependencies, resolutions, node or node_installation(), timeout)
            (staging / _COMPLETE).touch()
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return Installation(target, key)


def _install_into(
    directory: Path,
    dependencies: Mapping[str, str],
    resolutions: Mapping[str, str],
    node: NodeInstallation,
    timeout: float,
) -> None:
    manifest = {
        "name": "tessera-code-dependencies",
        "version": "0.0.0",
        "private": True,
        "dependencies": dict(sorted(dependencies.items())),
        "overrides": dict(sorted(resolutions.items())),
    }
    (directory / "package.json").write_text(json.dumps(manifest, indent=2))
    if not dependencies:
        (directory / "node_modules").mkdir()
        lock = {
            "name": manifest["name"],
            "version": "0.0.0",
            "lockfileVersion": 3,
            "requires": True,
            "packages": {"": {"name": manifest["name"], "version": "0.0.0"}},
        }
        (directory / "package-lock.json").write_text(json.dumps(lock, indent=2))
        return
    completed = _npm(
        node,
        directory,
        timeout,
        "install",
        "--ignore-scripts",
        "--no-audit",
        "--no-fund",
        "--no-bin-links",
        "--omit=dev",
        "--package-lock=true",
        "--loglevel=error",
    )
    if completed is None:
        raise InstallFailed(f"npm install did not finish within {timeout:g} s")
    if completed.returncode != 0:
        raise InstallFailed(_tail(completed.stderr or completed.stdout))
    (directory / "node_modules").mkdir(exist_ok=True)


def _npm(node: NodeInstallation, directory: Path, timeout: float, *args: str) -> subprocess.CompletedProcess | None:
    """Run ``npm args`` in ``directory`` (:func:`npm_environment`, no stdin); None after ``timeout`` s."""
    try:
        return subprocess.run(  # noqa: S603 - npm on our Node.js, a fixed argv, no shell
            node.npm(*args, "--no-update-notifier"),
            cwd=directory,
            env=npm_environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None


def _tail(text: str, limit: int = 2000) -> str:
    lines = [line for line in text.strip().splitlines() if "A complete log of this run" not in line]
    return "\n".join(lines)[-limit:] or "npm failed without a message"


# ---- the installed tree ------------------------------------------------------------------------


@dataclass(frozen=True)
class InstalledPackage:
    """A package of the lockfile: its ``location`` (``node_modules/a/node_modules/b``), name, version."""

    location: str
    name: str
    version: str


def installed_packages(lock: dict) -> list[InstalledPackage]:
    """Every installed package of a lockfile (version 2 or 3), links excluded."""
    found = []
    for location, entry in (lock.get("packages") or {}).items():
        if not location or entry.get("link") or "version" not in entry:
            continue
        name = entry.get("name") or location.rsplit("node_modules/", 1)[-1]
        found.append(InstalledPackage(location, name, entry["version"]))
    return found


def _resolve(packages: dict, location: str, name: str) -> str | None:
    """Where Node.js finds ``name`` required from ``location``: its own node_modules, then each
    ancestor's, up to the top."""
    base = location
    while True:
        candidate = f"{base}/node_modules/{name}" if base else f"node_modules/{name}"
        if candidate in packages:
            return candidate
        if not base:
            return None
        cut = base.rfind("/node_modules/")
        base = base[:cut] if cut >= 0 else ""


def dependency_paths(lock: dict) -> dict[str, tuple[str, ...]]:
    """For each installed location, the shortest chain of package names from a direct dependency
    of the root to it (``("express", "body-parser", "qs")``)."""
    packages = lock.get("packages") or {}
    paths: dict[str, tuple[str, ...]] = {}
    queue: deque[tuple[str, tuple[str, ...]]] = deque([("", ())])
    while queue:
        location, chain = queue.popleft()
        entry = packages.get(location, {})
        wanted = {
            **entry.get("dependencies", {}),
            **entry.get("optionalDependencies", {}),
            **entry.get("peerDependencies", {}),
        }
        for name in sorted(wanted):
            found = _resolve(packages, location, name)
            if found is None or found in paths:
                continue
            paths[found] = (*chain, name)
            queue.append((found, paths[found]))
    return paths


# ---- scanning ----------------------------------------------------------------------------------


def load_advisories(path: Path) -> list[Advisory]:
    """Advisories from a JSON file: an array of ``{name, version, severity, id}`` (severity in any
    case, ``moderate`` read as MEDIUM). Raises ``ValueError`` for a file of another shape."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of advisories")
    advisories = []
    for item in data:
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("name", "version", "id")):
            raise ValueError(f"{path}: every advisory needs name, version, severity and id")
        advisories.append(Advisory(item["name"], item["version"], _severity(item.get("severity")), item["id"]))
    return advisories


def _severity(value: object) -> str:
    text = str(value or "").lower()
    if text.upper() in SEVERITIES:
        return text.upper()
    if text in _NPM_SEVERITY:
        return _NPM_SEVERITY[text]
    raise ValueError(f"unknown severity {value!r}")


def scan_with_advisories(installation: Installation, advisories: list[Advisory]) -> list[Vulnerability]:
    """The advisories matching a package installed at exactly the advised version, with paths."""
    lock = installation.lockfile()
    paths = dependency_paths(lock)
    by_package = {(a.name, a.version): a for a in advisories}
    found = []
    for package in installed_packages(lock):
        advisory = by_package.get((package.name, package.version))
        if advisory is not None:
            path = paths.get(package.location, (package.name,))
            found.append(Vulnerability(package.name, package.version, advisory.severity, advisory.id, path))
    return _ordered(found)


def npm_audit(
    installation: Installation,
    *,
    node: NodeInstallation | None = None,
    registry: str | None = None,
    timeout: float = 120.0,
) -> list[Vulnerability]:
    """``npm audit --json`` of the installation, read against its lockfile.

    Only advisories on a package itself are reported (npm's derived "depends on a vulnerable
    version" entries are covered by the ``dependency_path`` of the advisory they derive from); the
    ``id`` is the advisory's GHSA identifier when its URL names one, else npm's advisory number.
    ``registry``: the registry whose advisory service is asked (default: npm's configured one).
    Raises :class:`AuditUnavailable` when npm gives no report, :class:`AuditRefused` when the
    registry answered with a 4xx that asking again will not change.
    """
    lock = installation.lockfile()
    if not installed_packages(lock):
        return []
    options = [f"--registry={registry}"] if registry else []
    completed = _npm(
        node or node_installation(), installation.directory, timeout, "audit", "--json", "--omit=dev", *options
    )
    if completed is None:
        raise AuditUnavailable(f"npm audit did not finish within {timeout:g} s")
    try:
        report = json.loads(completed.stdout)
    except ValueError:
        raise AuditUnavailable(_tail(completed.stderr)) from None
    if not isinstance(report, dict) or "vulnerabilities" not in report:
        message = str(report.get("message") if isinstance(report, dict) else report)[:500]
        status = report.get("statusCode") if isinstance(report, dict) else None
        if isinstance(status, int) and 400 <= status < 500 and status not in _TRANSIENT_4XX:
            raise AuditRefused(message, status)
        raise AuditUnavailable(message)
    return audit_report_vulnerabilities(report, lock)


def audit_report_vulnerabilities(report: dict, lock: dict) -> list[Vulnerability]:
    """The vulnerabilities of an ``npm audit --json`` report (``auditReportVersion`` 2)."""
    packages = lock.get("packages") or {}
    paths = dependency_paths(lock)
    found = []
    for name, entry in (report.get("vulnerabilities") or {}).items():
        advisories = [via for via in entry.get("via", []) if isinstance(via, dict)]
        for location in entry.get("nodes", []):
            version = (packages.get(location) or {}).get("version", "")
            for via in advisories:
                ghsa = _GHSA.search(str(via.get("url") or ""))
                found.append(
                    Vulnerability(
                        name,
                        version,
                        _severity(via.get("severity")),
                        ghsa.group(0) if ghsa else str(via.get("source")),
                        paths.get(location, (name,)),
                    )
                )
    return _ordered(found)


def _ordered(found: list[Vulnerability]) -> list[Vulnerability]:
    unique = {(v.name, v.version, v.id, v.dependency_path): v for v in found}
    return sorted(unique.values(), key=lambda v: (-SEVERITIES.index(v.severity), v.name, v.version, v.id))


def blocking(vulnerabilities: list[Vulnerability]) -> bool:
    """True when one of them is HIGH or CRITICAL (a node22 deployment then fails, section 2)."""
    return any(v.severity in ("HIGH", "CRITICAL") for v in vulnerabilities)
