"""Log rows (spec, core document: Log; ``GET /logs``): who did what to which entity.

A log row never holds sensitive data: only ids, the operation and a fixed message.
"""

from __future__ import annotations

from sqlmodel import Session

from domain.tenancy.caller import Caller
from storage.models import AuditLog

#: Entity types shown by ``GET /logs/entity-types``: system value -> display name.
ENTITY_TYPES: dict[str, str] = {
    "account-updater-job": "Account updater job",
    "agent": "Agent",
    "application": "Application",
    "bank": "Bank",
    "card": "Card",
    "client_encryption_key": "Client encryption key",
    "document": "Document",
    "network-token": "Network token",
    "payment_method": "Payment method",
    "tenant": "Tenant",
    "tenant_invitation": "Tenant invitation",
    "tenant_member": "Tenant member",
    "token": "Token",
    "token-intent": "Token intent",
    "webhook": "Webhook",
}

_PAST = {
    "create": "created",
    "read": "read",
    "update": "updated",
    "delete": "deleted",
    "cryptogram": "cryptogram generated",
}


def record(session: Session, caller: Caller, *, entity_type: str, entity_id: object, operation: str) -> None:
    """Add a log row for ``operation`` on an entity, in the caller's transaction."""
    session.add(
        AuditLog(
            tenant_id=caller.tenant_id,
            actor_id=caller.application_id,
            actor_type=caller.actor_type,
            entity_type=entity_type,
            entity_id=str(entity_id),
            operation=operation,
            message=f"{ENTITY_TYPES.get(entity_type, entity_type)} {_PAST.get(operation, operation)}",
        )
    )
