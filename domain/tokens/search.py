"""The v2 token search query (``spec/README.md`` decision 7; spec section 9, "Complex token search
queries") and the statement filters of token lists and searches.

Complex queries were shut down on January 23, 2024: a query is one ``id:<id>`` term, one
``data:<value>`` term (matched against the blind indexes of the tokens' search index expressions), one
``metadata.<key>:<value>`` term, or several ``metadata.<key>:<value>`` terms joined by ``AND`` (exact,
case-sensitive). Any other form answers 400 naming what is unsupported and what is.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import Select
from sqlmodel import Session, col, select

from infra.errors import Problem, validation_problem
from storage.crypto import get_keyring
from storage.models import Token, TokenMetadata, TokenSearchIndex

SEARCH_SHUTDOWN = "January 23, 2024"
_UNSUPPORTED_FIELDS = frozenset(
    {"type", "fingerprint", "container", "containers", "created_by", "created_at", "modified_by", "modified_at"}
)
SUPPORTED_SEARCH_FORMS = (
    "Supported: one id:<id> term, one data:<value> term (a search index), one metadata.<key>:<value> "
    "term, or several metadata.<key>:<value> terms joined by AND."
)


@dataclass(frozen=True)
class SearchQuery:
    """A parsed v2 search query: exactly one of ``id``, ``data`` or ``metadata`` (pairs, ANDed)."""

    id: str | None = None
    data: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()


def _unsupported(what: str) -> Problem:
    return validation_problem(
        {"query": [f"{what}. {SUPPORTED_SEARCH_FORMS}"]},
        detail=f"Unsupported token search query (complex queries were shut down on {SEARCH_SHUTDOWN}).",
    )


def _query_words(query: str) -> Iterator[tuple[str, bool]]:
    """Split on whitespace outside double quotes: ``(raw word, has quotes)``."""
    word, quoted, escaped, in_quotes = [], False, False, False
    for char in query:
        if escaped:
            word.append(char)
            escaped = False
        elif in_quotes and char == "\\":
            word.append(char)
            escaped = True
        elif char == '"':
            word.append(char)
            in_quotes, quoted = not in_quotes, True
        elif char.isspace() and not in_quotes:
            if word:
                yield "".join(word), quoted
            word, quoted = [], False
        else:
            word.append(char)
    if in_quotes:
        raise _unsupported("A quoted value is not closed")
    if word:
        yield "".join(word), quoted


def _term_value(raw: str) -> str:
    if raw.startswith('"'):
        if len(raw) < 2 or not raw.endswith('"'):
            raise _unsupported("A quoted value must be the whole value")
        try:
            return json.loads(raw)
        except ValueError:
            raise _unsupported("A quoted value is malformed") from None
    if '"' in raw:
        raise _unsupported("Quotes must enclose the whole value")
    return raw


def parse_search_query(query: str) -> SearchQuery:
    """Parse a v2 search query (decision 7; spec section 9, "Complex token search queries").

    Supported: ``id:<id>``, ``data:<value>``, ``metadata.<key>:<value>``, or several
    ``metadata.<key>:<value>`` terms joined by `` AND ``. Values may be double-quoted (JSON string
    escapes). Anything else (OR, NOT, ``-term``, grouping, the fields type, fingerprint, container,
    created_*, modified_*, free text, mixed fields) raises a 400 problem naming what is unsupported
    and what is.
    """
    words = list(_query_words(query or ""))
    if not words:
        raise _unsupported("The query is empty")
    terms: list[tuple[str, str]] = []
    for position, (raw, quoted) in enumerate(words):
        if position % 2 == 1:
            if raw in ("OR", "||"):
                raise _unsupported("OR is not supported")
            if raw in ("NOT", "!"):
                raise _unsupported("Negation (NOT) is not supported")
            if raw not in ("AND", "&&"):
                raise _unsupported(f"Terms must be joined by AND, found {raw!r}")
            continue
        if raw in ("AND", "&&", "OR", "||", "NOT", "!"):
            raise _unsupported(
                f"{raw} must stand between two terms"
                if raw in ("AND", "&&", "OR", "||")
                else "Negation (NOT) is not supported"
            )
        if raw[0] in "-!":
            raise _unsupported("Negation (-term) is not supported")
        if raw[0] in "(+" or (raw.endswith(")") and not quoted):
            raise _unsupported("Grouping and required (+) terms are not supported")
        name, colon, value = raw.partition(":")
        if not colon or '"' in name or not name:
            raise _unsupported(f"{raw!r} is not a field:value term")
        if name in _UNSUPPORTED_FIELDS:
            raise _unsupported(f"The field {name} is not supported")
        if name not in ("id", "data") and not (name.startswith("metadata.") and len(name) > len("metadata.")):
            raise _unsupported(f"The field {name} is not known")
        value = _term_value(value)
        if not value:
            raise _unsupported(f"The term {name} has no value")
        terms.append((name, value))
    if len(words) % 2 == 0:
        raise _unsupported("The query ends with an operator")
    names = [name for name, _ in terms]
    if any(name in ("id", "data") for name in names):
        if len(terms) > 1:
            raise _unsupported("An id or data term cannot be combined with other terms")
        name, value = terms[0]
        return SearchQuery(id=value) if name == "id" else SearchQuery(data=value)
    return SearchQuery(metadata=tuple((name[len("metadata.") :], value) for name, value in terms))


def with_metadata(stmt: Select, tenant_id: uuid.UUID, pairs: Iterable[tuple[str, str]]) -> Select:
    """``stmt`` narrowed to tokens having every metadata pair of ``pairs`` (exact, case-sensitive)."""
    for key, value in pairs:
        stmt = stmt.where(
            col(Token.id).in_(
                select(TokenMetadata.token_id).where(
                    col(TokenMetadata.tenant_id) == tenant_id,
                    col(TokenMetadata.key) == key,
                    col(TokenMetadata.value) == value,
                )
            )
        )
    return stmt


def matching(session: Session, stmt: Select, tenant_id: uuid.UUID, query: SearchQuery) -> Select:
    """``stmt`` (over tokens of ``tenant_id``) narrowed to the tokens ``query`` finds: by id, by the
    blind index of ``data`` (the keyed digest of the value), or by metadata pairs."""
    if query.id is not None:
        stmt = stmt.where(col(Token.id) == query.id)
    if query.data is not None:
        digest = get_keyring().blind_index(session, tenant_id, query.data)
        stmt = stmt.where(
            col(Token.id).in_(
                select(TokenSearchIndex.token_id).where(
                    col(TokenSearchIndex.tenant_id) == tenant_id, col(TokenSearchIndex.digest) == digest
                )
            )
        )
    return with_metadata(stmt, tenant_id, query.metadata)
