"""Token intents: card data held for 24 hours until it becomes a token (spec, core document:
"Network token" ``token_intent_id``; tenant setting ``token_deduplication_behavior``).

The spec names token intents without showing their endpoints; the design, documented in the OpenAPI
descriptions of ``app/routes/token_intents.py``:

* ``POST /token-intents`` (``token-intent:create``) ``{"type": "card", "data": {...}}``: card data by the
  rules of :func:`domain.tokens.cards.validate_card`. Answers 201 with the token intent object.
* ``GET /token-intents/{id}`` (``token-intent:read``) and ``DELETE /token-intents/{id}``
  (``token-intent:delete``, 204).
* ``POST /token-intents/{id}/convert`` (``token-intent:read`` and ``token:pci:create``): the intent
  becomes a ``card`` token (201, the token object by the tokens' read rules). The body may carry the
  token request options (``id``, ``metadata``, ``mask``, ``containers``, ``search_indexes``,
  ``fingerprint_expression``, ``deduplicate_token``, ``expires_at``, ``parent_id``); ``type`` and
  ``data`` come from the intent. Deduplication always behaves as ``update_existing`` (the spec's
  note on the tenant setting). Network tokens made from the intent gain the new ``token_id`` and keep
  their ``token_intent_id``. An intent converts once: a second call answers 409 naming the token.

The token intent object: ``id, tenant_id, type, data, fingerprint, token_id, created_by, created_at,
converted_at, expires_at``. ``data`` is always masked like a card token's default mask (number with
the first six and last four digits, expiration; never ``name`` or ``cvc``): no permission reveals an
intent's data; it is readable in full only by becoming a token. ``fingerprint`` is the keyed
fingerprint a card token with the same number gets by default. An intent expires 24 hours after
creation: it then reads as missing everywhere, and the beat sweep ``network_tokens.expire_token_intents``
deletes it. A ``cvc`` is dropped after ``TESSERA_CVC_RETENTION_SECONDS`` like a card token's.

At rest the data is sealed by :func:`storage.crypto.get_keyring` with purpose ``token-intent``, bound to
the tenant and the intent id. Log rows use the entity type ``token-intent``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from config.settings import get_settings
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from domain.tokens.cards import DEFAULT_FINGERPRINT_EXPRESSIONS, default_card_mask, validate_card
from domain.tokens.expressions import apply_mask, make_context, render
from domain.tokens.service import create_tokens
from domain.tokens.validation import parse_token_request
from domain.tokens.views import token_view
from infra.errors import Problem, not_found, validation_problem
from infra.lookup import parse_uuid
from storage.crypto import get_keyring
from storage.models_network_tokens import NetworkToken, TokenIntent
from storage.types import utcnow

INTENT_TYPES = ("card",)
LIFETIME = dt.timedelta(hours=24)
DATA_PURPOSE = "token-intent"
ENTITY_TYPE = "token-intent"
#: Token request options a conversion may add (type and data come from the intent).
CONVERT_OPTIONS = frozenset(
    {
        "id",
        "metadata",
        "mask",
        "containers",
        "search_indexes",
        "fingerprint_expression",
        "deduplicate_token",
        "expires_at",
        "parent_id",
    }
)


# ---- storage helpers -----------------------------------------------------------------------------


def _seal(session: Session, tenant_id: uuid.UUID, intent_id: uuid.UUID, data: dict) -> bytes:
    plain = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return get_keyring().encrypt(session, tenant_id, DATA_PURPOSE, str(intent_id), plain)


def _open(session: Session, intent: TokenIntent, now: dt.datetime) -> dict:
    """The plain data; a ``cvc`` past its retention is left out even before the sweep drops it."""
    data = json.loads(get_keyring().decrypt(session, intent.tenant_id, DATA_PURPOSE, str(intent.id), intent.data_ct))
    if intent.cvc_expires_at is not None and intent.cvc_expires_at <= now:
        data.pop("cvc", None)
    return data


def _get_live(
    session: Session, tenant_id: uuid.UUID, intent_id: object, now: dt.datetime, *, lock: bool = False
) -> TokenIntent:
    """The tenant's unexpired intent, else a 404 problem."""
    parsed = parse_uuid(intent_id)
    query = select(TokenIntent).where(
        TokenIntent.id == parsed, TokenIntent.tenant_id == tenant_id, TokenIntent.expires_at > now
    )
    intent = session.exec(query.with_for_update() if lock else query).first() if parsed else None
    if intent is None:
        raise not_found("token intent")
    return intent


