"""Who owns a warm process of customer code, and how every worker is told to end an owner's processes.

A process serves one tenant's one resource (a reactor, or a proxy's code transforms) at one version;
its pool key is ``<tenant>:<kind>:<resource id>:<version>`` (:func:`owner_prefix` plus the version).
When the resource is deleted or a new version of it deployed, :func:`end_owner_after_commit`
broadcasts :data:`END_CODE_COMMAND` with the owner's prefix; each worker's command
(``tasks/reactors.py``) ends the matching processes at once (:func:`infra.node_runtime.pool.retire_everywhere`).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from infra.dispatch import broadcast_after_commit

#: The worker remote-control command that ends the processes of one owner.
END_CODE_COMMAND = "tessera_end_code"
#: The kinds of owner.
REACTOR, PROXY = "reactor", "proxy"


def owner_prefix(tenant_id: object, kind: str, resource_id: object) -> str:
    """The start of the pool keys of one tenant's resource (``kind`` :data:`REACTOR` or :data:`PROXY`)."""
    return f"{tenant_id}:{kind}:{resource_id}:"


def parse_key(key: str) -> tuple[str, str, str, str] | None:
    """``(tenant, kind, resource id, version)`` of a pool key; None for a key of another form."""
    parts = key.split(":")
    return (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None


def end_owner_after_commit(session: Session, tenant_id: object, kind: str, resource_id: object) -> None:
    """Once ``session`` commits, tell every worker to end the processes of this tenant's resource: a
    broadcast, acted on within milliseconds; each pool's periodic owner check is the slower net for
    a broker without fan-out (the embedded default) or a worker that missed the broadcast."""
    broadcast_after_commit(session, END_CODE_COMMAND, prefix=owner_prefix(tenant_id, kind, resource_id))
