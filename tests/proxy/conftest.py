"""Fixtures of the proxy tests: a tenant in the real database, callers, and stored values."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

import pytest

from domain.tenancy.caller import Caller
from domain.tenancy.permissions import ALL_PERMISSIONS
from domain.tenancy.tenants import create_tenant
from storage.db import session_scope


@dataclass(frozen=True)
class Vault:
    """A tenant and a way to make callers of it holding chosen permissions."""

    tenant_id: uuid.UUID
    application_id: uuid.UUID

    def caller(self, *permissions: str) -> Caller:
        held = frozenset(permissions) if permissions else frozenset(ALL_PERMISSIONS)
        return Caller(self.tenant_id, "test", self.application_id, "server_to_server", held)


def _vault(name: str) -> Vault:
    with session_scope() as session:
        created = create_tenant(session, name=name, owner_email=f"owner-{os.urandom(4).hex()}@example.com")
    return Vault(created.tenant_id, created.application_id)


@pytest.fixture
def vault(database, redis_flushed) -> Vault:
    """A new tenant in the test database."""
    return _vault("proxy")


@pytest.fixture
def other_vault(database, redis_flushed) -> Vault:
    """A second tenant, to prove isolation."""
    return _vault("proxy-other")


def dumps(value) -> bytes:
    return json.dumps(value).encode()
