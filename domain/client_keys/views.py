"""The public shapes of client encryption keys (core document section 2, Client encryption key)."""

from __future__ import annotations

from storage.models_client_keys import ClientEncryptionKey


def key_view(key: ClientEncryptionKey) -> dict:
    """The public key object without the public key: key_id, expires_at, created_by, created_at."""
    return {
        "key_id": str(key.id),
        "expires_at": key.expires_at,
        "created_by": key.created_by,
        "created_at": key.created_at,
    }
