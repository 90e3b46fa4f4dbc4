"""Idempotency keys of token creation: ``POST /tokens`` and ``POST /tokenize`` (beyond the spec, as the
hosted service does for tokens and the official client libraries send).

``<prefix>-IDEMPOTENCY-KEY`` (1 to :data:`MAX_KEY_LENGTH` printable ASCII characters, :func:`key_errors`)
is optional. With it, the key alone defines sameness within the tenant and the endpoint (the body is
not compared): the first request creates and its answer is kept, sealed with the tenant's data key
(it may hold token data); every later request with the key answers that original answer and creates
nothing. A request that fails (400, 403, 409) keeps nothing: its key may be used again.

Concurrency: :func:`once` writes the key's row in the transaction that creates the tokens (one
``INSERT ... ON CONFLICT`` statement, :func:`storage.sql.upsert_when`); a second request with the key
waits on PostgreSQL for the first transaction to end, then answers its committed answer (or, when the
first rolled back, creates itself). Keys are kept at least :data:`RETENTION` (24 hours) from their
first use; an older row is taken over by the next request with its key, and
:func:`forget_old_keys` (a beat sweep) deletes old rows in batches.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from pydantic_core import to_jsonable_python
from sqlalchemy import delete, select, update
from sqlmodel import Session, col

from domain.tenancy.caller import Caller
from storage.crypto import get_keyring
from storage.models import TokenIdempotencyKey
from storage.sql import upsert_when
from storage.types import utcnow

MAX_KEY_LENGTH = 255
RETENTION = dt.timedelta(hours=24)
TOKENS = "tokens"
TOKENIZE = "tokenize"
ANSWER_PURPOSE = "token-idempotency-answer"


def key_errors(key: str, header: str) -> dict[str, list[str]]:
    """The validation errors of a supplied idempotency key, keyed by ``header`` (empty when fine)."""
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        return {header: [f"must be 1 to {MAX_KEY_LENGTH} characters"]}
    if not key.isprintable() or not key.isascii():
        return {header: ["must be printable ASCII characters"]}
    return {}


def once(
    session: Session,
    caller: Caller,
    scope: str,
    key: str | None,
    create: Callable[..., Any],
    /,
    *args: Any,
    now: dt.datetime | None = None,
    **kwargs: Any,
) -> Any:
    """``create(session, caller, *args, **kwargs)`` once per ``key`` of the caller's tenant in ``scope``
    (:data:`TOKENS` or :data:`TOKENIZE`): the first call's answer (JSON) is kept, sealed, and returned
    by every later call with the key, which creates nothing. Without a key, ``create`` simply runs.
    ``create``'s problems propagate (and, raised in the caller's transaction, keep nothing)."""
    if key is None:
        return create(session, caller, *args, **kwargs)
    now = now or utcnow()
    where = (
        col(TokenIdempotencyKey.tenant_id) == caller.tenant_id,
        col(TokenIdempotencyKey.scope) == scope,
        col(TokenIdempotencyKey.key) == key,
    )
    values = {"tenant_id": caller.tenant_id, "scope": scope, "key": key, "answer_ct": None, "created_at": now}
    taken = upsert_when(
        session,
        TokenIdempotencyKey,
        values,
        index=["tenant_id", "scope", "key"],
        when=TokenIdempotencyKey.created_at <= now - RETENTION,
    )
    keyring = get_keyring()
    aad = f"{scope}:{key}"
    if not taken:
        sealed = session.execute(select(col(TokenIdempotencyKey.answer_ct)).where(*where)).scalar_one()
        return json.loads(keyring.decrypt(session, caller.tenant_id, ANSWER_PURPOSE, aad, sealed))
    answer = create(session, caller, *args, **kwargs)
    plain = json.dumps(to_jsonable_python(answer), separators=(",", ":"), ensure_ascii=False).encode()
    sealed = keyring.encrypt(session, caller.tenant_id, ANSWER_PURPOSE, aad, plain)
    session.execute(update(TokenIdempotencyKey).where(*where).values(answer_ct=sealed))
    return answer


def forget_old_keys(session: Session, *, now: dt.datetime, batch: int = 500) -> int:
    """Delete up to ``batch`` keys first used more than :data:`RETENTION` before ``now`` (rows locked
    elsewhere skipped); returns how many. Call again while it returns ``batch``."""
    old = (
        select(col(TokenIdempotencyKey.tenant_id), col(TokenIdempotencyKey.scope), col(TokenIdempotencyKey.key))
        .where(col(TokenIdempotencyKey.created_at) <= now - RETENTION)
        .order_by(col(TokenIdempotencyKey.created_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    )
    rows = session.execute(old).all()
    for tenant_id, scope, key in rows:
        session.execute(
            delete(TokenIdempotencyKey).where(
                col(TokenIdempotencyKey.tenant_id) == tenant_id,
                col(TokenIdempotencyKey.scope) == scope,
                col(TokenIdempotencyKey.key) == key,
                col(TokenIdempotencyKey.created_at) <= now - RETENTION,
            )
        )
    return len(rows)
