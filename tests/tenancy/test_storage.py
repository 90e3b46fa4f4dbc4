"""This capability's tables on both backends: the models agree with migration 0005 on PostgreSQL and on
SQLite (the embedded default), and the domain functions that use backend-specific SQL (insert-or-ignore,
``SKIP LOCKED``) work on SQLite too."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from joserfc import jwe
from joserfc.jwk import OKPKey
from sqlmodel import Session, SQLModel

from domain.client_keys import service as client_keys
from domain.tenancy import invitations, usage
from domain.tenancy.auth import system_caller
from domain.tenancy.tenants import create_tenant
from storage import migrate
from storage.db import make_engine
from storage.models import Tenant

pytestmark = pytest.mark.unit

TABLES = {"tenant_invitations", "tenant_invitation_links", "client_encryption_keys", "documents", "token_activity"}


def _table_of(diff) -> str | None:
    """The table a diff entry of alembic's compare_metadata is about."""
    entry = diff[0] if isinstance(diff, list) else diff
    for item in entry[1:]:
        name = getattr(item, "name", None) if not isinstance(item, str) else None
        table = getattr(item, "table", None)
        if table is not None and getattr(table, "name", None):
            return table.name
        if name and name in TABLES:
            return name
        if isinstance(item, str) and item in TABLES:
            return item
    return None


def _my_differences(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            diffs = compare_metadata(context, SQLModel.metadata)
    finally:
        engine.dispose()
    return [d for d in diffs if _table_of(d) in TABLES]


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'tessera.db'}"
    migrate.upgrade(url)
    return url


def test_models_agree_with_the_migration_on_postgresql(database):
    assert _my_differences(database) == []


def test_models_agree_with_the_migration_on_sqlite(sqlite_url):
    assert _my_differences(sqlite_url) == []


def test_the_domain_runs_on_sqlite(sqlite_url):
    engine = make_engine(sqlite_url)
    now = dt.datetime.now(dt.UTC)
    try:
        with Session(engine, expire_on_commit=False) as session:
            created = create_tenant(session, name="lite", owner_email="lite@example.com")
            session.commit()
            caller = system_caller(session.get(Tenant, created.tenant_id))

            invitation = invitations.create_invitation(
                session, caller, email="new@example.com", role="READ_ONLY", ttl_hours=72
            )
            link = session.exec(
                invitations.select(invitations.InvitationLink).where(
                    invitations.InvitationLink.invitation_id == invitation["id"]
                )
            ).one()
            token = invitations.link_token(session, created.tenant_id, link.id)
            session.commit()
            member = invitations.accept_invitation(session, token=token, first_name="Lite", last_name=None)
            session.commit()
            assert member["role"] == "READ_ONLY" and member["user"]["email"] == "new@example.com"

            invitations.create_invitation(session, caller, email="late@example.com", role="ADMIN", ttl_hours=1)
            session.commit()
            assert invitations.expire_invitations(session, now=now + dt.timedelta(hours=2)) == 1
            session.commit()
            assert invitations.expire_invitations(session, now=now + dt.timedelta(hours=2)) == 0

            usage.record_token_activity(session, created.tenant_id, ["a", "b", "a"], now=now)
            usage.record_token_activity(session, created.tenant_id, ["b", "c"], now=now)
            session.commit()
            assert usage.monthly_active_tokens(session, created.tenant_id, now=now) == 3
            report = usage.usage_report(session, caller, included=5)["token_report"]
            assert report == {"metrics_by_type": {}, "included_monthly_active_tokens": 5, "monthly_active_tokens": 3}

            key = client_keys.create_key(session, caller, expires_at=None, default_days=30)
            session.commit()
            protected = {"alg": "ECDH-ES", "enc": "A256GCM", "kid": key["key_id"]}
            token = jwe.encrypt_compact(
                protected,
                json.dumps({"data": {"n": 1}}),
                OKPKey.import_key(key["public_key_pem"]),
                algorithms=["ECDH-ES", "A256GCM"],
            )
            assert client_keys.decrypt_jwe(session, created.tenant_id, token) == {"data": {"n": 1}}
            assert client_keys.destroy_expired_keys(session, now=now + dt.timedelta(days=31)) == 1
            session.commit()
    finally:
        engine.dispose()
