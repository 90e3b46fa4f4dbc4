"""Who sees what of a token (spec, core document: "Token"; section 5).

Permissions are ``token:<classification>:<operation>[:<impact_level>]``. A token's classification is
its containers' (default: its type's, card -> ``pci``, bank -> ``bank``, token -> ``general``) and its
impact level the lowest of its containers' levels. A caller whose best ``token:<c>:read:<level>``
reaches that level reads the data complete (:data:`FULL`), a caller with a lower read level of the
classification reads it masked (:data:`MASKED`; no mask: no data), a caller without any read
permission of the classification reads no data (:data:`NONE`; ``GET /tokens/{id}`` answers 403).
"""

from __future__ import annotations

from collections.abc import Iterable

from domain.tenancy.caller import Caller
from domain.tenancy.permissions import CLASSIFICATIONS, IMPACT_LEVELS, TYPE_CLASSIFICATION, parse_container, read_level
from domain.tokens.store import TokenLike
from infra.errors import Problem, forbidden

FULL, MASKED, NONE = "full", "masked", "none"


def placement(token: TokenLike) -> tuple[str, int]:
    """``(classification, impact rank)`` of a stored token: its containers' classification and
    the lowest impact level among them (low 0, moderate 1, high 2)."""
    return container_placement(token.containers or (), token.type)


def container_placement(containers: Iterable[str], token_type: str | None) -> tuple[str, int]:
    """``(classification, impact rank)`` of a token of ``token_type`` in ``containers`` (without
    containers: the type's classification, high)."""
    parsed = [p for p in (parse_container(c) for c in containers) if p is not None]
    if not parsed:
        return TYPE_CLASSIFICATION.get(str(token_type), "general"), len(IMPACT_LEVELS) - 1
    return parsed[0][0], min(IMPACT_LEVELS.index(level) for _, level in parsed)


def read_access(caller: Caller, token: TokenLike) -> str:
    """How much of ``token``'s data ``caller`` may see: :data:`FULL`, :data:`MASKED` or :data:`NONE`.

    Full when the caller's best ``token:<c>:read:<level>`` reaches the token's impact level, masked
    when it holds a lower read level of the classification, none without any.
    """
    classification, rank = placement(token)
    best = read_level(caller.permissions, classification)
    if best >= rank:
        return FULL
    return MASKED if best >= 0 else NONE


def require_read(caller: Caller, token: TokenLike) -> str:
    """:func:`read_access`, or a 403 problem naming ``token:<c>:read:<level>`` when it is :data:`NONE`."""
    access = read_access(caller, token)
    if access == NONE:
        classification, rank = placement(token)
        raise forbidden(f"token:{classification}:read:{IMPACT_LEVELS[rank]}")
    return access


def readable_classifications(caller: Caller) -> list[str]:
    """The classifications ``caller`` holds any read permission of; a 403 problem when none."""
    readable = [c for c in CLASSIFICATIONS if read_level(caller.permissions, c) >= 0]
    if not readable:
        raise Problem(403, "The API key holds no token read permission (token:<classification>:read:<impact_level>).")
    return readable


def needs_data(token: TokenLike, access: str) -> bool:
    """Whether showing ``token`` with ``access`` needs its plain data (complete, or masked by a mask)."""
    return access == FULL or (access == MASKED and token.mask is not None)
