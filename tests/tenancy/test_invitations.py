"""Invitations: create, list, get, resend, delete and accept, with the mails sent by the real worker to a
real SMTP server (core document sections 2-4, Tenant members and invitations)."""

from __future__ import annotations

import datetime as dt
import os
import uuid

import pytest
from sqlmodel import select

from domain.tenancy import invitations
from storage.db import session_scope
from storage.models import Job, TenantMember, User
from storage.models_tenancy import InvitationLink, TenantInvitation
from tests.helpers import assert_problem, wait_until

pytestmark = pytest.mark.api


def _address(prefix: str = "invitee") -> str:
    return f"{prefix}-{os.urandom(4).hex()}@example.com"


def _invite(tenant, email: str, **extra) -> dict:
    answer = tenant.client.post("/tenants/self/invitations", {"email": email, **extra})
    assert answer.status == 201, answer
    return answer.json


def _accept(client, token: str, **names):
    return client.with_key(None).post("/invitations/accept", {"token": token, **names})


def test_create_mails_a_link_that_accepts_once(api, tenant, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    assert invitation["email"] == email
    assert invitation["role"] == "ADMIN"
    assert invitation["status"] == "PENDING"
    assert invitation["tenant_id"] == str(tenant.id)
    assert invitation["created_by"] == str(tenant.application_id)
    expires = dt.datetime.fromisoformat(invitation["expires_at"])
    created = dt.datetime.fromisoformat(invitation["created_at"])
    assert expires - created == dt.timedelta(hours=72)

    [mail] = mailbox.wait_for(email)
    assert mail.to == email
    assert "acme" in mail.message["Subject"]
    assert mail.link.startswith(f"{api.base_url}/invitations/accept?token=inv_")
    assert "ADMIN" in mail.text

    # the link's token answers what it invites to, without using it up
    preview = api.client().get(f"/invitations/accept?token={mail.token}")
    assert preview.status == 200, preview
    assert preview.json["tenant"] == {"id": str(tenant.id), "name": "acme"}
    assert preview.json["email"] == email and preview.json["role"] == "ADMIN"

    # only a digest of the token is stored
    with session_scope() as session:
        links = session.exec(select(InvitationLink).where(InvitationLink.invitation_id == uuid.UUID(invitation["id"])))
        [link] = links.all()
        assert link.token_digest == invitations.token_digest(mail.token)
        assert mail.token not in link.token_digest
    # the mail task records the sending in the transaction after the SMTP answer: it follows the mail shortly
    assert wait_until(lambda: _link_mailed_at(invitation["id"]), timeout=10) is not None

    accepted = _accept(api.client(), mail.token, first_name="Ada", last_name="Lovelace")
    assert accepted.status == 201, accepted
    member = accepted.json
    assert member["tenant_id"] == str(tenant.id)
    assert member["role"] == "ADMIN"
    assert member["user"]["email"] == email
    assert member["user"]["first_name"] == "Ada" and member["user"]["last_name"] == "Lovelace"

    logs = tenant.client.get("/logs?entity_type=tenant_member").json["data"]
    assert [(r["entity_id"], r["operation"], r["actor_type"], r["actor_id"]) for r in logs] == [
        (member["id"], "create", "user", member["user"]["id"])
    ]
    listed = tenant.client.get(f"/tenants/self/members?user_id={member['user']['id']}").json
    assert [m["id"] for m in listed["data"]] == [member["id"]]
    # the accepted invitation is gone; its link works once
    assert tenant.client.get(f"/tenants/self/invitations/{invitation['id']}").status == 404
    again = assert_problem(_accept(api.client(), mail.token), 410)
    assert again["code"] == "invitation_already_accepted"
    assert "already accepted" in again["detail"]


def test_read_only_role_and_an_existing_user(api, tenant, other_tenant, mailbox):
    email = _address("known")
    # the user already belongs to another tenant (with names): accepting reuses the user
    first = _invite(other_tenant, email)
    [mail] = mailbox.wait_for(email)
    assert _accept(api.client(), mail.token, first_name="Grace").status == 201
    assert first["role"] == "ADMIN"

    invitation = _invite(tenant, email.upper(), role="READ_ONLY")
    assert invitation["email"] == email and invitation["role"] == "READ_ONLY"
    mails = mailbox.wait_for(email, count=2)
    member = _accept(api.client(), mails[-1].token, first_name="Other", last_name="Hopper")
    assert member.status == 201, member
    assert member.json["role"] == "READ_ONLY"
    assert member.json["user"]["first_name"] == "Grace"  # a known user's names are kept
    assert member.json["user"]["last_name"] == "Hopper"  # missing ones are filled in
    with session_scope() as session:
        assert len(session.exec(select(User).where(User.email == email)).all()) == 1


def test_resend_invalidates_earlier_links_and_extends_the_life(api, tenant, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    [first] = mailbox.wait_for(email)

    resent = tenant.client.post(f"/tenants/self/invitations/{invitation['id']}/resend")
    assert resent.status == 200, resent
    assert resent.json["status"] == "PENDING"
    new_expiry = dt.datetime.fromisoformat(resent.json["expires_at"])
    assert new_expiry > dt.datetime.fromisoformat(invitation["expires_at"])
    assert abs(new_expiry - (dt.datetime.now(dt.UTC) + dt.timedelta(hours=72))) < dt.timedelta(seconds=30)
    assert resent.json["modified_by"] == str(tenant.application_id)

    first_again, second = mailbox.wait_for(email, count=2)
    assert first_again.token == first.token
    assert second.token != first.token

    old = assert_problem(_accept(api.client(), first.token), 410)
    assert old["code"] == "invitation_link_superseded"
    assert "latest mail" in old["detail"]
    assert _accept(api.client(), second.token).status == 201


def test_delete_invalidates_every_link(api, tenant, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    [mail] = mailbox.wait_for(email)
    assert tenant.client.delete(f"/tenants/self/invitations/{invitation['id']}").status == 204
    assert tenant.client.get(f"/tenants/self/invitations/{invitation['id']}").status == 404
    assert tenant.client.delete(f"/tenants/self/invitations/{invitation['id']}").status == 404
    gone = assert_problem(_accept(api.client(), mail.token), 410)
    assert gone["code"] == "invitation_withdrawn"
    assert assert_problem(api.client().get(f"/invitations/accept?token={mail.token}"), 410)["code"] == (
        "invitation_withdrawn"
    )


def test_an_expired_link_is_refused_and_a_resend_revives_the_invitation(api, tenant, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    [mail] = mailbox.wait_for(email)
    with session_scope() as session:
        row = session.get(TenantInvitation, uuid.UUID(invitation["id"]))
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(row)
    # reads never show PENDING past expires_at, even before the sweep
    assert tenant.client.get(f"/tenants/self/invitations/{invitation['id']}").json["status"] == "EXPIRED"
    expired = assert_problem(_accept(api.client(), mail.token), 410)
    assert expired["code"] == "invitation_expired"
    assert "expired" in expired["detail"]

    revived = tenant.client.post(f"/tenants/self/invitations/{invitation['id']}/resend")
    assert revived.json["status"] == "PENDING"
    _, fresh = mailbox.wait_for(email, count=2)
    assert _accept(api.client(), fresh.token).status == 201


def test_unknown_and_malformed_tokens(api):
    client = api.client()
    assert_problem(_accept(client, "inv_" + "A" * 43), 404)
    assert_problem(_accept(client, "not-a-token"), 404)
    body = assert_problem(client.post("/invitations/accept", {"first_name": "x"}), 400)
    assert "token" in body["errors"]
    body = assert_problem(client.post("/invitations/accept", {"token": "inv_x", "role": "OWNER"}), 400)
    assert "role" in body["errors"]
    assert "token" in assert_problem(client.get("/invitations/accept"), 400)["errors"]


def test_a_transient_smtp_failure_is_retried(api, tenant, mailbox):
    email = _address("later")
    mailbox.refuse(email, 1)
    invitation = _invite(tenant, email)
    [mail] = mailbox.wait_for(email, timeout=30)
    assert mailbox.refused(email) == 1
    assert mail.link
    with session_scope() as session:
        [link] = session.exec(
            select(InvitationLink).where(InvitationLink.invitation_id == uuid.UUID(invitation["id"]))
        ).all()

    def settled_job():  # the mail arrives just before the worker commits the job's outcome
        with session_scope() as session:
            job = session.exec(select(Job).where(Job.subject_id == str(link.id))).one()
        return job if job.status != "running" else None

    job = wait_until(settled_job)
    assert job.kind == "mail.invitation"
    assert job.status == "succeeded"
    assert job.attempts == 2
    assert "451" in job.last_error


def test_duplicates_conflict(api, tenant, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    duplicate = assert_problem(tenant.client.post("/tenants/self/invitations", {"email": email}), 409)
    assert duplicate["invitation_id"] == invitation["id"]
    [mail] = mailbox.wait_for(email)
    assert _accept(api.client(), mail.token).status == 201
    member = assert_problem(tenant.client.post("/tenants/self/invitations", {"email": email}), 409)
    assert "already a member" in member["detail"]
    with session_scope() as session:
        owner_email = session.exec(
            select(User.email)
            .join(TenantMember, TenantMember.user_id == User.id)
            .where(TenantMember.tenant_id == tenant.id, TenantMember.role == "OWNER")
        ).one()
    assert_problem(tenant.client.post("/tenants/self/invitations", {"email": owner_email}), 409)


def test_list_pages(api, tenant, mailbox):
    emails = [_address(f"p{n}") for n in range(5)]
    ids = [_invite(tenant, email)["id"] for email in emails]
    page = tenant.client.get("/tenants/self/invitations?page=2&size=2")
    assert page.status == 200, page
    assert page.json["pagination"] == {"total_items": 5, "page_number": 2, "page_size": 2, "total_pages": 3}
    assert [i["id"] for i in page.json["data"]] == ids[2:4]
    assert [i["id"] for i in tenant.client.get("/tenants/self/invitations?size=100").json["data"]] == ids
    assert "size" in assert_problem(tenant.client.get("/tenants/self/invitations?size=101"), 400)["errors"]
    for email in emails:
        mailbox.wait_for(email)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"email": "not-an-address"}, "email"),
        ({"email": "a@b"}, "email"),
        ({"email": "two@@example.com"}, "email"),
        ({"email": "x@example.com", "role": "OWNER"}, "role"),
        ({"email": "x@example.com", "role": "admin"}, "role"),
        ({"role": "ADMIN"}, "email"),
        ({"email": "x@example.com", "expires_at": "2030-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_invalid_invitations_are_refused(tenant, body, field):
    answer = assert_problem(tenant.client.post("/tenants/self/invitations", body), 400)
    assert field in answer["errors"]
    assert tenant.client.get("/tenants/self/invitations").json["data"] == []


def test_permissions_follow_the_table(api, tenant, limited, mailbox):
    email = _address()
    invitation = _invite(tenant, email)
    path = f"/tenants/self/invitations/{invitation['id']}"
    creator = limited(tenant, ["tenant:invitation:create"])
    updater = limited(tenant, ["tenant:invitation:update"])
    both = limited(tenant, ["tenant:invitation:create", "tenant:invitation:update"])
    reader = limited(tenant, ["tenant:invitation:read"])
    deleter = limited(tenant, ["tenant:invitation:delete"])

    assert_problem(reader.post("/tenants/self/invitations", {"email": _address()}), 403)
    assert creator.post("/tenants/self/invitations", {"email": _address()}).status == 201
    assert_problem(creator.post(f"{path}/resend"), 403)
    assert_problem(updater.post(f"{path}/resend"), 403)
    assert both.post(f"{path}/resend").status == 200
    assert_problem(creator.get(path), 403)
    assert_problem(creator.get("/tenants/self/invitations"), 403)
    assert reader.get(path).status == 200
    assert reader.get("/tenants/self/invitations").status == 200
    assert_problem(reader.delete(path), 403)
    assert deleter.delete(path).status == 204
    mailbox.wait_for(email, count=2)


def test_other_tenants_invitations_are_not_found(api, tenant, other_tenant, mailbox):
    email = _address()
    theirs = _invite(other_tenant, email)
    path = f"/tenants/self/invitations/{theirs['id']}"
    assert_problem(tenant.client.get(path), 404)
    assert_problem(tenant.client.post(f"{path}/resend"), 404)
    assert_problem(tenant.client.delete(path), 404)
    assert_problem(tenant.client.get("/tenants/self/invitations/not-a-uuid"), 404)
    assert tenant.client.get("/tenants/self/invitations").json["data"] == []
    assert other_tenant.client.get(path).status == 200
    mailbox.wait_for(email)


def _link_mailed_at(invitation_id: str) -> dt.datetime | None:
    """When the invitation's link was recorded as mailed (None: not yet)."""
    with session_scope() as session:
        query = select(InvitationLink).where(InvitationLink.invitation_id == uuid.UUID(invitation_id))
        return session.exec(query).one().mailed_at
