"""The token object answered by the API (spec, core document: "Token"; decisions of the tokens issue)."""

from __future__ import annotations

from typing import Any

from domain.tenancy.caller import Caller
from domain.tokens.access import FULL, NONE, read_access
from domain.tokens.cards import without_cvc
from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import apply_mask, make_context
from domain.tokens.store import TokenLike


def token_view(token: TokenLike, data: Any, caller: Caller, *, access: str | None = None) -> dict:
    """The token object answered to ``caller``.

    Fields: ``id, tenant_id, type, data, mask, containers, metadata, search_indexes, fingerprint,
    fingerprint_expression, deduplicate_token, parent_id, created_by, created_at, modified_by,
    modified_at, expires_at``. ``data`` (the plain data, or None when not loaded) is shown complete,
    masked or left out according to ``domain.tokens.access.read_access`` (or ``access`` when already
    known); a card's ``cvc`` is never shown.
    """
    access = access or read_access(caller, token)
    view: dict[str, Any] = {"id": token.id, "tenant_id": token.tenant_id, "type": token.type}
    if access != NONE and data is not None:
        data = without_cvc(token.type, data)
        if access == FULL:
            view["data"] = data
        elif token.mask is not None:
            try:
                view["data"] = apply_mask(token.mask, make_context(token.type, data, token.meta))
            except ExpressionError:
                pass  # the mask no longer fits the data: show none rather than fail the read
    view.update(
        mask=token.mask,
        containers=list(token.containers or []),
        metadata=dict(token.meta or {}),
        search_indexes=list(token.search_indexes or []),
        fingerprint=token.fingerprint,
        fingerprint_expression=token.fingerprint_expression,
        deduplicate_token=token.deduplicate_token,
        parent_id=token.parent_id,
        created_by=token.created_by,
        created_at=token.created_at,
        modified_by=token.modified_by,
        modified_at=token.modified_at,
        expires_at=token.expires_at,
    )
    return view
