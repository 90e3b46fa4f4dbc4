"""Tenants (spec, core document: Tenant; ``/tenants/self``) and their creation from the CLI."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from pydantic import EmailStr, TypeAdapter, ValidationError
from sqlmodel import Session, col, func, select

from domain.tenancy import audit
from domain.tenancy.auth import caller_cache, new_api_key
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import ALL_PERMISSIONS
from domain.tenancy.views import tenant_view
from infra import jobs
from infra.errors import not_found, validation_problem
from infra.signing import generate_secret
from storage.crypto import get_keyring
from storage.db import on_commit
from storage.models import Application, ApplicationKey, Tenant, TenantMember, User
from storage.types import utcnow

log = logging.getLogger("tessera.tenants")

TENANT_TYPES = ("test", "production")
_EMAIL = TypeAdapter(EmailStr)

#: Tenant settings (spec: Tenant settings) and the values each accepts; all are sent as strings.
SETTING_VALUES: dict[str, tuple[str, ...]] = {
    "fingerprint_tokens": ("true", "false"),
    "disable_ephemeral_proxy": ("true", "false"),
    "deduplicate_tokens": ("true", "false"),
    "token_deduplication_behavior": ("update_existing", "read_existing"),
}
DEFAULT_SETTINGS = {
    "fingerprint_tokens": "false",
    "disable_ephemeral_proxy": "false",
    "deduplicate_tokens": "false",
    "token_deduplication_behavior": "update_existing",
}
WEBHOOK_SECRET_PURPOSE = "webhook-signing-key"  # noqa: S105 - an associated-data label, not a secret


@dataclass(frozen=True)
class NewTenant:
    """What ``tessera tenants create`` prints: the tenant, its management application and key."""

    tenant_id: uuid.UUID
    application_id: uuid.UUID
    api_key: str


def create_tenant(session: Session, *, name: str, owner_email: str, type: str = "test") -> NewTenant:
    """Create a tenant with its owner (an OWNER member), its data key, its webhook signing secret
    and a management application holding every permission.

    Raises ValueError (a one-line message) for a name outside 1 to 200 characters, an unknown type or
    an owner email that is not a well-formed address (RFC 5322, as the API's ``EmailStr`` fields)."""
    if not name or len(name) > 200:
        raise ValueError("name must be 1 to 200 characters")
    if type not in TENANT_TYPES:
        raise ValueError(f"type must be one of {', '.join(TENANT_TYPES)}")
    owner_email = owner_email_address(owner_email)
    owner = session.exec(select(User).where(User.email == owner_email.lower())).first()
    if owner is None:
        owner = User(email=owner_email.lower())
        session.add(owner)
    tenant = Tenant(name=name, type=type, owner_id=owner.id, settings=dict(DEFAULT_SETTINGS))
    session.add(tenant)
    session.flush()
    keyring = get_keyring()
    keyring.create_tenant_key(session, tenant.id)
    tenant.webhook_secret_ct = keyring.encrypt(
        session, tenant.id, WEBHOOK_SECRET_PURPOSE, str(tenant.id), generate_secret().encode()
    )
    session.add(TenantMember(tenant_id=tenant.id, user_id=owner.id, role="OWNER", created_by=owner.id))
    application = Application(
        tenant_id=tenant.id, name=f"{name} management", type="management", permissions=list(ALL_PERMISSIONS)
    )
    session.add(application)
    key, digest = new_api_key()
    session.add(ApplicationKey(tenant_id=tenant.id, application_id=application.id, key_digest=digest))
    return NewTenant(tenant.id, application.id, key)


def owner_email_address(value: str) -> str:
    """``value`` as a well-formed email address (``user@example.com``), else ValueError with one line
    naming it and what is wrong with it."""
    try:
        return _EMAIL.validate_python(value)
    except ValidationError as exc:
        reason = exc.errors(include_url=False)[0]["msg"].removeprefix("value is not a valid email address: ")
        raise ValueError(f"owner email {value!r} is not a valid address: {' '.join(reason.split())}") from None


def list_tenants(session: Session, *, limit: int = 100) -> list[dict]:
    """The live tenants, newest first (at most ``limit``), each ``{id, name, type, owner_email,
    members, created_at}``: what ``tessera tenants list`` shows."""
    members = (
        select(func.count()).select_from(TenantMember).where(TenantMember.tenant_id == Tenant.id).scalar_subquery()
    )
    rows = session.exec(
        select(Tenant, User.email, members)
        .join(User, col(User.id) == Tenant.owner_id, isouter=True)
        .where(col(Tenant.deleted_at).is_(None))
        .order_by(col(Tenant.created_at).desc(), col(Tenant.id).desc())
        .limit(limit)
    ).all()
    return [
        {
            "id": tenant.id,
            "name": tenant.name,
            "type": tenant.type,
            "owner_email": email,
            "members": count,
            "created_at": tenant.created_at,
        }
        for tenant, email, count in rows
    ]


def get_tenant(session: Session, tenant_id: uuid.UUID) -> Tenant:
    """The live tenant; 404 when deleted or unknown."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        raise not_found("tenant")
    return tenant


def read_tenant(session: Session, caller: Caller) -> dict:
    """``GET /tenants/self``."""
    tenant = get_tenant(session, caller.tenant_id)
    audit.record(session, caller, entity_type="tenant", entity_id=tenant.id, operation="read")
    return tenant_view(tenant)


def settings_errors(settings: dict) -> dict[str, list[str]]:
    """Per-field errors for a tenant settings map (values are the strings the spec names)."""
    errors: dict[str, list[str]] = {}
    for key, value in settings.items():
        allowed = SETTING_VALUES.get(key)
        if allowed is None:
            errors[f"settings.{key}"] = ["This setting is not known."]
        elif value not in allowed:
            errors[f"settings.{key}"] = [f"Must be one of {', '.join(repr(v) for v in allowed)} (a string)."]
    return errors


def update_tenant(session: Session, caller: Caller, *, name: str, settings: dict | None) -> dict:
    """``PUT /tenants/self``: replace the name and, when given, merge the settings."""
    on_commit(session, caller_cache.clear)
    errors = settings_errors(settings or {})
    if errors:
        raise validation_problem(errors)
    tenant = get_tenant(session, caller.tenant_id)
    tenant.name = name
    if settings is not None:
        tenant.settings = {**DEFAULT_SETTINGS, **(tenant.settings or {}), **settings}
    tenant.modified_by = caller.application_id
    tenant.modified_at = utcnow()
    session.add(tenant)
    audit.record(session, caller, entity_type="tenant", entity_id=tenant.id, operation="update")
    return tenant_view(tenant)


#: The job that purges a shredded tenant's rows and stored objects (``tasks/keys.py``).
PURGE_TASK = "keys.purge_tenant"


def delete_tenant(session: Session, caller: Caller) -> None:
    """``DELETE /tenants/self``: the tenant and every key of it stop working at once, and the tenant is
    crypto-shredded: in this same transaction its data keys are destroyed (key bytes deleted, not
    only flagged: from the commit on its ciphertext is unreadable, in backups too); then a job
    purges its rows and S3 objects. Audit rows (``tenant`` and ``key``) record both."""
    on_commit(session, caller_cache.clear)
    tenant = get_tenant(session, caller.tenant_id)
    tenant.deleted_at = utcnow()
    tenant.modified_by = caller.application_id
    tenant.modified_at = tenant.deleted_at
    session.add(tenant)
    audit.record(session, caller, entity_type="tenant", entity_id=tenant.id, operation="delete")
    get_keyring().shred(session, tenant.id)
    audit.record(session, caller, entity_type="key", entity_id="all", operation="delete")
    jobs.record(
        session,
        kind=PURGE_TASK,
        tenant_id=None,
        subject_type="tenant",
        subject_id=str(tenant.id),
        trace_id=caller.trace_id,
        max_attempts=10,
    )
    log.info("tenant %s shredded: its data keys are destroyed; its rows and files are purged next", tenant.id)


def webhook_signing_secret(session: Session, tenant_id: uuid.UUID) -> str:
    """The tenant's Standard Webhooks secret (``whsec_...``), decrypted."""
    tenant = get_tenant(session, tenant_id)
    if tenant.webhook_secret_ct is None:
        raise LookupError(f"tenant {tenant.id} has no webhook signing secret")
    return cached_signing_secret(session, tenant.id, tenant.webhook_secret_ct)


#: Decrypted signing secrets of this process: tenant id -> (the ciphertext it came from, the secret).
_SECRETS: dict[uuid.UUID, tuple[bytes, str]] = {}


def cached_signing_secret(session: Session, tenant_id: uuid.UUID, ciphertext: bytes) -> str:
    """The signing secret sealed in ``ciphertext`` (the tenant's ``webhook_secret_ct``), decrypted once
    per process: a webhook worker signs thousands of deliveries a second with a few secrets.

    The cache is keyed by the ciphertext as well as the tenant, so a new secret (a new ciphertext,
    read in the same statement as the deliveries) is decrypted at once: a changed secret is never
    served from the cache.
    """
    cached = _SECRETS.get(tenant_id)
    if cached is not None and cached[0] == ciphertext:
        return cached[1]
    secret = get_keyring().decrypt(session, tenant_id, WEBHOOK_SECRET_PURPOSE, str(tenant_id), ciphertext).decode()
    _SECRETS[tenant_id] = (bytes(ciphertext), secret)
    return secret
