"""The steps of creating tokens in a batch (``domain.tokens.service.create_tokens``): references
(aliases and parents), deduplication candidates, new token rows and the answer of a deduplicated request.

Deduplication (spec: "Tokenize"): when a request's ``deduplicate_token`` is true (or unset and the
tenant's ``deduplicate_tokens`` is on), another live token of the tenant with the same type,
classification and fingerprint answers the request; under ``token_deduplication_behavior``
``update_existing`` (the default) its data (and metadata when given) is replaced, under
``read_existing`` it is read unchanged.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from domain.tenancy.caller import Caller
from domain.tokens.access import needs_data, placement, read_access
from domain.tokens.errors import ExpressionError, FieldErrors, field_key
from domain.tokens.expressions import make_context, render
from domain.tokens.store import (
    NewToken,
    cvc_expiry,
    delete_rows,
    live,
    open_data,
    seal,
    touch,
    write_lookups,
)
from domain.tokens.validation import ValidatedTokenRequest
from infra.errors import Problem, validation_problem
from storage.db import Rows
from storage.models import Token
from storage.types import random_uuid


@dataclass
class Created:
    """What ``create_tokens`` made of one request: the token (a stored row, or a :class:`NewToken`
    written with this unit of work), its plain data (None when the caller may not see it and it was
    not decrypted) and whether an existing token was returned."""

    token: Token | NewToken
    data: Any
    deduplicated: bool = False


def deduplicates(caller: Caller, request: ValidatedTokenRequest) -> bool:
    """Whether ``request`` is deduplicated: its ``deduplicate_token``, else the tenant's ``deduplicate_tokens``."""
    if request.deduplicate_token is not None:
        return request.deduplicate_token
    return caller.setting("deduplicate_tokens")


def check_references(
    session: Session, tenant_id: uuid.UUID, requests: list[ValidatedTokenRequest], now: dt.datetime
) -> None:
    """Check the aliases and parents of ``requests``: an id used twice in the request (400), a live
    token with a requested id (409; an expired one is removed first), a parent that is no live token
    of the tenant (400). Errors keyed by each request's path."""
    errors = FieldErrors()
    aliases: dict[str, ValidatedTokenRequest] = {}
    for request in requests:
        if request.id is not None:
            if request.id in aliases:
                errors.add(field_key(request.path, "id"), "is used by another token of this request")
            aliases[request.id] = request
    if aliases:
        taken = session.exec(
            select(Token.id, Token.expires_at).where(
                col(Token.tenant_id) == tenant_id, col(Token.id).in_(list(aliases))
            )
        ).all()
        alive = [token_id for token_id, expires_at in taken if expires_at is None or expires_at > now]
        if alive:
            raise Problem(409, f"A token with the id {alive[0]!r} already exists in the tenant.")
        if taken:
            delete_rows(session, tenant_id, [token_id for token_id, _ in taken])
    parents = {r.parent_id for r in requests if r.parent_id is not None}
    if parents:
        found = set(
            session.exec(
                select(Token.id).where(col(Token.tenant_id) == tenant_id, col(Token.id).in_(list(parents)), live(now))
            ).all()
        )
        for request in requests:
            if request.parent_id is not None and request.parent_id not in found:
                errors.add(field_key(request.path, "parent_id"), "no token of the tenant has this id")
    if errors:
        raise validation_problem(errors)


def dedup_candidates(
    session: Session,
    caller: Caller,
    requests: list[ValidatedTokenRequest],
    fingerprints: list[str | None],
    now: dt.datetime,
) -> dict[tuple[str, str, str], Token | NewToken]:
    """The live tokens of the tenant that requests wanting deduplication may be answered with, keyed
    ``(type, classification, fingerprint)`` (the oldest of each)."""
    wanted = {fp for r, fp in zip(requests, fingerprints, strict=True) if fp and deduplicates(caller, r)}
    if not wanted:
        return {}
    rows = session.exec(
        select(Token)
        .where(col(Token.tenant_id) == caller.tenant_id, col(Token.fingerprint).in_(list(wanted)), live(now))
        .order_by(col(Token.created_at), Token.id)
    ).all()
    found: dict[tuple[str, str, str], Token | NewToken] = {}
    for token in rows:
        if token.fingerprint is not None:  # selected by fingerprint
            found.setdefault((token.type, placement(token)[0], token.fingerprint), token)
    return found


def new_token(
    session: Session,
    rows: Rows,
    caller: Caller,
    request: ValidatedTokenRequest,
    fingerprint: str | None,
    now: dt.datetime,
) -> NewToken:
    """The :class:`NewToken` of ``request`` (its data sealed; id: the alias, else a uuid), with its
    ``create`` log row and ``token.created`` event queued in ``rows``."""
    token_id = request.id or str(random_uuid())
    token = NewToken(
        tenant_id=caller.tenant_id,
        id=token_id,
        type=request.type,
        data_ct=seal(session, caller.tenant_id, token_id, request.data),
        mask=request.mask,
        containers=request.containers,
        meta=request.metadata,
        search_indexes=request.search_indexes,
        fingerprint=fingerprint,
        fingerprint_expression=request.fingerprint_expression,
        deduplicate_token=request.deduplicate_token,
        parent_id=request.parent_id,
        created_by=caller.application_id,
        created_at=now,
        expires_at=request.expires_at,
        cvc_expires_at=cvc_expiry(request.type, request.data, now),
        index_values=request.index_values,
    )
    touch(session, rows, caller, token, "create", "created")
    return token


def deduplicate(
    session: Session,
    rows: Rows,
    caller: Caller,
    token: Token | NewToken,
    request: ValidatedTokenRequest,
    read_only: bool,
    now: dt.datetime,
) -> Created:
    """Answer ``request`` with ``token`` (a stored token, or one made earlier in this batch and not
    written yet): read it, or replace its data (and metadata when given) and recompute its indexes."""
    if read_only:
        access = read_access(caller, token)
        data = open_data(session, token, now) if needs_data(token, access) else None
        touch(session, rows, caller, token, "read", None)
        return Created(token, data, deduplicated=True)
    token.data_ct = seal(session, token.tenant_id, token.id, request.data)
    token.cvc_expires_at = cvc_expiry(token.type, request.data, now)
    if request.metadata_given:
        token.meta = request.metadata
    context = make_context(token.type, request.data, token.meta)
    values = []
    for source in token.search_indexes or ():
        try:
            values.append(render(source, context))
        except ExpressionError:
            continue  # an index the new data cannot fill is left out
    token.modified_by = caller.application_id
    token.modified_at = now
    if isinstance(token, NewToken):
        token.index_values = [v for v in values if v]
    else:
        session.add(token)
        write_lookups(session, token, [v for v in values if v], replace=True)
    touch(session, rows, caller, token, "update", "updated")
    return Created(token, request.data, deduplicated=True)
