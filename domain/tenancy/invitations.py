"""Tenant invitations: create, list, read, resend, delete, accept, expire (core document sections 2-4).

Life of an invitation (section 3)::

    PENDING --time (expires_at passed; beat sweep)--> EXPIRED
    PENDING | EXPIRED --resend--> PENDING   (expires_at = now + 72 h; earlier links invalid)
    PENDING --accept--> a tenant member with the invited role; the invitation is removed
    any --DELETE--> removed; outstanding links invalid

Reads never show ``PENDING`` for an invitation whose ``expires_at`` has passed, whether or not the
sweep (``tenancy.expire_invitations``) has run yet.

Links. Each create and resend issues a new link row and records a mail job (``mail.invitation``, sent
after the commit, retried on transient SMTP failures, re-sent by the outbox relay if lost). The link
token is ``inv_`` + base64url(HMAC-SHA256(link key, link id)), where the link key is derived with
HKDF from the tenant's data key: the database keeps only the SHA-256 digest of the token, the Celery
message carries only the job id, and the mail task recomputes the token from the link id. The mail
(a plain-text part with the link alone on its line, and an HTML part) links to the invitation page
``<base>/invitations/accept?token=<token>``, where the base is ``TESSERA_PUBLIC_BASE_URL`` or the api's
``http://<api_host>:<api_port>``: it shows the tenant and the role, and its form accepts. Programs use
``GET /invitations/accept?token=`` (what the link invites to) and ``POST /invitations/accept`` (no API
key) with the token and the user's names; either way a link accepts once.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import html
import logging
import uuid
from dataclasses import dataclass

from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from config.settings import Settings
from domain.tenancy import audit
from domain.tenancy.auth import row_tenant, system_caller
from domain.tenancy.caller import Caller
from domain.tenancy.tenants import get_tenant
from domain.tenancy.views import effective_status, invitation_view, member_view
from infra import jobs
from infra.errors import Problem
from infra.lookup import get_owned
from storage.crypto import get_keyring
from storage.models import Job, Tenant, TenantMember, User
from storage.models_tenancy import InvitationLink, TenantInvitation
from storage.states import InvitationLinkStatus, InvitationStatus
from storage.types import utcnow

INVITATION = "tenant_invitation"
MEMBER = "tenant_member"
MAIL_TASK = "mail.invitation"
ACCEPT_PATH = "/invitations/accept"
INVITABLE_ROLES = ("ADMIN", "READ_ONLY")
TOKEN_PREFIX = "inv_"  # noqa: S105 - the prefix of link tokens, not a secret
MAIL_MAX_ATTEMPTS = 8
#: The longest a token may be (the prefix and 43 characters of base64url); longer input is refused unread.
MAX_TOKEN_LENGTH = 100
log = logging.getLogger("tessera.invitations")


# ---- link tokens ---------------------------------------------------------------------------------


def _link_key(session: Session, tenant_id: uuid.UUID) -> bytes:
    """The tenant's key for link tokens: derived from its derivation key, so links stay valid
    across data key rotations."""
    return get_keyring().derived_key(session, tenant_id, b"tessera invitation link v1")


def link_token(session: Session, tenant_id: uuid.UUID, link_id: uuid.UUID) -> str:
    """The acceptance token of a link (recomputed, never stored): ``inv_`` + 43 base64url characters."""
    mac = hmac.new(_link_key(session, tenant_id), b"invitation-link:" + link_id.bytes, hashlib.sha256).digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def token_digest(token: str) -> str:
    """The stored form of a link token: hex SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()


def _base(settings: Settings) -> str:
    return (settings.public_base_url or f"http://{settings.api_host}:{settings.api_port}").rstrip("/")


def accept_url(settings: Settings, token: str) -> str:
    """The link put in the mail, the invitation page: ``<base>/invitations/accept?token=<token>``."""
    return f"{_base(settings)}{ACCEPT_PATH}?token={token}"


# ---- views ---------------------------------------------------------------------------------------


# ---- management (API key callers) ----------------------------------------------------------------


def _issue_link(session: Session, invitation: TenantInvitation, trace_id: str | None) -> InvitationLink:
    """Supersede the invitation's active links, make a new one and record its mail job."""
    for link in session.exec(
        select(InvitationLink).where(
            InvitationLink.invitation_id == invitation.id, InvitationLink.status == InvitationLinkStatus.ACTIVE
        )
    ):
        link.status = InvitationLinkStatus.SUPERSEDED
        session.add(link)
    link = InvitationLink(tenant_id=invitation.tenant_id, invitation_id=invitation.id, token_digest="")
    link.token_digest = token_digest(link_token(session, invitation.tenant_id, link.id))
    session.add(link)
    jobs.record(
        session,
        kind=MAIL_TASK,
        tenant_id=invitation.tenant_id,
        subject_type="invitation_link",
        subject_id=str(link.id),
        trace_id=trace_id,
        max_attempts=MAIL_MAX_ATTEMPTS,
    )
    return link


