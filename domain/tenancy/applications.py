"""Applications and their API keys (spec, core document: Application; section 9 on several keys).

An application holds permissions and one or more keys. Keys are shown once, when made: on
``POST /applications`` and on ``POST /applications/{id}/keys``. The retired regenerate operation
(shut down October 17, 2024) is replaced by making a second key and deleting the old one.
"""

from __future__ import annotations

import uuid

from sqlalchemy import func
from sqlmodel import Session, col, select

from domain.tenancy import audit
from domain.tenancy.auth import caller_cache, new_api_key
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import permission_errors, require_grantable
from domain.tenancy.views import application_key_view, application_view
from infra.errors import Problem, not_found, validation_problem
from infra.lookup import get_owned
from storage.db import on_commit
from storage.models import Application, ApplicationKey
from storage.types import utcnow

APPLICATION_TYPES = ("server_to_server", "public", "elements", "management", "private")

#: Public and elements keys live in browsers and apps: they may only create, never read or manage.
_CLIENT_SIDE_TYPES = ("public", "elements")
_CLIENT_SIDE_PERMISSIONS = ("token:", "token-intent:create", "agentic:payment-method:create")


def _check_permissions(caller: Caller, app_type: str, permissions: list[str]) -> None:
    """400 for unknown, retired or type-inappropriate names; 403 for a permission the calling key does
    not hold itself (a key cannot mint a more powerful key)."""
    errors = permission_errors(permissions)
    if not errors and app_type in _CLIENT_SIDE_TYPES:
        errors = [
            f"'{p}' cannot be granted to a {app_type} application (create permissions only)"
            for p in permissions
            if not (p.startswith(_CLIENT_SIDE_PERMISSIONS) and (":create" in p))
        ]
    if errors:
        raise validation_problem({"permissions": errors})
    require_grantable(caller.permissions, permissions, field="permissions", what="an application")


def create_application(session: Session, caller: Caller, *, name: str, type: str, permissions: list[str]) -> dict:
    """``POST /applications``: the new application with its first key."""
    _check_permissions(caller, type, permissions)
    application = Application(
        tenant_id=caller.tenant_id,
        name=name,
        type=type,
        permissions=sorted(set(permissions)),
        created_by=caller.application_id,
    )
    session.add(application)
    key, digest = new_api_key()
    session.add(
        ApplicationKey(
            tenant_id=caller.tenant_id,
            application_id=application.id,
            key_digest=digest,
            created_by=caller.application_id,
        )
    )
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="create")
    return application_view(application, key)


def get_application(session: Session, caller: Caller, application_id: uuid.UUID) -> Application:
    """The tenant's application, else 404."""
    return get_owned(session, Application, application_id, caller.tenant_id, what="application")


def read_application(session: Session, caller: Caller, application_id: uuid.UUID) -> dict:
    """``GET /applications/{id}``."""
    application = get_application(session, caller, application_id)
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="read")
    return application_view(application)


def list_applications(
    session: Session, caller: Caller, *, ids: list[uuid.UUID], page: int, size: int
) -> tuple[list[dict], int]:
    """``GET /applications``: one page (oldest first) and the total count."""
    query = select(Application).where(Application.tenant_id == caller.tenant_id)
    if ids:
        query = query.where(col(Application.id).in_(ids))
    total = session.exec(select(func.count()).select_from(query.subquery())).one()
    rows = session.exec(
        query.order_by(col(Application.created_at), col(Application.id)).offset((page - 1) * size).limit(size)
    ).all()
    return [application_view(a) for a in rows], total


def update_application(
    session: Session, caller: Caller, application_id: uuid.UUID, *, name: str, permissions: list[str]
) -> dict:
    """``PUT /applications/{id}``: replace the name and the permissions."""
    on_commit(session, caller_cache.clear)
    application = get_application(session, caller, application_id)
    _check_permissions(caller, application.type, permissions)
    application.name = name
    application.permissions = sorted(set(permissions))
    application.modified_by = caller.application_id
    application.modified_at = utcnow()
    session.add(application)
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="update")
    return application_view(application)


def delete_application(session: Session, caller: Caller, application_id: uuid.UUID) -> None:
    """``DELETE /applications/{id}``: the application and all its keys."""
    on_commit(session, caller_cache.clear)
    application = get_application(session, caller, application_id)
    session.delete(application)
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="delete")


def create_key(session: Session, caller: Caller, application_id: uuid.UUID) -> dict:
    """``POST /applications/{id}/keys``: a further key for the application, shown once."""
    application = get_application(session, caller, application_id)
    key, digest = new_api_key()
    row = ApplicationKey(
        tenant_id=caller.tenant_id, application_id=application.id, key_digest=digest, created_by=caller.application_id
    )
    session.add(row)
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="update")
    return application_key_view(row, key)


def list_keys(session: Session, caller: Caller, application_id: uuid.UUID) -> list[dict]:
    """``GET /applications/{id}/keys``: the keys' ids and dates, never the keys."""
    application = get_application(session, caller, application_id)
    rows = session.exec(
        select(ApplicationKey)
        .where(ApplicationKey.application_id == application.id)
        .order_by(col(ApplicationKey.created_at))
    ).all()
    return [application_key_view(row) for row in rows]


def delete_key(session: Session, caller: Caller, application_id: uuid.UUID, key_id: uuid.UUID) -> None:
    """``DELETE /applications/{id}/keys/{key_id}``: the key stops working at once."""
    on_commit(session, caller_cache.clear)
    application = get_application(session, caller, application_id)
    row = session.get(ApplicationKey, key_id)
    if row is None or row.application_id != application.id:
        raise not_found("application key")
    session.delete(row)
    audit.record(session, caller, entity_type="application", entity_id=application.id, operation="update")


def application_of_caller(session: Session, caller: Caller) -> dict:
    """``GET /applications/key``: the application owning the calling key."""
    if caller.application_id is None:
        raise Problem(404, "The caller is not an application.")
    return read_application(session, caller, caller.application_id)
