"""API keys: generation, hashing and lookup.

Keys are 32 random bytes in base64url behind a ``key_`` prefix, shown once and stored only as their
SHA-256 digest (a high-entropy key needs no slow hash); the digest found by the index lookup is
compared again in constant time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from sqlmodel import Session, col, select

from domain.tenancy.caller import Caller
from domain.tenancy.permissions import KNOWN_PERMISSIONS, effective_permissions
from storage.models import Application, ApplicationKey, Tenant

V = TypeVar("V")


def new_api_key() -> tuple[str, str]:
    """A fresh API key and its digest: ``(key, digest)``."""
    key = "key_" + secrets.token_urlsafe(32)
    return key, key_digest(key)


def key_digest(key: str) -> str:
    """The stored form of an API key: hex SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()


def authenticate(session: Session, key: str, *, trace_id: str | None = None) -> Caller | None:
    """The caller owning ``key``, or None when the key is unknown or its tenant is deleted."""
    if not key or len(key) > 200:
        return None
    digest = key_digest(key)
    row = session.exec(
        select(ApplicationKey, Application, Tenant)
        .join(Application, col(Application.id) == ApplicationKey.application_id)
        .join(Tenant, col(Tenant.id) == ApplicationKey.tenant_id)
        .where(col(ApplicationKey.key_digest) == digest, col(Tenant.deleted_at).is_(None))
    ).first()
    if row is None:
        return None
    stored, application, tenant = row
    if not hmac.compare_digest(stored.key_digest, digest):
        return None
    return Caller(
        tenant_id=tenant.id,
        tenant_type=tenant.type,
        application_id=application.id,
        application_type=application.type,
        permissions=effective_permissions(application.permissions),
        tenant_settings=dict(tenant.settings or {}),
        trace_id=trace_id,
    )


def row_tenant(session: Session, tenant_id: uuid.UUID) -> Tenant:
    """The tenant a stored row belongs to, deleted or not. Rows name their tenant by foreign key and
    tenants are only marked deleted, never removed, so an absent one is a broken invariant (LookupError)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise LookupError(f"tenant {tenant_id} does not exist")
    return tenant


def system_caller(tenant: Tenant, *, trace_id: str | None = None) -> Caller:
    """A caller with every permission acting for the platform itself (tasks, the CLI)."""
    return Caller(
        tenant_id=tenant.id,
        tenant_type=tenant.type,
        application_id=None,
        application_type=None,
        permissions=KNOWN_PERMISSIONS,
        tenant_settings=dict(tenant.settings or {}),
        trace_id=trace_id,
        actor_type="system",
    )


class KeyCache(Generic[V]):
    """Secret key digest -> what the key gives (a caller; a proxy's invocation target), each kept
    ``ttl`` seconds; :meth:`clear` after a change made in this process (other processes see it within
    ``ttl``). ``rebind(value, trace_id)`` gives the copy one request sees (its trace id). A cache made
    with ``cleared_with`` is cleared with that one too (what it holds derives from the same keys,
    applications and tenants)."""

    def __init__(self, rebind: Callable[[V, str | None], V], *, cleared_with: KeyCache | None = None) -> None:
        self._rebind = rebind
        self._entries: dict[str, tuple[V, float]] = {}
        self._lock = threading.Lock()
        self._flights: dict[tuple, asyncio.Future] = {}
        self._followers: list[KeyCache] = []
        self._generation = 0  # counts clears: a load that began before one is not kept
        if cleared_with is not None:
            cleared_with._followers.append(self)

    def get(self, key: str, *, trace_id: str | None) -> V | None:
        """The cached value of ``key`` (with this request's trace id), or None."""
        entry = self._entries.get(key_digest(key))
        if entry is None or entry[1] < time.monotonic():
            return None
        return self._rebind(entry[0], trace_id)

    async def get_or_load(
        self, key: str, *, trace_id: str | None, ttl: float, load: Callable[[], Awaitable[V | None]]
    ) -> V | None:
        """The value of ``key`` from the cache, else from ``load()`` (awaited once for all the
        requests of this event loop that miss on the same key meanwhile: when an entry expires
        under load, one lookup, not one per request), kept ``ttl`` seconds unless :meth:`clear` ran
        while it loaded. None for an unknown key (not kept)."""
        cached = self.get(key, trace_id=trace_id)
        if cached is not None:
            return cached
        flight_key = (asyncio.get_running_loop(), key_digest(key))
        flight = self._flights.get(flight_key)
        if flight is None:

            async def load_and_keep() -> V | None:
                generation = self._generation
                try:
                    found = await load()
                finally:
                    self._flights.pop(flight_key, None)
                if found is not None and generation == self._generation:
                    self.put(key, found, ttl)
                return found

            flight = self._flights[flight_key] = asyncio.ensure_future(load_and_keep())
        value = await asyncio.shield(flight)  # a waiter that goes away does not cancel the others'
        return None if value is None else self._rebind(value, trace_id)

    def put(self, key: str, value: V, ttl: float) -> None:
        """Remember ``value`` for ``ttl`` seconds."""
        if ttl <= 0:
            return
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[key_digest(key)] = (value, time.monotonic() + ttl)

    def clear(self) -> None:
        """Forget every entry (and those of the caches cleared with this one)."""
        with self._lock:
            self._entries.clear()
            self._generation += 1
        for follower in self._followers:
            follower.clear()


def _caller_with_trace(caller: Caller, trace_id: str | None) -> Caller:
    return dataclasses.replace(caller, trace_id=trace_id)


class CallerCache(KeyCache[Caller]):
    """API key digest -> Caller, each kept ``ttl`` seconds; :meth:`clear` after a change of keys,
    applications or tenants made in this process."""

    def __init__(self) -> None:
        super().__init__(_caller_with_trace)


#: The process's cache of authenticated callers (used by the api).
caller_cache = CallerCache()