def create_invitation(
    session: Session, caller: Caller, *, email: str, role: str, ttl_hours: int, now: dt.datetime | None = None
) -> dict:
    """``POST /tenants/self/invitations``: a PENDING invitation for ``email`` (already validated per
    RFC 5322) expiring ``ttl_hours`` from now; its mail is sent after the commit.

    409 when the address is already a member, or already has a PENDING invitation (resend that one).
    """
    now = now or utcnow()
    email = email.lower()
    if role not in INVITABLE_ROLES:
        raise ValueError(f"role must be one of {INVITABLE_ROLES}")
    get_tenant(session, caller.tenant_id)
    member = session.exec(
        select(TenantMember.id)
        .join(User, col(User.id) == TenantMember.user_id)
        .where(TenantMember.tenant_id == caller.tenant_id, User.email == email)
    ).first()
    if member is not None:
        raise Problem(409, f"{email} is already a member of this tenant.", extra={"member_id": str(member)})
    pending = session.exec(
        select(TenantInvitation.id).where(
            TenantInvitation.tenant_id == caller.tenant_id,
            TenantInvitation.email == email,
            TenantInvitation.status == InvitationStatus.PENDING,
            TenantInvitation.expires_at > now,
        )
    ).first()
    if pending is not None:
        raise Problem(
            409,
            f"{email} already has a pending invitation; "
            f"resend it with POST /tenants/self/invitations/{pending}/resend.",
            extra={"invitation_id": str(pending)},
        )
    invitation = TenantInvitation(
        tenant_id=caller.tenant_id,
        email=email,
        role=role,
        status=InvitationStatus.PENDING,
        expires_at=now + dt.timedelta(hours=ttl_hours),
        created_by=caller.application_id,
        created_at=now,
    )
    session.add(invitation)
    session.flush()
    _issue_link(session, invitation, caller.trace_id)
    audit.record(session, caller, entity_type=INVITATION, entity_id=invitation.id, operation="create")
    return invitation_view(invitation, now)


def get_invitation(
    session: Session, caller: Caller, invitation_id: uuid.UUID, *, lock: bool = False
) -> TenantInvitation:
    """The tenant's invitation, else 404."""
    return get_owned(session, TenantInvitation, invitation_id, caller.tenant_id, what="invitation", lock=lock)


def read_invitation(session: Session, caller: Caller, invitation_id: uuid.UUID) -> dict:
    """``GET /tenants/self/invitations/{id}``."""
    invitation = get_invitation(session, caller, invitation_id)
    audit.record(session, caller, entity_type=INVITATION, entity_id=invitation.id, operation="read")
    return invitation_view(invitation, utcnow())


def list_invitations(session: Session, caller: Caller, *, page: int, size: int) -> tuple[list[dict], int]:
    """``GET /tenants/self/invitations``: one page (oldest first) and the total."""
    where = TenantInvitation.tenant_id == caller.tenant_id
    total = session.exec(select(func.count()).select_from(TenantInvitation).where(where)).one()
    rows = session.exec(
        select(TenantInvitation)
        .where(where)
        .order_by(col(TenantInvitation.created_at), col(TenantInvitation.id))
        .offset((page - 1) * size)
        .limit(size)
    ).all()
    now = utcnow()
    return [invitation_view(row, now) for row in rows], total


def resend_invitation(
    session: Session, caller: Caller, invitation_id: uuid.UUID, *, ttl_hours: int, now: dt.datetime | None = None
) -> dict:
    """``POST /tenants/self/invitations/{id}/resend``: PENDING again, ``expires_at`` = now + ``ttl_hours``,
    earlier links invalid, a new mail sent after the commit."""
    now = now or utcnow()
    invitation = get_invitation(session, caller, invitation_id, lock=True)
    invitation.status = InvitationStatus.PENDING
    invitation.expires_at = now + dt.timedelta(hours=ttl_hours)
    invitation.modified_by = caller.application_id
    invitation.modified_at = now
    session.add(invitation)
    _issue_link(session, invitation, caller.trace_id)
    audit.record(session, caller, entity_type=INVITATION, entity_id=invitation.id, operation="update")
    return invitation_view(invitation, now)


