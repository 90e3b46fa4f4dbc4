"""Celery beat's schedule: the outbox relay and the sweeps of leases and expirations.

Every entry carries ``expires`` shorter than its period, so a backlog of missed runs is dropped
rather than piled up; every sweep works in batches and is safe to run twice or on two beat processes.
"""

from __future__ import annotations

from typing import Any

from config.settings import Settings


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The schedule dict for ``app.conf.beat_schedule``: every entry runs on the ``sweeps`` queue.

    The relay, the stale-lease release and the look for account updater uploads are gated by beat's
    scheduler (``workers/beat.py``): sent only when a cheap query finds work for them.
    """
    relay_every = max(1.0, settings.outbox_relay_after_seconds / 3)
    entries: dict[str, dict[str, Any]] = {
        "outbox-relay": {
            "task": "sweeps.relay_outbox",
            "schedule": relay_every,
            "options": {"expires": relay_every},
        },
        "expired-tokens": {
            "task": "sweeps.delete_expired_tokens",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "token-idempotency-keys": {
            "task": "sweeps.forget_idempotency_keys",
            "schedule": 300.0,
            "options": {"expires": 290},
        },
        "card-verification-codes": {
            "task": "sweeps.purge_card_verification_codes",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "account-updater-uploads": {
            "task": "account_updater.detect_uploads",
            "schedule": 5.0,
            "options": {"expires": 5},
        },
        "account-updater-expired-jobs": {
            "task": "account_updater.remove_expired_jobs",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "token-intents": {
            "task": "network_tokens.expire_token_intents",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "reactor-results": {
            "task": "reactors.purge_results",
            "schedule": 300.0,
            "options": {"expires": 290},
        },
        "invitation-expiry": {
            "task": "tenancy.expire_invitations",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "client-key-destruction": {
            "task": "client_keys.destroy_client_keys",
            "schedule": 60.0,
            "options": {"expires": 55},
        },
        "document-purge": {
            "task": "documents.sweep_documents",
            "schedule": 300.0,
            "options": {"expires": 290},
        },
        "agentic-operation-leases": {
            "task": "agentic.release_stale_operation_leases",
            "schedule": 30.0,
            "options": {"expires": 25},
        },
        "agentic-provider-errors": {
            "task": "agentic.purge_provider_errors",
            "schedule": 3600.0,
            "options": {"expires": 3300},
        },
        "agentic-allowances": {
            "task": "agentic.sweep_allowances",
            "schedule": 30.0,
            "options": {"expires": 25},
        },
        "stale-leases": {
            "task": "sweeps.release_stale_leases",
            "schedule": 30.0,
            "options": {"expires": 25},
        },
    }
    for entry in entries.values():
        entry["options"]["queue"] = "sweeps"
    return entries