def intent_view(intent: TokenIntent, data: dict) -> dict:
    """The token intent object (``data`` masked by the default card mask)."""
    masked = apply_mask(default_card_mask(), make_context(intent.type, data, {}))
    return {
        "id": intent.id,
        "tenant_id": intent.tenant_id,
        "type": intent.type,
        "data": masked,
        "fingerprint": intent.fingerprint,
        "token_id": intent.token_id,
        "created_by": intent.created_by,
        "created_at": intent.created_at,
        "converted_at": intent.converted_at,
        "expires_at": intent.expires_at,
    }


# ---- the API -------------------------------------------------------------------------------------


def create_intent(session: Session, caller: Caller, *, type: str, data: Any, now: dt.datetime | None = None) -> dict:
    """``POST /token-intents``: a new card intent expiring 24 hours from now.

    400 with ``errors`` keyed ``type`` or ``data.<field>`` (``domain.tokens.cards.validate_card``). An
    expired card is accepted, as ``POST /tokens`` accepts it (the spec sets no expiry rule for either):
    only the form of its expiration is checked. Writes a ``create`` log row.
    """
    now = now or utcnow()
    if type not in INTENT_TYPES:
        raise validation_problem({"type": [f"must be one of {', '.join(INTENT_TYPES)}"]})
    card, errors = validate_card(data, today=now.date(), prefix="data", check_expiry=False)
    if errors or card is None:  # no errors means a card (``validate_card``)
        raise validation_problem(errors)
    keyring = get_keyring()
    intent = TokenIntent(
        tenant_id=caller.tenant_id,
        type=type,
        data_ct=b"",
        created_by=caller.application_id,
        created_at=now,
        expires_at=now + LIFETIME,
    )
    intent.data_ct = _seal(session, caller.tenant_id, intent.id, card)
    fingerprint_input = render(DEFAULT_FINGERPRINT_EXPRESSIONS[type], make_context(type, card, {}))
    intent.fingerprint = keyring.fingerprint(session, caller.tenant_id, fingerprint_input)
    if card.get("cvc"):
        intent.cvc_expires_at = now + dt.timedelta(seconds=get_settings().cvc_retention_seconds)
    session.add(intent)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=intent.id, operation="create")
    return intent_view(intent, card)


def read_intent(session: Session, caller: Caller, intent_id: object, *, now: dt.datetime | None = None) -> dict:
    """``GET /token-intents/{id}``: 404 when missing, expired or another tenant's. Writes a ``read`` log row."""
    now = now or utcnow()
    intent = _get_live(session, caller.tenant_id, intent_id, now)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=intent.id, operation="read")
    return intent_view(intent, _open(session, intent, now))


def delete_intent(session: Session, caller: Caller, intent_id: object, *, now: dt.datetime | None = None) -> None:
    """``DELETE /token-intents/{id}``: 404 as :func:`read_intent`. Tokens and network tokens made from
    it stay. Writes a ``delete`` log row."""
    now = now or utcnow()
    intent = _get_live(session, caller.tenant_id, intent_id, now, lock=True)
    session.delete(intent)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=intent.id, operation="delete")