def delete_invitation(session: Session, caller: Caller, invitation_id: uuid.UUID) -> None:
    """``DELETE /tenants/self/invitations/{id}``: the invitation is removed and every link of it revoked."""
    invitation = get_invitation(session, caller, invitation_id, lock=True)
    for link in session.exec(
        select(InvitationLink).where(
            InvitationLink.invitation_id == invitation.id, InvitationLink.status == InvitationLinkStatus.ACTIVE
        )
    ):
        link.status = InvitationLinkStatus.REVOKED
        session.add(link)
    session.delete(invitation)
    audit.record(session, caller, entity_type=INVITATION, entity_id=invitation.id, operation="delete")


# ---- acceptance (the invitee, no API key) --------------------------------------------------------


def _gone(code: str, detail: str) -> Problem:
    return Problem(410, detail, title="The invitation link can no longer be used", extra={"code": code})


def _usable_link(
    session: Session, token: str, now: dt.datetime, *, lock: bool
) -> tuple[InvitationLink, TenantInvitation, Tenant]:
    """The active link of ``token`` with its PENDING invitation and live tenant, else a clear problem:
    404 for a token that was never issued, 410 (with ``code``) for one that can no longer be used."""
    link = None
    if token.startswith(TOKEN_PREFIX) and len(token) <= MAX_TOKEN_LENGTH:
        query = select(InvitationLink).where(InvitationLink.token_digest == token_digest(token))
        link = session.exec(query.with_for_update() if lock else query).first()
    if link is None:
        raise Problem(404, "This invitation link is not valid: check that it was copied whole.")
    if link.status == InvitationLinkStatus.USED:
        raise _gone("invitation_already_accepted", "This invitation was already accepted; a link works once.")
    if link.status == InvitationLinkStatus.SUPERSEDED:
        raise _gone(
            "invitation_link_superseded",
            "The invitation was sent again: this link was replaced; use the link in the latest mail.",
        )
    invitation = session.get(TenantInvitation, link.invitation_id, with_for_update=lock or None)
    tenant = session.get(Tenant, link.tenant_id)
    if (
        link.status == InvitationLinkStatus.REVOKED
        or invitation is None
        or tenant is None
        or tenant.deleted_at is not None
    ):
        raise _gone("invitation_withdrawn", "The invitation was withdrawn.")
    if effective_status(invitation, now) == InvitationStatus.EXPIRED:
        raise _gone(
            "invitation_expired",
            f"The invitation expired at {invitation.expires_at.isoformat()}; ask the tenant to send it again.",
        )
    return link, invitation, tenant


def preview_invitation(session: Session, *, token: str, now: dt.datetime | None = None) -> dict:
    """``GET /invitations/accept?token=``: what the link invites to, without using it."""
    _link, invitation, tenant = _usable_link(session, token, now or utcnow(), lock=False)
    return {
        "tenant": {"id": tenant.id, "name": tenant.name},
        "email": invitation.email,
        "role": invitation.role,
        "expires_at": invitation.expires_at,
    }


def accept_invitation(
    session: Session,
    *,
    token: str,
    first_name: str | None,
    last_name: str | None,
    now: dt.datetime | None = None,
) -> dict:
    """``POST /invitations/accept``: create the user (if new) and the member with the invited role.

    The link is used up and the invitation removed in the same transaction (the link row is locked,
    so two simultaneous acceptances make one member). Names fill in a known user's missing names
    only. 404 for an unknown token, 410 for a used, superseded, withdrawn or expired one, 409 when
    the user is already a member. Returns the member object.
    """
    now = now or utcnow()
    link, invitation, tenant = _usable_link(session, token, now, lock=True)
    user = session.exec(select(User).where(User.email == invitation.email)).first()
    if user is None:
        user = User(email=invitation.email, first_name=first_name, last_name=last_name)
        session.add(user)
        try:
            session.flush()  # the member row refers to it (no ORM relationship orders the inserts)
        except IntegrityError:  # the same address accepted elsewhere at the same moment
            raise Problem(409, "The user is being created by another request; try again.") from None
    else:
        user.first_name = user.first_name or first_name
        user.last_name = user.last_name or last_name
        session.add(user)
        existing = session.exec(
            select(TenantMember.id).where(TenantMember.tenant_id == tenant.id, TenantMember.user_id == user.id)
        ).first()
        if existing is not None:
            raise Problem(409, f"{user.email} is already a member of this tenant.", extra={"member_id": str(existing)})
    member = TenantMember(
        tenant_id=tenant.id, user_id=user.id, role=invitation.role, created_by=user.id, created_at=now
    )
    session.add(member)
    link.status = InvitationLinkStatus.USED
    link.used_at = now
    session.add(link)
    session.delete(invitation)
    try:
        session.flush()
    except IntegrityError:
        raise Problem(409, f"{invitation.email} is already a member of this tenant.") from None
    # The actor of these log rows is the accepting user (a Caller carries the actor in application_id).
    actor = Caller(
        tenant_id=tenant.id,
        tenant_type=tenant.type,
        application_id=user.id,
        application_type=None,
        permissions=frozenset(),
        actor_type="user",
    )
    audit.record(session, actor, entity_type=MEMBER, entity_id=member.id, operation="create")
    audit.record(session, actor, entity_type=INVITATION, entity_id=invitation.id, operation="delete")
    return member_view(member, user)


