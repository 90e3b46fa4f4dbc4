"""Which owners of warm customer-code processes still exist: the pools' periodic owner check.

The broadcast of a delete (``infra.node_runtime.owners``) ends a resource's processes at once; this
check is the net under it, for a broker without fan-out (the embedded default) and a worker that was
reconnecting when the broadcast went out: every few seconds a pool with live processes asks which of
their owners (a tenant's reactor, or a tenant's proxy) are gone, and ends those processes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlmodel import col, select

from infra.node_runtime import owners
from storage.db import session_scope
from storage.models_proxy import Proxy
from storage.models_reactors import Reactor


def dead_keys(keys: Iterable[str]) -> set[str]:
    """The pool keys among ``keys`` whose owner no longer exists (deleted, or another tenant's id:
    a key names its tenant, and only a row of that tenant keeps it alive). Keys of another form are
    left alone."""
    wanted: dict[tuple[str, uuid.UUID, uuid.UUID], list[str]] = {}
    for key in keys:
        parsed = owners.parse_key(key)
        if parsed is None:
            continue
        tenant, kind, resource, _version = parsed
        try:
            wanted.setdefault((kind, uuid.UUID(tenant), uuid.UUID(resource)), []).append(key)
        except ValueError:
            continue
    if not wanted:
        return set()
    alive: set[tuple[str, uuid.UUID, uuid.UUID]] = set()
    with session_scope() as session:
        for kind, model in ((owners.REACTOR, Reactor), (owners.PROXY, Proxy)):
            ids = [resource for (k, _tenant, resource) in wanted if k == kind]
            if ids:
                rows = session.exec(select(col(model.tenant_id), col(model.id)).where(col(model.id).in_(ids))).all()
                alive |= {(kind, tenant, resource) for tenant, resource in rows}
    return {key for owner, owned in wanted.items() if owner not in alive for key in owned}
