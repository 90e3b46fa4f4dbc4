"""The token domain's verbs: tokenize, create, read, update, delete, list, search, children and sweeps.

One place for every rule about tokens (spec, core document: "Token", "Tokenize", "Token children",
"Payment-forwarding connection", sections 5, 8 and 9; ``spec/README.md`` decisions 7 and 8). API
handlers, Celery tasks and later features (network tokens, the account updater, the proxy) call
these functions inside their own unit of work (``fn(session, ...)``); nothing here commits.

The rules sit in the package's modules, named for their concern:

* :mod:`domain.tokens.validation` - the token request object and its one validation; the
  ``/tokenize`` walk, the payment-forwarding body and merge patches. Types: ``token`` (any JSON
  value), ``card`` and ``bank`` (:mod:`domain.tokens.cards`); the type names the default
  classification (card -> ``pci``, bank -> ``bank``, token -> ``general``) and the default container
  ``/<classification>/high/``. Card and bank containers must be of their type's classification; a
  ``token`` may be placed in the containers of any one classification, which is then its
  classification.
* :mod:`domain.tokens.access` - read levels (complete, masked or no data; ``GET /tokens/{id}`` 403
  without any read permission of the classification); :mod:`domain.tokens.views` - the token object
  (a card's ``cvc`` is never returned).
* :mod:`domain.tokens.store` - sealing (``keyring.encrypt``), blind indexes, the rows a new token
  writes, log rows and events (``token.created``, ``token.updated``, ``token.deleted`` carry
  ``{"token": {"id", "type"}}`` only and are recorded when an enabled webhook of the tenant
  subscribes to the type; ``domain.webhooks.events.emit`` into the caller's rows).
  :mod:`domain.tokens.creation` - aliases, parents and deduplication.
* :mod:`domain.tokens.search` - the v2 search query; :mod:`domain.tokens.expressions` - the Liquid
  expressions of masks, fingerprints and search indexes.

**Expiry.** A token whose ``expires_at`` has passed reads as missing (404) everywhere at once;
:func:`delete_expired_tokens` removes it later. A card's ``cvc`` is dropped ``cvc_retention_seconds``
after it was stored (:func:`purge_card_verification_codes`).

**The hot path** (tokenize, create, reads, list, search) builds no ORM objects: new tokens are
``NewToken`` rows, reads select plain rows, and the rows a unit of work writes (tokens, metadata,
blind indexes, log rows, events, deliveries, activity) go out in one statement
(``storage.db.stage_rows``), shared with concurrent requests under group commit. A token counts as
active in the month of its ``created_at`` (no activity row on create).

Token data never appears in a log line, an error message, an event or a task argument.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import CLASSIFICATIONS
from domain.tenancy.usage import record_token_activity, stage_token_activity
from domain.tokens.access import FULL, needs_data, placement, read_access, readable_classifications, require_read
from domain.tokens.cards import without_cvc
from domain.tokens.creation import (
    Created,
    check_references,
    dedup_candidates,
    deduplicate,
    deduplicates,
    new_token,
)
from domain.tokens.search import matching, parse_search_query, with_metadata
from domain.tokens.store import (
    NewToken,
    TokenLike,
    cvc_expiry,
    delete_rows,
    descendants,
    get_live,
    get_live_row,
    live,
    open_data,
    read_rows,
    read_select,
    seal,
    stage_new_token,
    touch,
    write_lookups,
)
from domain.tokens.validation import (
    Slot,
    TokenizeBody,
    ValidatedTokenRequest,
    check_token_patch,
    merge_patch,
    psp_forward_request,
    require_token_request,
)
from domain.tokens.views import token_view
from infra.errors import Problem, not_found, validation_problem
from storage.crypto import get_keyring
from storage.db import Rows, stage_rows
from storage.keyset import keyset_page
from storage.models import Tenant, Token
from storage.types import utcnow

# ---- create --------------------------------------------------------------------------------------


def create_tokens(
    session: Session, caller: Caller, requests: list[ValidatedTokenRequest], *, now: dt.datetime | None = None
) -> list[Created]:
    """Create the tokens of validated ``requests`` in the caller's transaction, in one batch.

    Checks ``token:<classification>:create`` for every classification (403 naming the first
    missing), aliases (an id used twice in the request: 400; a live token with that id: 409; an
    expired one is removed first), parents (must be live tokens of the tenant: 400), then applies
    deduplication (request ``deduplicate_token``, else the tenant's ``deduplicate_tokens``): another
    live token of the tenant (or of this batch) with the same type, classification and fingerprint
    is returned instead, its data (and metadata when given) replaced under ``update_existing`` (the default),
    unchanged under ``read_existing``. Writes one log row and one ``token.created`` /
    ``token.updated`` event per token. Returns one :class:`Created` per request, in order.
    """
    now = now or utcnow()
    tenant_id = caller.tenant_id
    for classification in dict.fromkeys(r.classification for r in requests):
        caller.require(f"token:{classification}:create")
    check_references(session, tenant_id, requests, now)
    keyring = get_keyring()
    fingerprints = [
        keyring.fingerprint(session, tenant_id, r.fingerprint_input) if r.fingerprint_input else None for r in requests
    ]
    existing = dedup_candidates(session, caller, requests, fingerprints, now)
    read_only = caller.tenant_settings.get("token_deduplication_behavior") == "read_existing"
    results: list[Created] = []
    rows, fresh = Rows(), Rows()
    try:
        with session.no_autoflush:  # one batched flush at the end, not one per token
            for request, fingerprint in zip(requests, fingerprints, strict=True):
                match = existing.get((request.type, request.classification, fingerprint)) if fingerprint else None
                if match is not None and deduplicates(caller, request):
                    results.append(deduplicate(session, rows, caller, match, request, read_only, now))
                    continue
                token = new_token(session, rows, caller, request, fingerprint, now)
                if fingerprint:
                    existing.setdefault((request.type, request.classification, fingerprint), token)
                results.append(Created(token, request.data))
        for result in results:
            if isinstance(result.token, NewToken) and not result.deduplicated:
                stage_new_token(session, fresh, result.token)
        fresh.merge(rows)
        if session.new or session.dirty or session.deleted:
            session.flush()
        stage_rows(session, fresh)
    except IntegrityError:
        raise Problem(409, "A token with one of the requested ids already exists.") from None
    stored = [r.token.id for r in results if r.deduplicated and not isinstance(r.token, NewToken)]
    if stored:  # a new token counts as active through its created_at
        record_token_activity(session, caller.tenant_id, stored, now=now)
    return results


def create_token(session: Session, caller: Caller, body: Any, *, now: dt.datetime | None = None) -> dict:
    """``POST /tokens``: one token request object -> the token object (read rules applied).

    ``body`` is the parsed JSON or the route's :class:`domain.tokens.validation.TokenRequestBody`.
    400 (``errors`` keyed ``data.number`` ...), 403, 409 as
    :func:`domain.tokens.validation.parse_token_request` and :func:`create_tokens` say; a deduplicated
    request answers with the existing token.
    """
    now = now or utcnow()
    request = require_token_request(body, caller, now=now)
    (created,) = create_tokens(session, caller, [request], now=now)
    return token_view(created.token, created.data, caller)


def tokenize(session: Session, caller: Caller, body: Any, *, now: dt.datetime | None = None) -> Any:
    """``POST /tokenize`` (spec: "Tokenize"): tokenize every value of ``body`` in one transaction.

    Objects and arrays are walked (:class:`domain.tokens.validation.TokenizeBody`); a token request
    object (``domain.tokens.validation.is_token_request``) is replaced by
    its token object, a bare string, number or boolean by the id of a new ``token``-type token;
    null stays null. The answer has the request's structure. All or nothing: errors of every
    request are answered together (400, keyed by path such as ``card.data.number`` or ``[2].data``),
    then 403/409 as :func:`create_tokens` says. At most 1000 tokens (``MAX_TOKENS_PER_REQUEST``).
    """
    now = now or utcnow()
    walk = TokenizeBody(caller, now)
    skeleton = walk.visit(body)
    if walk.errors:
        raise validation_problem(walk.errors)
    created = create_tokens(session, caller, walk.requests, now=now)

    def fill(node: Any) -> Any:
        if isinstance(node, Slot):
            made = created[node.index]
            return made.token.id if node.bare else token_view(made.token, made.data, caller)
        if isinstance(node, list):
            return [fill(item) for item in node]
        if isinstance(node, dict):
            return {key: fill(value) for key, value in node.items()}
        return node

    return fill(skeleton)


def psp_forward_tokenize(session: Session, caller: Caller, body: Any, *, now: dt.datetime | None = None) -> dict:
    """``POST /connections/psp-forward/tokenize`` (spec: "Payment-forwarding connection").

    ``body``: ``card`` {number, exp_month "MM", exp_year "YYYY", cvc, name} and optional
    ``metadata`` {id, mask, containers, metadata, search_indexes, fingerprint_expression (default
    the stringified data), deduplicate_token, expires_at}. The card becomes card token data
    {number, expiration_month (int), expiration_year (int), cvc, name}. Errors are keyed
    ``card.<field>`` and ``metadata.<field>`` (400). Answers the token object; when an existing
    token was returned by deduplication, ``data`` and ``metadata`` are left out unless the caller
    reads the token's container completely.
    """
    now = now or utcnow()
    request = psp_forward_request(body, caller, now=now)
    (created,) = create_tokens(session, caller, [request], now=now)
    access = read_access(caller, created.token)
    view = token_view(created.token, created.data, caller, access=access)
    if created.deduplicated and access != FULL:
        view.pop("data", None)
        view.pop("metadata", None)
    return view


# ---- read, update, delete ------------------------------------------------------------------------


def read_token(
    session: Session, caller: Caller, token_id: str, *, of_type: str | None = None, now: dt.datetime | None = None
) -> dict:
    """``GET /tokens/{id}``: the token object by the read rules.

    404 for a missing, expired or other tenant's token (and, with ``of_type``, a token of another
    type); 403 naming ``token:<c>:read:<level>`` when the caller holds no read permission on the
    token's classification. Writes a ``read`` log row.
    """
    now = now or utcnow()
    token = get_live_row(session, caller.tenant_id, token_id, now)
    if of_type is not None and token.type != of_type:
        raise not_found("token")
    require_read(caller, token)
    return _present(session, caller, [token], now)[0]


def load_token_data(
    session: Session, tenant_id: uuid.UUID, token_id: str, *, now: dt.datetime | None = None, rows: Rows | None = None
) -> tuple[Token, Any]:
    """``(token, plain data)`` of a live token for platform features (network tokens, the account
    updater, the proxy, payment methods). The data includes a card's ``cvc`` while it is retained.
    No permission check and no log row: the caller does both. The token counts as active this month
    (:func:`domain.tenancy.usage.record_token_activity`): written now, or queued in ``rows`` when the
    caller writes its rows in one statement (``storage.db.insert_rows``). Raises a 404 problem when
    missing or expired."""
    now = now or utcnow()
    token = get_live(session, tenant_id, token_id, now)
    record_token_activity(session, tenant_id, [token.id], now=now, rows=rows)
    return token, open_data(session, token, now)


def update_token(
    session: Session, caller: Caller, token_id: str, patch: Any, *, now: dt.datetime | None = None
) -> dict:
    """``PATCH /tokens/{id}``: apply an RFC 7396 merge patch and answer the token (read rules).

    The patch may hold ``data``, ``metadata``, ``mask``, ``containers``, ``search_indexes``,
    ``fingerprint_expression``, ``deduplicate_token``, ``expires_at`` (and the ignored ``privacy``);
    objects merge recursively and null removes (a removed mask, container list or fingerprint
    expression returns to the type's default). The result is validated like a new request (card
    data re-validated when the patch touches ``data``; 400 keyed ``data.number`` ...); fingerprint,
    search indexes and metadata rows
    are recomputed. Needs ``token:<c>:update`` (of the new classification too when it changes);
    404 as :func:`read_token`. Writes an ``update`` log row and a ``token.updated`` event.
    """
    now = now or utcnow()
    if not isinstance(patch, dict):
        raise validation_problem({"body": ["must be a JSON object (RFC 7396 merge patch)"]})
    token = get_live(session, caller.tenant_id, token_id, now, lock=True)
    classification, _ = placement(token)
    caller.require(f"token:{classification}:update")
    changes = check_token_patch(patch)
    current = {
        "data": open_data(session, token, now),
        "metadata": token.meta,
        "mask": token.mask,
        "containers": token.containers,
        "search_indexes": token.search_indexes,
        "fingerprint_expression": token.fingerprint_expression,
        "deduplicate_token": token.deduplicate_token,
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
    }
    patched = merge_patch({k: v for k, v in current.items() if v is not None}, changes)
    request = require_token_request({**patched, "type": token.type}, caller, now=now, validate_data="data" in patch)
    if request.classification != classification:
        caller.require(f"token:{request.classification}:update")
    old_cvc = current["data"].get("cvc") if isinstance(current["data"], dict) else None
    new_cvc = request.data.get("cvc") if isinstance(request.data, dict) else None
    if not (new_cvc and new_cvc == old_cvc):
        token.cvc_expires_at = cvc_expiry(token.type, request.data, now)
    fingerprint = request.fingerprint_input
    token.data_ct = seal(session, token.tenant_id, token.id, request.data)
    token.mask = request.mask
    token.containers = request.containers
    token.meta = request.metadata
    token.search_indexes = request.search_indexes
    token.fingerprint = get_keyring().fingerprint(session, token.tenant_id, fingerprint) if fingerprint else None
    token.fingerprint_expression = request.fingerprint_expression
    token.deduplicate_token = request.deduplicate_token
    token.expires_at = request.expires_at
    token.modified_by = caller.application_id
    token.modified_at = now
    session.add(token)
    write_lookups(session, token, request.index_values, replace=True)
    rows = Rows()
    touch(session, rows, caller, token, "update", "updated")
    stage_rows(session, rows)
    return token_view(token, request.data, caller)


def delete_token(session: Session, caller: Caller, token_id: str, *, now: dt.datetime | None = None) -> None:
    """``DELETE /tokens/{id}``: delete the token and its children (recursively).

    Needs ``token:<c>:delete`` for the classification of every token deleted (403 naming the first
    missing); 404 as :func:`read_token`. One ``delete`` log row and ``token.deleted`` event each.
    """
    now = now or utcnow()
    token = get_live(session, caller.tenant_id, token_id, now, lock=True)
    doomed = descendants(session, caller.tenant_id, token)
    for classification in dict.fromkeys(placement(t)[0] for t in doomed):
        caller.require(f"token:{classification}:delete")
    delete_rows(session, caller.tenant_id, [t.id for t in doomed])
    rows = Rows()
    for gone in doomed:
        touch(session, rows, caller, gone, "delete", "deleted")
    stage_rows(session, rows)


# ---- list, search, children ----------------------------------------------------------------------


def _present(session: Session, caller: Caller, tokens: Iterable[TokenLike], now: dt.datetime) -> list[dict]:
    """Views of ``tokens`` by the read rules, decrypting only what is shown; one log row each."""
    views = []
    rows = Rows()
    for token in tokens:
        access = read_access(caller, token)
        data = open_data(session, token, now) if needs_data(token, access) else None
        views.append(token_view(token, data, caller, access=access))
        audit.stage(rows, caller, entity_type=token.type, entity_id=token.id, operation="read")
    stage_token_activity(rows, caller.tenant_id, [view["id"] for view in views], now=now)
    stage_rows(session, rows)
    return views


def _cursor_page(
    session: Session, caller: Caller, stmt, *, size: int, position: dict | None, now: dt.datetime
) -> tuple[list[dict], dict | None]:
    """Newest first, keyset on (created_at, id), only live tokens of readable classifications."""
    readable = readable_classifications(caller)
    stmt = stmt.where(Token.tenant_id == caller.tenant_id, live(now))
    if len(readable) < len(CLASSIFICATIONS):
        first_container = Token.containers[0].as_string()
        stmt = stmt.where(or_(*(first_container.like(f"/{c}/%") for c in readable)))
    rows, following = keyset_page(
        session, stmt, order=(Token.created_at, Token.id), size=size, after=position, entity=lambda row: row
    )  # plain rows (columns), not ORM objects
    return _present(session, caller, rows, now), following


def list_tokens(
    session: Session,
    caller: Caller,
    *,
    types: Iterable[str] = (),
    metadata: tuple[str, str] | None = None,
    size: int = 20,
    position: dict | None = None,
    now: dt.datetime | None = None,
) -> tuple[list[dict], dict | None]:
    """``GET /v2/tokens`` (decision 7): one page of live tokens, newest first.

    Filters: ``types`` (any of), one ``metadata`` pair (exact, case-sensitive). Only tokens of
    classifications the caller can read are listed (403 when it can read none); data by the read
    rules; a ``read`` log row per token. ``position`` is the decoded cursor ``{"t", "id"}``.
    Returns ``(views, next position or None)``.
    """
    now = now or utcnow()
    stmt = read_select()
    types = list(types)
    if types:
        stmt = stmt.where(col(Token.type).in_(types))
    if metadata is not None:
        stmt = with_metadata(stmt, caller.tenant_id, [metadata])
    return _cursor_page(session, caller, stmt, size=size, position=position, now=now)


def search_tokens(
    session: Session,
    caller: Caller,
    query: str,
    *,
    size: int = 20,
    position: dict | None = None,
    now: dt.datetime | None = None,
) -> tuple[list[dict], dict | None]:
    """``POST /v2/tokens/search`` (decision 7): one page of live tokens matching ``query``
    (:func:`parse_search_query`; 400 for unsupported forms), newest first, with the visibility and
    read rules of :func:`list_tokens`. ``data:<value>`` matches the blind indexes of the tokens'
    search index expressions; metadata terms match exactly and case-sensitively."""
    now = now or utcnow()
    parsed = parse_search_query(query)
    stmt = matching(session, read_select(), caller.tenant_id, parsed)
    return _cursor_page(session, caller, stmt, size=size, position=position, now=now)


def children(
    session: Session,
    caller: Caller,
    parent_id: str,
    *,
    ids: Iterable[str] = (),
    types: Iterable[str] = (),
    page: int = 1,
    size: int = 20,
    now: dt.datetime | None = None,
) -> tuple[list[dict], int]:
    """``GET /tokens/{parent_id}/children`` (spec: "Token children"): the live children of a
    token, newest first, filtered by ``ids`` and ``types`` (any of each). The parent must be
    readable (403 as :func:`read_token`, 404 when missing); children are shown by the read rules,
    each with a ``read`` log row. Returns ``(views, total)`` for offset pagination."""
    now = now or utcnow()
    parent = get_live_row(session, caller.tenant_id, parent_id, now)
    require_read(caller, parent)
    conditions = [col(Token.tenant_id) == caller.tenant_id, col(Token.parent_id) == parent.id, live(now)]
    ids, types = list(ids), list(types)
    if ids:
        conditions.append(col(Token.id).in_(ids))
    if types:
        conditions.append(col(Token.type).in_(types))
    total = session.exec(select(func.count()).select_from(Token).where(*conditions)).one()
    rows = read_rows(
        session,
        read_select()
        .where(*conditions)
        .order_by(col(Token.created_at).desc(), col(Token.id).desc())
        .offset((page - 1) * size)
        .limit(size),
    )
    return _present(session, caller, rows, now), total


# ---- sweeps (beat) -------------------------------------------------------------------------------


def delete_expired_tokens(session: Session, *, now: dt.datetime, batch: int = 500) -> int:
    """Delete up to ``batch`` tokens whose ``expires_at`` is at or before ``now``, with their
    metadata and search index rows, a ``delete`` log row (actor ``system``) and a
    ``token.deleted`` event each. Rows locked by a concurrent sweep are skipped (``SKIP LOCKED`` on
    PostgreSQL). Returns how many were deleted; call again while it returns ``batch``."""
    rows = session.exec(
        select(Token)
        .where(col(Token.expires_at).is_not(None), col(Token.expires_at) <= now)
        .order_by(col(Token.expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    by_tenant: dict[uuid.UUID, list[Token]] = defaultdict(list)
    for token in rows:
        by_tenant[token.tenant_id].append(token)
    for tenant_id, tokens in by_tenant.items():
        delete_rows(session, tenant_id, [t.id for t in tokens])
        tenant = session.get(Tenant, tenant_id)
        if tenant is None:  # cannot happen: a tenant's tokens are deleted with it (foreign key, cascade)
            raise not_found("tenant")
        system = system_caller(tenant)
        staged = Rows()
        for token in tokens:
            touch(session, staged, system, token, "delete", "deleted")
        stage_rows(session, staged)
    return len(rows)


def purge_card_verification_codes(session: Session, *, now: dt.datetime, batch: int = 500) -> int:
    """Rewrite up to ``batch`` card tokens whose ``cvc_expires_at`` is at or before ``now`` without
    their ``cvc`` (the code is kept only for provider calls within ``cvc_retention_seconds``).
    Skips rows locked elsewhere (``SKIP LOCKED``). Returns how many tokens were rewritten."""
    rows = session.exec(
        select(Token)
        .where(col(Token.cvc_expires_at).is_not(None), col(Token.cvc_expires_at) <= now)
        .order_by(col(Token.cvc_expires_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    for token in rows:
        data = open_data(session, token, now)
        token.data_ct = seal(session, token.tenant_id, token.id, without_cvc(token.type, data))
        token.cvc_expires_at = None
        session.add(token)
    return len(rows)
