"""The client key sweep, run by the real worker: expired keys lose their private key material (core
document section 2: Client encryption keys)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from storage.db import session_scope
from storage.models_client_keys import ClientEncryptionKey
from tasks import client_keys
from tests.helpers import wait_until

pytestmark = pytest.mark.worker


def test_expired_client_keys_lose_their_private_key(api, tenant):
    created = tenant.client.post("/keys", {}).json
    kept = tenant.client.post("/keys", {}).json
    with session_scope() as session:
        key = session.get(ClientEncryptionKey, uuid.UUID(created["key_id"]))
        key.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(key)
    client_keys.destroy_client_keys.delay()

    def destroyed() -> bool:
        with session_scope() as session:
            return session.get(ClientEncryptionKey, uuid.UUID(created["key_id"])).private_key_ct is None

    wait_until(destroyed, timeout=20)
    with session_scope() as session:
        row = session.get(ClientEncryptionKey, uuid.UUID(created["key_id"]))
        assert row.destroyed_at is not None
        assert session.get(ClientEncryptionKey, uuid.UUID(kept["key_id"])).private_key_ct is not None
    # still listed (until deleted), with its expiry
    assert tenant.client.get(f"/keys/{created['key_id']}").status == 200
