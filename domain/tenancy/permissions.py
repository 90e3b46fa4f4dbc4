"""Permission strings (spec, core document section 5) and token access levels.

Token permissions have the form ``token:<classification>:<operation>[:<qualifier>]`` where the
classification is ``general``, ``pci`` or ``bank``; reads carry an impact level (``low``,
``moderate``, ``high``) and uses a purpose (``proxy``, ``reactor``). The legacy names of section 5.4
(``token:create``, ``card:read`` ...) were shut down on January 3, 2022: :data:`LEGACY_PERMISSIONS`
maps each to its replacement, and :func:`modern_names` maps the names of a new grant.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable

from infra.errors import Problem

CLASSIFICATIONS = ("general", "pci", "bank")
IMPACT_LEVELS = ("low", "moderate", "high")
_LEVEL_RANK = {level: rank for rank, level in enumerate(IMPACT_LEVELS)}

TYPE_CLASSIFICATION = {"token": "general", "card": "pci", "bank": "bank"}


def _token_permissions() -> list[str]:
    names = []
    for c in CLASSIFICATIONS:
        names += [f"token:{c}:create", f"token:{c}:update", f"token:{c}:delete"]
        names += [f"token:{c}:read:{level}" for level in IMPACT_LEVELS]
        names += [f"token:{c}:use:proxy", f"token:{c}:use:reactor"]
    return names


def _crud(prefix: str, *ops: str) -> list[str]:
    return [f"{prefix}:{op}" for op in ops]


ALL_PERMISSIONS: tuple[str, ...] = tuple(
    _token_permissions()
    + _crud("network-token", "create", "read", "reveal", "cryptogram", "suspend", "resume", "delete")
    + _crud("token-intent", "create", "read", "delete")
    + _crud("application", "create", "read", "update", "delete")
    + _crud("reactor", "create", "read", "update", "delete", "invoke")
    + _crud("proxy", "create", "read", "update", "delete", "invoke")
    + _crud("tenant", "read", "update", "delete")
    + _crud("tenant:member", "read", "delete")
    + _crud("tenant:invitation", "create", "read", "update", "delete")
    + ["report:read", "log:read"]
    + _crud("keys", "create", "read", "delete")
    + _crud("document", "create", "read", "reveal", "delete")
    + _crud("webhooks", "create", "read", "update", "delete")
    + ["webhook:read"]
    + _crud("agentic:payment-method", "create", "get", "delete")
    + _crud("agentic:allowance", "create", "get", "update", "delete", "verify")
    + _crud("agentic:credential", "create", "get")
    + _crud("agent", "create", "get", "update", "delete")
    + _crud("account-updater:job", "create", "read")
    + _crud("wallet-a", "manage", "session", "create", "read", "reveal")
    + ["wallet-b:create"]
)
KNOWN_PERMISSIONS = frozenset(ALL_PERMISSIONS)


def _legacy() -> dict[str, str]:
    mapping: dict[str, str] = {}
    for legacy, classification in (("token", "general"), ("bank", "bank"), ("card", "pci")):
        mapping[f"{legacy}:create"] = f"token:{classification}:create"
        mapping[f"{legacy}:read"] = f"token:{classification}:read:low"
        mapping[f"{legacy}:update"] = f"token:{classification}:update"
        mapping[f"{legacy}:delete"] = f"token:{classification}:delete"
        mapping[f"{legacy}:use"] = f"token:{classification}:use:proxy"
        if legacy != "card":  # card had no decrypt permission
            mapping[f"{legacy}:decrypt"] = f"token:{classification}:read:high"
    return mapping


LEGACY_PERMISSIONS: dict[str, str] = _legacy()
LEGACY_SHUTDOWN = "January 3, 2022"
LEGACY_SHUTDOWN_DATE = dt.datetime(2022, 1, 3, tzinfo=dt.UTC)


def modern_names(requested: Iterable[str]) -> tuple[list[str], list[str]]:
    """``requested`` with each legacy name (section 5.4: ``token:create``, ``card:read``, ``bank:use``
    ...) replaced by its granular name, in order and without repeats, and the legacy names that were
    replaced. A new grant is liberal in the names it takes and stores only the new ones."""
    modern: dict[str, None] = {}
    legacy = []
    for name in requested:
        if name in LEGACY_PERMISSIONS:
            legacy.append(name)
        modern[LEGACY_PERMISSIONS.get(name, name)] = None
    return list(modern), legacy


def effective_permissions(stored: Iterable[str]) -> frozenset[str]:
    """The permissions an application holds, legacy names (if any were stored) mapped to new ones."""
    return frozenset(LEGACY_PERMISSIONS.get(name, name) for name in stored)


def require_grantable(held: frozenset[str], requested: Iterable[str], *, field: str, what: str) -> None:
    """Refuse to give ``what`` (an application's key, a reactor's code) a permission the caller does
    not hold itself (``held``): 403 naming every missing permission, under ``field`` in ``errors``.
    A key cannot mint, and code cannot be given, more power than the key that asks."""
    beyond = sorted(set(LEGACY_PERMISSIONS.get(name, name) for name in requested) - held)
    if beyond:
        names = ", ".join(beyond)
        raise Problem(
            403,
            f"The API key cannot give {what} permissions it does not hold: {names}.",
            errors={field: [f"'{name}' is not held by the API key" for name in beyond]},
        )


def permission_errors(requested: Iterable[str]) -> list[str]:
    """Messages for each unknown or retired permission name in ``requested`` (empty when fine)."""
    messages = []
    for name in requested:
        if name in LEGACY_PERMISSIONS:
            messages.append(f"'{name}' was shut down on {LEGACY_SHUTDOWN}; use '{LEGACY_PERMISSIONS[name]}'")
        elif name not in KNOWN_PERMISSIONS:
            messages.append(f"'{name}' is not a known permission")
    return messages


@functools.lru_cache(maxsize=4096)
def parse_container(container: str) -> tuple[str, str] | None:
    """``/pci/high/`` (or a deeper path under it) -> ``("pci", "high")``; None when malformed.
    Remembered per process (a few thousand paths): tokens repeat a handful of containers."""
    if not container.startswith("/") or not container.endswith("/"):
        return None
    parts = container.strip("/").split("/")
    if len(parts) < 2 or parts[0] not in CLASSIFICATIONS or parts[1] not in IMPACT_LEVELS:
        return None
    if any(not part or len(part) > 100 for part in parts):
        return None
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1024)
def read_level(permissions: frozenset[str], classification: str) -> int:
    """The highest impact rank the caller may read plainly in ``classification``; -1 for none.
    Remembered per process by permission set (a cached caller keeps the same set object)."""
    best = -1
    for level, rank in _LEVEL_RANK.items():
        if f"token:{classification}:read:{level}" in permissions:
            best = max(best, rank)
    return best


def level_rank(level: str) -> int:
    """The rank of an impact level (low 0, moderate 1, high 2)."""
    return _LEVEL_RANK[level]
