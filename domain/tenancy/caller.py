"""Who is calling: the authenticated application, its tenant and its permissions."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from infra.errors import forbidden


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of one request (or the actor of one task).

    ``permissions`` are the effective permission strings (legacy names already mapped);
    ``tenant_settings`` the tenant's settings map with string values ``'true'``/``'false'``.
    """

    tenant_id: uuid.UUID
    tenant_type: str
    application_id: uuid.UUID | None
    application_type: str | None
    permissions: frozenset[str]
    tenant_settings: dict[str, str] = field(default_factory=dict)
    trace_id: str | None = None
    actor_type: str = "application"

    def has(self, permission: str) -> bool:
        """True when the caller holds ``permission``."""
        return permission in self.permissions

    def require(self, *permissions: str) -> None:
        """Raise a 403 problem unless the caller holds every one of ``permissions``."""
        for permission in permissions:
            if permission not in self.permissions:
                raise forbidden(permission)

    def require_any(self, *permissions: str) -> None:
        """Raise a 403 problem unless the caller holds at least one of ``permissions``."""
        if not any(p in self.permissions for p in permissions):
            raise forbidden(" or ".join(permissions))

    def setting(self, name: str) -> bool:
        """A boolean tenant setting (stored as the string 'true' or 'false')."""
        return self.tenant_settings.get(name) == "true"