# ---- expiry (beat) -------------------------------------------------------------------------------


def expire_invitations(session: Session, *, now: dt.datetime | None = None, batch: int = 500) -> int:
    """Move up to ``batch`` PENDING invitations past ``expires_at`` to EXPIRED; returns how many.

    Rows are taken with ``FOR UPDATE SKIP LOCKED`` (PostgreSQL), so two sweeps at once split the
    work and a row is changed, and logged, once.
    """
    now = now or utcnow()
    rows = session.exec(
        select(TenantInvitation)
        .where(TenantInvitation.status == InvitationStatus.PENDING, TenantInvitation.expires_at <= now)
        .order_by(col(TenantInvitation.expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    callers: dict[uuid.UUID, Caller] = {}
    for invitation in rows:
        invitation.status = InvitationStatus.EXPIRED
        invitation.modified_by = None
        invitation.modified_at = now
        session.add(invitation)
        caller = callers.get(invitation.tenant_id)
        if caller is None:
            caller = callers[invitation.tenant_id] = system_caller(row_tenant(session, invitation.tenant_id))
        audit.record(session, caller, entity_type=INVITATION, entity_id=invitation.id, operation="update")
    return len(rows)


# ---- the invitation mail (worker) ----------------------------------------------------------------


@dataclass(frozen=True)
class InvitationMail:
    """One invitation mail, ready to send: ``text`` and ``html`` say the same."""

    to: str
    subject: str
    text: str
    html: str


def prepare_mail(session: Session, link_id: uuid.UUID, settings: Settings, *, now: dt.datetime | None = None):
    """The mail of a link, or None when the link can no longer be used (superseded, revoked, used,
    its invitation expired): a resend or a delete stops mails that were not sent yet."""
    now = now or utcnow()
    link = session.get(InvitationLink, link_id)
    if link is None or link.status != InvitationLinkStatus.ACTIVE:
        return None
    invitation = session.get(TenantInvitation, link.invitation_id)
    tenant = session.get(Tenant, link.tenant_id)
    if invitation is None or tenant is None or tenant.deleted_at is not None:
        return None
    if effective_status(invitation, now) != InvitationStatus.PENDING:
        return None
    token = link_token(session, tenant.id, link.id)
    url = accept_url(settings, token)
    expires = invitation.expires_at.strftime("%Y-%m-%d %H:%M UTC")
    api_url = f"{_base(settings)}{ACCEPT_PATH}"
    text = (
        f"You are invited to join the Tessera tenant '{tenant.name}' with the role {invitation.role}.\n\n"
        f"Open this link to see the invitation and accept it (it works once):\n\n{url}\n\n"
        f"The link expires at {expires}.\n\n"
        f"To accept from a program instead, POST this JSON to {api_url}:\n\n"
        f'{{"token": "{token}", "first_name": "...", "last_name": "..."}}\n\n'
        f"If you did not expect this invitation, ignore this mail.\n"
    )
    name, role, link_html = html.escape(tenant.name), html.escape(invitation.role), html.escape(url, quote=True)
    page = "\n".join(  # one element a line: mail lines stay far below RFC 5322's 998 characters
        [
            f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Invitation to {name}</title></head>',
            f"<body><p>You are invited to join the Tessera tenant <strong>{name}</strong> with the role "
            f"<strong>{role}</strong>.</p>",
            f'<p><a href="{link_html}">See the invitation and accept it</a> (the link works once).</p>',
            f"<p>The link expires at {expires}.</p>",
            f"<p>If the link does not open, copy this address into your browser:<br>{link_html}</p>",
            "<p>If you did not expect this invitation, ignore this mail.</p></body></html>",
        ]
    )
    return InvitationMail(
        to=invitation.email, subject=f"Invitation to join {tenant.name} on Tessera", text=text, html=page
    )


def mail_of_job(session: Session, job: Job, settings: Settings) -> InvitationMail | None:
    """The mail a ``mail.invitation`` job sends (its subject is the link), or None when there is
    nothing to send any more (see :func:`prepare_mail`)."""
    return prepare_mail(session, uuid.UUID(job.subject_id), settings)


def mark_mailed(session: Session, job: Job) -> None:
    """Note on the job's link that its mail went out."""
    link = session.get(InvitationLink, uuid.UUID(job.subject_id))
    if link is not None:
        link.mailed_at = utcnow()
        session.add(link)
