"""The public shapes of tenancy (core document section 2: Tenant, Application, Member, Invitation):
``<thing>_view(row) -> dict``, what the API answers.
"""

from __future__ import annotations

import datetime as dt

from storage.models import Application, ApplicationKey, Tenant, TenantMember, User
from storage.models_tenancy import TenantInvitation
from storage.states import InvitationStatus


def tenant_view(tenant: Tenant) -> dict:
    """The public tenant object."""
    return {
        "id": tenant.id,
        "owner_id": tenant.owner_id,
        "name": tenant.name,
        "type": tenant.type,
        "settings": dict(tenant.settings or {}),
        "created_by": tenant.created_by,
        "created_at": tenant.created_at,
        "modified_by": tenant.modified_by,
        "modified_at": tenant.modified_at,
    }


def application_view(application: Application, key: str | None = None) -> dict:
    """The public application object (``key`` only when just made)."""
    view = {
        "id": application.id,
        "tenant_id": application.tenant_id,
        "name": application.name,
        "type": application.type,
        "permissions": list(application.permissions),
        "created_by": application.created_by,
        "created_at": application.created_at,
        "modified_by": application.modified_by,
        "modified_at": application.modified_at,
    }
    if key is not None:
        view["key"] = key
    return view


def application_key_view(key_row: ApplicationKey, key: str | None = None) -> dict:
    """The public key object: id and dates, the key itself only when just made."""
    view = {"id": key_row.id, "application_id": key_row.application_id, "created_at": key_row.created_at}
    if key is not None:
        view["key"] = key
    return view


def user_view(user: User) -> dict:
    """The public user object: id, email, first_name, last_name, picture."""
    return {
        "id": user.id,
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "picture": user.picture,
    }


def member_view(member: TenantMember, user: User) -> dict:
    """The public member object (core document section 2, Member)."""
    return {
        "id": member.id,
        "tenant_id": member.tenant_id,
        "role": member.role,
        "user": user_view(user),
        "created_by": member.created_by,
        "created_at": member.created_at,
        "modified_by": member.modified_by,
        "modified_at": member.modified_at,
    }


def effective_status(invitation: TenantInvitation, now: dt.datetime) -> InvitationStatus:
    """``EXPIRED`` for a PENDING invitation past ``expires_at`` even before the sweep has run."""
    if invitation.status == InvitationStatus.PENDING and invitation.expires_at <= now:
        return InvitationStatus.EXPIRED
    return invitation.status


def invitation_view(invitation: TenantInvitation, now: dt.datetime) -> dict:
    """The public invitation object (core document section 2, Invitation, plus ``role``)."""
    return {
        "id": invitation.id,
        "tenant_id": invitation.tenant_id,
        "email": invitation.email,
        "role": invitation.role,
        "status": effective_status(invitation, now),
        "expires_at": invitation.expires_at,
        "created_by": invitation.created_by,
        "created_at": invitation.created_at,
        "modified_by": invitation.modified_by,
        "modified_at": invitation.modified_at,
    }
