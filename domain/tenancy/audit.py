"""Log rows (spec, core document: Log; ``GET /logs``): who did what to which entity.

A log row never holds sensitive data: only ids, the operation and a fixed message.
"""

from __future__ import annotations

from sqlmodel import Session

from domain.tenancy.caller import Caller
from storage.db import Rows
from storage.models import AuditLog
from storage.types import random_uuid, table_of, utcnow

#: Entity types shown by ``GET /logs/entity-types``: system value -> display name.
ENTITY_TYPES: dict[str, str] = {
    "account-updater-job": "Account updater job",
    "agent": "Agent",
    "allowance": "Allowance",
    "application": "Application",
    "bank": "Bank",
    "card": "Card",
    "client_encryption_key": "Client encryption key",
    "document": "Document",
    "network-token": "Network token",
    "payment_credential": "Payment credential",
    "payment_method": "Payment method",
    "proxy": "Proxy",
    "tenant": "Tenant",
    "tenant_invitation": "Tenant invitation",
    "tenant_member": "Tenant member",
    "token": "Token",
    "token-intent": "Token intent",
    "wallet-a": "Wallet token (wallet-a)",
    "wallet-a-domain": "Wallet domain (wallet-a)",
    "wallet-a-merchant-key": "Merchant certificate (wallet-a)",
    "wallet-a-session": "Merchant session (wallet-a)",
    "wallet-b": "Wallet token (wallet-b)",
    "wallet-b-merchant-key": "Merchant key (wallet-b)",
    "webhook": "Webhook",
}

_PAST = {
    "create": "created",
    "read": "read",
    "update": "updated",
    "delete": "deleted",
    "cryptogram": "cryptogram generated",
    "invoke": "invoked",
    "use": "used",
}


def record(session: Session, caller: Caller, *, entity_type: str, entity_id: object, operation: str) -> None:
    """Add a log row for ``operation`` on an entity, in the caller's transaction."""
    session.add(AuditLog(**_row(caller, entity_type, entity_id, operation)))


def stage(rows: Rows, caller: Caller, *, entity_type: str, entity_id: object, operation: str) -> None:
    """Queue in ``rows`` the log row :func:`record` would add (for ``storage.db.stage_rows``)."""
    rows.add(_TABLE, _row(caller, entity_type, entity_id, operation))


_TABLE = table_of(AuditLog)


def _row(caller: Caller, entity_type: str, entity_id: object, operation: str) -> dict:
    return {
        "id": random_uuid(),
        "tenant_id": caller.tenant_id,
        "actor_id": caller.application_id,
        "actor_type": caller.actor_type,
        "entity_type": entity_type,
        "entity_id": str(entity_id),
        "operation": operation,
        "message": f"{ENTITY_TYPES.get(entity_type, entity_type)} {_PAST.get(operation, operation)}",
        "created_at": utcnow(),
    }