def load_intent_data(
    session: Session, tenant_id: uuid.UUID, intent_id: object, *, now: dt.datetime | None = None
) -> tuple[TokenIntent, dict]:
    """``(intent, plain card data)`` of a live intent, for platform features (network tokens). No
    permission check and no log row: the caller does both. Raises a 404 problem when missing or expired."""
    now = now or utcnow()
    intent = _get_live(session, tenant_id, intent_id, now)
    return intent, _open(session, intent, now)


def convert_intent(
    session: Session, caller: Caller, intent_id: object, options: Any, *, now: dt.datetime | None = None
) -> dict:
    """``POST /token-intents/{id}/convert``: the intent becomes a ``card`` token; returns the token object.

    ``options`` (object or None) holds token request options (:data:`CONVERT_OPTIONS`); ``type`` or
    ``data`` in it is a 400. The token is created by :func:`domain.tokens.service.create_tokens` (its checks:
    ``token:pci:create``, aliases, containers ...) with deduplication behaving as ``update_existing``.
    Network tokens made from the intent gain ``token_id``. 404 as :func:`read_intent`; 409 (with
    ``token_id``) when the intent was converted already. Writes an ``update`` log row for the intent.
    """
    now = now or utcnow()
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise validation_problem({"body": ["must be an object of token request options"]})
    errors = {
        name: ["comes from the token intent" if name in ("type", "data") else "This property is not allowed."]
        for name in options
        if name not in CONVERT_OPTIONS
    }
    if errors:
        raise validation_problem(errors)
    intent = _get_live(session, caller.tenant_id, intent_id, now, lock=True)
    if intent.token_id is not None:
        raise Problem(
            409,
            "The token intent was converted already.",
            title="Token intent converted",
            extra={"token_id": intent.token_id},
        )
    # "token intents ignore token_deduplication_behavior and always behave as update_existing"
    converting = dataclasses.replace(
        caller, tenant_settings={**caller.tenant_settings, "token_deduplication_behavior": "update_existing"}
    )
    request, errors = parse_token_request(
        {**options, "type": intent.type, "data": _open(session, intent, now)}, converting, now=now
    )
    if errors or request is None:  # no errors means a request (``parse_token_request``)
        raise validation_problem(errors)
    (created,) = create_tokens(session, converting, [request], now=now)
    intent.token_id = created.token.id
    intent.converted_at = now
    session.add(intent)
    session.execute(
        update(NetworkToken)
        .where(
            col(NetworkToken.tenant_id) == caller.tenant_id,
            col(NetworkToken.token_intent_id) == intent.id,
            col(NetworkToken.token_id).is_(None),
        )
        .values(token_id=created.token.id)
        .execution_options(synchronize_session=False)
    )
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=intent.id, operation="update")
    return token_view(created.token, created.data, caller)


# ---- sweeps (beat) -------------------------------------------------------------------------------


def delete_expired_intents(session: Session, *, now: dt.datetime, batch: int = 500) -> int:
    """Delete up to ``batch`` intents past ``expires_at`` (rows locked elsewhere skipped); returns how
    many. Call again while it returns ``batch``."""
    rows = session.exec(
        select(TokenIntent)
        .where(col(TokenIntent.expires_at) <= now)
        .order_by(col(TokenIntent.expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for intent in rows:
        session.delete(intent)
    return len(rows)


def purge_intent_verification_codes(session: Session, *, now: dt.datetime, batch: int = 500) -> int:
    """Reseal up to ``batch`` intents whose ``cvc_expires_at`` has passed without their ``cvc``."""
    rows = session.exec(
        select(TokenIntent)
        .where(col(TokenIntent.cvc_expires_at).is_not(None), col(TokenIntent.cvc_expires_at) <= now)
        .order_by(col(TokenIntent.cvc_expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for intent in rows:
        intent.data_ct = _seal(session, intent.tenant_id, intent.id, _open(session, intent, now))
        intent.cvc_expires_at = None
        session.add(intent)
    return len(rows)
