"""Finding a tenant's row by the id a caller sent: one UUID parser and one tenant-scoped get-or-404.

Another tenant's row is answered exactly like a missing one, and so is a malformed id
(``ARCHITECTURE.md``, security model).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlmodel import Session, select

from infra.errors import not_found


class _Owned(Protocol):
    id: Any
    tenant_id: Any


Owned = TypeVar("Owned", bound=_Owned)


def parse_uuid(value: object) -> uuid.UUID | None:
    """``value`` as a UUID (a UUID or its text form); None when it is not one."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def get_owned(
    session: Session,
    model: type[Owned],
    ident: object,
    tenant_id: uuid.UUID,
    *,
    what: str,
    lock: bool = False,
    where: Callable[[Owned], bool] | None = None,
) -> Owned:
    """The row of ``model`` whose id is ``ident`` (a UUID or its text) when it belongs to tenant
    ``tenant_id`` and ``where`` (when given) holds for it; ``lock`` takes it ``FOR UPDATE``.

    Raises the 404 problem of :func:`infra.errors.not_found` (``The <what> was not found.``) for a
    malformed id, a missing row, another tenant's row or one ``where`` refuses."""
    parsed = parse_uuid(ident)
    row = None
    if parsed is not None:  # a query, never the identity map alone: it sees this transaction's deletes
        statement = select(model).where(model.id == parsed, model.tenant_id == tenant_id)
        row = session.exec(statement.with_for_update() if lock else statement).first()
    if row is None or (where is not None and not where(row)):
        raise not_found(what)
    return row
