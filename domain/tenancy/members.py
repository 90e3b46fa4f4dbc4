"""Tenant members and the security contact (core document sections 2 and 4: Tenants; Tenant members).

A member is a user's membership of a tenant with a role: ``OWNER`` (the owner named when the tenant
was created; full access; cannot be removed), ``ADMIN`` (full access) or ``READ_ONLY``. Members are
created by the CLI (the owner) and by accepting an invitation (:mod:`domain.tenancy.invitations`); removing
one revokes all of that user's access to the tenant.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy import ColumnElement, func
from sqlmodel import Session, col, select

from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tenancy.tenants import get_tenant
from domain.tenancy.views import member_view
from infra.errors import Problem
from infra.lookup import get_owned
from storage.models import TenantMember, User
from storage.types import utcnow

#: Entity types of the log rows this capability writes (value -> display name), for ``GET /logs/entity-types``.
ENTITY_TYPES: dict[str, str] = {
    name: audit.ENTITY_TYPES[name]
    for name in ("tenant_member", "tenant_invitation", "client_encryption_key", "document")
}
MEMBER = "tenant_member"
ROLES = ("OWNER", "ADMIN", "READ_ONLY")


def list_members(
    session: Session, caller: Caller, *, user_ids: Sequence[uuid.UUID], page: int, size: int
) -> tuple[list[dict], int]:
    """``GET /tenants/self/members``: one page (oldest first) and the total, filtered by ``user_ids``."""
    where: list[ColumnElement[bool]] = [col(TenantMember.tenant_id) == caller.tenant_id]
    if user_ids:
        where.append(col(TenantMember.user_id).in_(list(user_ids)))
    total = session.exec(select(func.count()).select_from(TenantMember).where(*where)).one()
    rows = session.exec(
        select(TenantMember, User)
        .join(User, col(User.id) == TenantMember.user_id)
        .where(*where)
        .order_by(col(TenantMember.created_at), col(TenantMember.id))
        .offset((page - 1) * size)
        .limit(size)
    ).all()
    return [member_view(member, user) for member, user in rows], total


def delete_member(session: Session, caller: Caller, member_id: uuid.UUID) -> None:
    """``DELETE /tenants/self/members/{id}``: remove the membership, revoking all of the user's access.

    404 for an unknown member or another tenant's; 422 for the OWNER member, which cannot be removed.
    """
    member = get_owned(session, TenantMember, member_id, caller.tenant_id, what="member")
    if member.role == "OWNER":
        raise Problem(
            422,
            "The OWNER member cannot be removed: the tenant owner keeps full access for as long as the tenant exists.",
            title="The owner cannot be removed",
        )
    session.delete(member)
    audit.record(session, caller, entity_type=MEMBER, entity_id=member.id, operation="delete")


# ---- the security contact ------------------------------------------------------------------------


def _owner_email(session: Session, tenant_id: uuid.UUID, owner_id: uuid.UUID | None) -> str | None:
    if owner_id is not None:
        owner = session.get(User, owner_id)
        if owner is not None:
            return owner.email
    row = session.exec(
        select(User.email)
        .join(TenantMember, col(TenantMember.user_id) == User.id)
        .where(TenantMember.tenant_id == tenant_id, TenantMember.role == "OWNER")
    ).first()
    return row


def read_security_contact(session: Session, caller: Caller) -> dict:
    """``GET /tenants/self/security-contact``: ``{"email"}``, the tenant owner's email when none is set."""
    tenant = get_tenant(session, caller.tenant_id)
    email = tenant.security_contact_email or _owner_email(session, tenant.id, tenant.owner_id)
    audit.record(session, caller, entity_type="tenant", entity_id=tenant.id, operation="read")
    return {"email": email}


def update_security_contact(session: Session, caller: Caller, *, email: str) -> dict:
    """``PUT /tenants/self/security-contact``: set the contact (already validated, at most 200 characters)."""
    tenant = get_tenant(session, caller.tenant_id)
    tenant.security_contact_email = email
    tenant.modified_by = caller.application_id
    tenant.modified_at = utcnow()
    session.add(tenant)
    audit.record(session, caller, entity_type="tenant", entity_id=tenant.id, operation="update")
    return {"email": email}
