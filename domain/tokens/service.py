"""The token domain: tokenize, create, read, update, delete, list, search, children and sweeps.

One place for every rule about tokens (spec, core document: "Token", "Tokenize", "Token children",
"Payment-forwarding connection", sections 5, 8 and 9; ``spec/README.md`` decisions 7 and 8). API
handlers, Celery tasks and later features (network tokens, the account updater, the proxy) call
these functions inside their own unit of work (``fn(session, ...)``); nothing here commits.

Rules kept here:

* **Types and classifications.** ``token`` (any JSON value), ``card`` (``domain.tokens.cards.validate_card``)
  and ``bank`` (``domain.tokens.cards.validate_bank``). The type names the default classification (card ->
  ``pci``, bank -> ``bank``, token -> ``general``) and the default container ``/<classification>/high/``.
  Card and bank containers must be of their type's classification; a ``token`` may be placed in the
  containers of any one classification, which is then its classification.
* **Access.** Permissions ``token:<classification>:<operation>[:<impact_level>]``. For reads the
  token's impact level is the lowest of its containers' levels; a caller whose best
  ``token:<c>:read:<level>`` reaches it gets the data complete, a caller with a lower read level gets
  the masked data (no mask: no data), a caller without any read permission on the classification
  gets no data (and ``GET /tokens/{id}`` answers 403). A card's ``cvc`` is never returned.
* **At rest.** Data is sealed with ``keyring.encrypt(session, tenant, "token", id, json)``;
  fingerprints are ``keyring.fingerprint`` of the rendered fingerprint expression; search indexes are
  ``keyring.blind_index`` digests of the rendered expressions (the values are never stored). A card's
  ``cvc`` is dropped ``cvc_retention_seconds`` after it was stored (:func:`purge_card_verification_codes`).
* **Expiry.** A token whose ``expires_at`` has passed reads as missing (404) everywhere at once;
  :func:`delete_expired_tokens` removes it later.
* **Log rows and events.** One log row per token touched (entity type = token type); events
  ``token.created``, ``token.updated`` and ``token.deleted`` carry ``{"token": {"id", "type"}}`` only
  and are recorded when an enabled webhook of the tenant subscribes to the type
  (``domain.webhooks.events.emit`` into the caller's rows).
* **The hot path** (tokenize, create, reads, list, search) builds no ORM objects: new tokens are
  :class:`NewToken` rows, reads select plain rows, and the rows a unit of work writes (tokens,
  metadata, blind indexes, log rows, events, deliveries, activity) go out in one statement
  (``storage.db.stage_rows``), shared with concurrent requests under group commit. A token counts
  as active in the month of its ``created_at`` (no activity row on create).

Token data never appears in a log line, an error message, an event or a task argument.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from config.settings import get_settings
from domain.tenancy import audit
from domain.tenancy.auth import system_caller
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import CLASSIFICATIONS, IMPACT_LEVELS, TYPE_CLASSIFICATION, parse_container, read_level
from domain.tenancy.usage import record_deleted_tokens, record_token_activity, stage_token_activity
from domain.tokens.cards import (
    DEFAULT_FINGERPRINT_EXPRESSIONS,
    default_bank_mask,
    default_card_mask,
    validate_bank,
    validate_card,
)
from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import (
    apply_mask,
    make_context,
    render,
    validate_expression,
    validate_mask,
)
from domain.webhooks import events
from infra.errors import Problem, forbidden, not_found, validation_problem
from storage.crypto import get_keyring
from storage.db import Rows, stage_rows
from storage.keyset import keyset_page
from storage.models import Tenant, Token, TokenMetadata, TokenSearchIndex
from storage.types import table_of, utcnow

TOKEN_TYPES: tuple[str, ...] = ("token", "card", "bank")
#: Properties of a token request object (the ``privacy`` attribute was shut down: accepted, ignored).
REQUEST_FIELDS = frozenset(
    {
        "type",
        "data",
        "id",
        "metadata",
        "mask",
        "containers",
        "search_indexes",
        "fingerprint_expression",
        "deduplicate_token",
        "expires_at",
        "parent_id",
        "privacy",
    }
)
#: Properties a merge patch may change.
PATCHABLE_FIELDS = frozenset(
    {
        "data",
        "metadata",
        "mask",
        "containers",
        "search_indexes",
        "fingerprint_expression",
        "deduplicate_token",
        "expires_at",
        "privacy",
    }
)
#: Properties of the ``metadata`` object of the payment-forwarding tokenize body.
PSP_OPTION_FIELDS = frozenset(
    {
        "id",
        "mask",
        "containers",
        "metadata",
        "search_indexes",
        "fingerprint_expression",
        "deduplicate_token",
        "expires_at",
    }
)
PSP_CARD_FIELDS = ("number", "exp_month", "exp_year", "cvc", "name")

ALIAS_PATTERN = re.compile(r"[A-Za-z0-9\-_.:]{1,400}")
MAX_METADATA_PAIRS = 100
MAX_METADATA_KEY = 255
MAX_METADATA_VALUE = 1024
MAX_SEARCH_INDEXES = 20
MAX_CONTAINERS = 20
MAX_TOKENS_PER_REQUEST = 1000
MAX_DEPTH = 64
DATA_PURPOSE = "token"
STRINGIFIED_DATA = "{{ data | stringify }}"

FULL, MASKED, NONE = "full", "masked", "none"
_DEFAULT_MASKS = {"card": default_card_mask, "bank": default_bank_mask}
_MISSING = object()

SEARCH_SHUTDOWN = "January 23, 2024"
_UNSUPPORTED_FIELDS = frozenset(
    {"type", "fingerprint", "container", "containers", "created_by", "created_at", "modified_by", "modified_at"}
)
SUPPORTED_SEARCH_FORMS = (
    "Supported: one id:<id> term, one data:<value> term (a search index), one metadata.<key>:<value> "
    "term, or several metadata.<key>:<value> terms joined by AND."
)


# ---- validated requests --------------------------------------------------------------------------


@dataclass
class TokenRequest:
    """A validated token request (spec: "Tokenize"; decisions of the tokens issue).

    ``path`` is where the request sat in the body (``""``, ``card``, ``[2]``) and prefixes its error
    keys. ``fingerprint_input`` and ``index_values`` are the rendered expressions (plain values, kept
    only in memory until they are turned into keyed digests).
    """

    type: str
    data: Any
    classification: str
    containers: list[str]
    metadata: dict[str, str]
    metadata_given: bool
    mask: Any
    search_indexes: list[str]
    index_values: list[str]
    fingerprint_expression: str | None
    fingerprint_input: str | None
    deduplicate_token: bool | None
    expires_at: dt.datetime | None
    id: str | None = None
    parent_id: str | None = None
    path: str = ""


@dataclass(slots=True)
class NewToken:
    """A token this unit of work writes as a plain row (no ORM object): the attributes of
    :class:`storage.models.Token` that views and access rules read, and the rendered search index
    values whose blind-index rows go with it."""

    tenant_id: uuid.UUID
    id: str
    type: str
    data_ct: bytes
    mask: Any
    containers: list[str]
    meta: dict[str, str]
    search_indexes: list[str]
    fingerprint: str | None
    fingerprint_expression: str | None
    deduplicate_token: bool | None
    parent_id: str | None
    created_by: uuid.UUID | None
    created_at: dt.datetime
    expires_at: dt.datetime | None
    cvc_expires_at: dt.datetime | None
    index_values: list[str] = field(default_factory=list)
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = None

    def row(self) -> dict:
        """The ``tokens`` row."""
        return {
            "tenant_id": self.tenant_id,
            "id": self.id,
            "type": self.type,
            "data_ct": self.data_ct,
            "mask": self.mask,
            "containers": self.containers,
            "metadata": self.meta,
            "search_indexes": self.search_indexes,
            "fingerprint": self.fingerprint,
            "fingerprint_expression": self.fingerprint_expression,
            "deduplicate_token": self.deduplicate_token,
            "parent_id": self.parent_id,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "modified_by": self.modified_by,
            "modified_at": self.modified_at,
            "expires_at": self.expires_at,
            "cvc_expires_at": self.cvc_expires_at,
        }


@dataclass
class Created:
    """What :func:`create_tokens` made of one request: the token (a stored row, or a
    :class:`NewToken` written with this unit of work), its plain data (None when the caller may
    not see it and it was not decrypted) and whether an existing token was returned."""

    token: Token | NewToken
    data: Any
    deduplicated: bool = False


def _key(path: str, name: str) -> str:
    """The error key of ``name`` under ``path`` (``card`` + ``data`` -> ``card.data``)."""
    if not path:
        return name
    return path + name if name.startswith("[") else f"{path}.{name}"


class _Errors(dict):
    """An ``errors`` map of a validation problem, keyed by property path."""

    def add(self, key: str, message: str) -> None:
        self.setdefault(key, []).append(message)


def parse_token_request(
    body: Any,
    caller: Caller,
    *,
    now: dt.datetime,
    path: str = "",
    data_path: str | None = None,
    default_fingerprint: str | None = None,
    validate_data: bool = True,
) -> tuple[TokenRequest | None, dict[str, list[str]]]:
    """Validate one token request object and render its expressions.

    ``body`` has ``type`` (token|card|bank) and ``data`` (required) and optional ``id`` (alias: 1-400
    letters, digits, ``-_.:``), ``metadata`` (string map, <= 100 pairs, key <= 255, value <= 1024),
    ``mask``, ``containers``, ``search_indexes`` (<= 20 expressions), ``fingerprint_expression``,
    ``deduplicate_token``, ``expires_at`` (ISO 8601, future), ``parent_id`` and ``privacy``
    (ignored, spec section 9). Card and bank data follow ``domain.tokens.cards``. Errors are keyed under
    ``path`` (``card.data.number``); ``data_path`` overrides the prefix of data errors.
    ``default_fingerprint`` replaces the type's default fingerprint expression; ``validate_data``
    False takes ``data`` as already valid (a stored token's data, unchanged by a patch).

    Returns ``(request, errors)``: ``request`` is None when ``errors`` is not empty. Never raises.
    """
    errors = _Errors()

    def err(name: str, message: str) -> None:
        errors.add(_key(path, name), message)

    if not isinstance(body, dict):
        errors.add(path or "body", "must be a token request object")
        return None, errors
    for name in body:
        if name not in REQUEST_FIELDS:
            err(name, "This property is not allowed.")
    kind = body.get("type")
    if kind is None:
        err("type", "is required")
    elif kind not in TOKEN_TYPES:
        err("type", f"must be one of {', '.join(TOKEN_TYPES)}")
    data = body.get("data")
    data_key = data_path or _key(path, "data")
    if data is None:
        errors.add(data_key, "is required")
    elif validate_data and kind == "card":
        data, found = validate_card(data, today=now.date(), prefix=data_key, check_expiry=False)
        errors.update(found)
    elif validate_data and kind == "bank":
        data, found = validate_bank(data, prefix=data_key)
        errors.update(found)

    alias = _alias(body.get("id"), "id", err)
    parent_id = _alias(body.get("parent_id"), "parent_id", err)
    metadata = _metadata(body.get("metadata"), err)
    placed = _containers(body.get("containers"), kind, err)
    mask = body.get("mask")
    if mask is not None:
        for problem in validate_mask(mask):
            where, _, message = problem.partition(": ")
            err(where, message)
    search_indexes = _expressions(body.get("search_indexes"), err)
    expression = body.get("fingerprint_expression")
    if expression is not None:
        _expression(expression, "fingerprint_expression", err)
    deduplicate = body.get("deduplicate_token")
    if deduplicate is not None and not isinstance(deduplicate, bool):
        err("deduplicate_token", "must be a boolean")
    expires_at = _expiry(body.get("expires_at"), now, err)
    if errors:
        return None, errors

    classification, containers = placed
    context = make_context(kind, data, metadata)
    if mask is None:
        mask = _DEFAULT_MASKS[kind]() if kind in _DEFAULT_MASKS else None
    else:
        try:
            apply_mask(mask, context)
        except ExpressionError as exc:
            where, _, message = str(exc).partition(": ")
            err(where, message)
    if expression is None and (kind != "token" or caller.setting("fingerprint_tokens")):
        expression = default_fingerprint or DEFAULT_FINGERPRINT_EXPRESSIONS[kind]
    fingerprint_input = _render(expression, context, "fingerprint_expression", err) if expression else None
    index_values = []
    for position, source in enumerate(search_indexes):
        value = _render(source, context, f"search_indexes[{position}]", err)
        if value:
            index_values.append(value)
    if errors:
        return None, errors
    return TokenRequest(
        type=kind,
        data=data,
        classification=classification,
        containers=containers,
        metadata=metadata,
        metadata_given=body.get("metadata") is not None,
        mask=mask,
        search_indexes=search_indexes,
        index_values=index_values,
        fingerprint_expression=expression,
        fingerprint_input=fingerprint_input or None,
        deduplicate_token=deduplicate,
        expires_at=expires_at,
        id=alias,
        parent_id=parent_id,
        path=path,
    ), errors


def _alias(value: Any, name: str, err) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not ALIAS_PATTERN.fullmatch(value):
        err(name, "must be 1 to 400 characters: letters, digits, '-', '_', '.' or ':'")
        return None
    return value


def _metadata(value: Any, err) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        err("metadata", "must be an object mapping strings to strings")
        return {}
    if len(value) > MAX_METADATA_PAIRS:
        err("metadata", f"must have at most {MAX_METADATA_PAIRS} pairs")
    for key, item in value.items():
        if not key or len(key) > MAX_METADATA_KEY:
            err("metadata", f"keys must be 1 to {MAX_METADATA_KEY} characters")
        if not isinstance(item, str):
            err(f"metadata.{key}", "must be a string")
        elif len(item) > MAX_METADATA_VALUE:
            err(f"metadata.{key}", f"must be at most {MAX_METADATA_VALUE} characters")
    return dict(value)


def _containers(value: Any, kind: Any, err) -> tuple[str, list[str]]:
    """The classification and containers of a request (defaults from the type)."""
    own = TYPE_CLASSIFICATION.get(kind, "general")
    if value is None:
        return own, [f"/{own}/high/"]
    if not isinstance(value, list) or not value or len(value) > MAX_CONTAINERS:
        err("containers", f"must be an array of 1 to {MAX_CONTAINERS} container paths")
        return own, []
    found, valid = set(), True
    for position, container in enumerate(value):
        parsed = parse_container(container) if isinstance(container, str) else None
        if parsed is None:
            valid = False
            err(
                f"containers[{position}]",
                "must be a path /<classification>/<impact_level>/ with classification "
                f"{', '.join(CLASSIFICATIONS)} and impact level {', '.join(IMPACT_LEVELS)}",
            )
        elif kind in ("card", "bank") and parsed[0] != own:
            valid = False
            err(f"containers[{position}]", f"a {kind} token must be in /{own}/ containers")
        else:
            found.add(parsed[0])
    if len(found) > 1:
        err("containers", "the containers of one token must share one classification")
    if not valid or len(found) != 1:
        return own, []
    return found.pop(), list(dict.fromkeys(value))


def _expression(source: Any, name: str, err) -> bool:
    try:
        validate_expression(source)
    except ExpressionError as exc:
        err(name, str(exc))
        return False
    return True


def _expressions(value: Any, err) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_SEARCH_INDEXES:
        err("search_indexes", f"must be an array of at most {MAX_SEARCH_INDEXES} expressions")
        return []
    return [source for i, source in enumerate(value) if _expression(source, f"search_indexes[{i}]", err)]


def _render(source: str, context: dict, name: str, err) -> str | None:
    try:
        return render(source, context)
    except ExpressionError as exc:
        err(name, str(exc))
        return None


def _expiry(value: Any, now: dt.datetime, err) -> dt.datetime | None:
    if value is None:
        return None
    try:
        moment = dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        moment = None
    if moment is None:
        err("expires_at", "must be an ISO 8601 date-time")
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    if moment <= now:
        err("expires_at", "must be in the future")
        return None
    return moment


# ---- access --------------------------------------------------------------------------------------


def placement(token: Token) -> tuple[str, int]:
    """``(classification, impact rank)`` of a stored token: its containers' classification and
    the lowest impact level among them (low 0, moderate 1, high 2)."""
    return container_placement(token.containers or (), token.type)


def container_placement(containers: Iterable[str], token_type: str | None) -> tuple[str, int]:
    """``(classification, impact rank)`` of a token of ``token_type`` in ``containers`` (without
    containers: the type's classification, high)."""
    parsed = [parse_container(c) for c in containers]
    parsed = [p for p in parsed if p is not None]
    if not parsed:
        return TYPE_CLASSIFICATION.get(str(token_type), "general"), len(IMPACT_LEVELS) - 1
    return parsed[0][0], min(IMPACT_LEVELS.index(level) for _, level in parsed)


def read_access(caller: Caller, token: Token) -> str:
    """How much of ``token``'s data ``caller`` may see: ``full``, ``masked`` or ``none``.

    Full when the caller's best ``token:<c>:read:<level>`` reaches the token's impact level, masked
    when it holds a lower read level of the classification, none without any.
    """
    classification, rank = placement(token)
    best = read_level(caller.permissions, classification)
    if best >= rank:
        return FULL
    return MASKED if best >= 0 else NONE


def _require_read(caller: Caller, token: Token) -> str:
    access = read_access(caller, token)
    if access == NONE:
        classification, rank = placement(token)
        raise forbidden(f"token:{classification}:read:{IMPACT_LEVELS[rank]}")
    return access


def _readable_classifications(caller: Caller) -> list[str]:
    readable = [c for c in CLASSIFICATIONS if read_level(caller.permissions, c) >= 0]
    if not readable:
        raise Problem(403, "The API key holds no token read permission (token:<classification>:read:<impact_level>).")
    return readable


def _without_cvc(kind: str, data: Any) -> Any:
    if kind == "card" and isinstance(data, dict) and "cvc" in data:
        return {k: v for k, v in data.items() if k != "cvc"}
    return data


def token_view(token: Token, data: Any, caller: Caller, *, access: str | None = None) -> dict:
    """The token object answered to ``caller`` (decisions of the tokens issue; spec "Token").

    Fields: ``id, tenant_id, type, data, mask, containers, metadata, search_indexes, fingerprint,
    fingerprint_expression, deduplicate_token, parent_id, created_by, created_at, modified_by,
    modified_at, expires_at``. ``data`` (the plain data, or None when not loaded) is shown complete,
    masked or left out according to :func:`read_access` (or ``access`` when already known); a
    card's ``cvc`` is never shown.
    """
    access = access or read_access(caller, token)
    view: dict[str, Any] = {"id": token.id, "tenant_id": token.tenant_id, "type": token.type}
    if access != NONE and data is not None:
        data = _without_cvc(token.type, data)
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


def _needs_data(token: Token, access: str) -> bool:
    return access == FULL or (access == MASKED and token.mask is not None)


def _present(session: Session, caller: Caller, tokens: Iterable[Token], now: dt.datetime) -> list[dict]:
    """Views of ``tokens`` by the read rules, decrypting only what is shown; one log row each."""
    views = []
    rows = Rows()
    for token in tokens:
        access = read_access(caller, token)
        data = _open(session, token, now) if _needs_data(token, access) else None
        views.append(token_view(token, data, caller, access=access))
        audit.stage(rows, caller, entity_type=token.type, entity_id=token.id, operation="read")
    stage_token_activity(rows, caller.tenant_id, [view["id"] for view in views], now=now)
    stage_rows(session, rows)
    return views


# ---- storage helpers -----------------------------------------------------------------------------


def _live(now: dt.datetime):
    return or_(col(Token.expires_at).is_(None), col(Token.expires_at) > now)


def _seal(session: Session, tenant_id: uuid.UUID, token_id: str, data: Any) -> bytes:
    plain = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return get_keyring().encrypt(session, tenant_id, DATA_PURPOSE, token_id, plain)


def _open(session: Session, token: Token, now: dt.datetime) -> Any:
    """The plain data of a token; a card's cvc past its retention is left out even before the sweep."""
    return open_token_data(session, token.tenant_id, token.id, token.type, token.data_ct, token.cvc_expires_at, now=now)


def open_token_data(
    session: Session,
    tenant_id: uuid.UUID,
    token_id: str,
    type: str,
    data_ct: bytes,
    cvc_expires_at: dt.datetime | None,
    *,
    now: dt.datetime | None = None,
) -> Any:
    """The plain data of a token from its stored values (e.g. read by :func:`live_token_reads`): a
    card's cvc past its retention is left out even before the sweep."""
    data = json.loads(get_keyring().decrypt(session, tenant_id, DATA_PURPOSE, token_id, data_ct))
    if cvc_expires_at is not None and cvc_expires_at <= (now or utcnow()):
        data = _without_cvc(type, data)
    return data


def live_token_reads(tenant_id, token_id, *, now: dt.datetime | None = None) -> dict[str, Any]:
    """What :func:`open_token_data` needs of the live token ``token_id`` of ``tenant_id`` (both SQL
    expressions, e.g. over a job row), as scalar subqueries for a lease statement
    (:func:`infra.jobs.lease`): ``token_type``, ``token_data_ct``, ``token_cvc_expires_at``
    (each None when the token is missing or expired). Like :func:`load_token_data`, no permission
    check and no log row; the caller also counts the token's activity."""
    live = (Token.tenant_id == tenant_id, Token.id == token_id, _live(now or utcnow()))
    return {
        f"token_{column.key}": select(column).where(*live).scalar_subquery()
        for column in (Token.type, Token.data_ct, Token.cvc_expires_at)
    }


def _cvc_expiry(kind: str, data: Any, now: dt.datetime) -> dt.datetime | None:
    if kind == "card" and isinstance(data, dict) and data.get("cvc"):
        return now + dt.timedelta(seconds=get_settings().cvc_retention_seconds)
    return None


def _get_live(session: Session, tenant_id: uuid.UUID, token_id: str, now: dt.datetime, *, lock: bool = False) -> Token:
    stmt = select(Token).where(Token.tenant_id == tenant_id, Token.id == token_id, _live(now))
    token = session.exec(stmt.with_for_update() if lock else stmt).first()
    if token is None:
        raise not_found("token")
    return token


#: The columns of a token that reads show, selected as plain rows (attribute names of :class:`Token`).
_READ_COLUMNS = (
    Token.tenant_id,
    Token.id,
    Token.type,
    Token.data_ct,
    Token.mask,
    Token.containers,
    Token.meta,
    Token.search_indexes,
    Token.fingerprint,
    Token.fingerprint_expression,
    Token.deduplicate_token,
    Token.parent_id,
    Token.created_by,
    Token.created_at,
    Token.modified_by,
    Token.modified_at,
    Token.expires_at,
    Token.cvc_expires_at,
)


def _read_select():
    """``SELECT`` of the :data:`_READ_COLUMNS` of tokens: rows, not ORM objects, for reads."""
    return select(*_READ_COLUMNS)


def _get_live_row(session: Session, tenant_id: uuid.UUID, token_id: str, now: dt.datetime):
    """A live token as a plain row (404 problem when missing or expired), for reads."""
    row = session.exec(_read_select().where(Token.tenant_id == tenant_id, Token.id == token_id, _live(now))).first()
    if row is None:
        raise not_found("token")
    return row


def _write_lookups(session: Session, token: Token, index_values: Iterable[str], *, replace: bool) -> None:
    """(Re)write the metadata rows and blind-index rows of ``token``."""
    if replace:
        session.flush()  # rows of this token still pending must be written before they are replaced
        for table in (TokenMetadata, TokenSearchIndex):
            session.execute(delete(table).where(table.tenant_id == token.tenant_id, table.token_id == token.id))
    session.add_all(
        TokenMetadata(tenant_id=token.tenant_id, token_id=token.id, key=k, value=v)
        for k, v in (token.meta or {}).items()
    )
    keyring = get_keyring()
    digests = {keyring.blind_index(session, token.tenant_id, value) for value in index_values}
    session.add_all(TokenSearchIndex(tenant_id=token.tenant_id, token_id=token.id, digest=d) for d in digests)


def _stage_new_token(session: Session, rows: Rows, token: NewToken) -> None:
    """Queue the ``tokens`` row of a new token with its metadata and blind-index rows."""
    rows.add(_TOKENS, token.row())
    for key, value in token.meta.items():
        rows.add(_METADATA, {"tenant_id": token.tenant_id, "token_id": token.id, "key": key, "value": value})
    keyring = get_keyring()
    for digest in dict.fromkeys(keyring.blind_index(session, token.tenant_id, v) for v in token.index_values):
        rows.add(_INDEXES, {"tenant_id": token.tenant_id, "token_id": token.id, "digest": digest})


_TOKENS, _METADATA, _INDEXES = table_of(Token), table_of(TokenMetadata), table_of(TokenSearchIndex)


def _delete_rows(session: Session, tenant_id: uuid.UUID, token_ids: list[str]) -> None:
    """Delete tokens with their metadata and blind-index rows; each stays counted as active in the
    month it was created (``domain.tenancy.usage.record_deleted_tokens``)."""
    for table, column in ((TokenMetadata, TokenMetadata.token_id), (TokenSearchIndex, TokenSearchIndex.token_id)):
        session.execute(delete(table).where(table.tenant_id == tenant_id, column.in_(token_ids)))
    gone = session.execute(
        delete(Token)
        .where(col(Token.tenant_id) == tenant_id, col(Token.id).in_(token_ids))
        .returning(col(Token.id), col(Token.created_at))
    ).all()
    record_deleted_tokens(session, tenant_id, gone)


def _touch(
    session: Session, rows: Rows, caller: Caller, token: Token | NewToken, operation: str, event: str | None
) -> None:
    """Queue in ``rows`` a log row for ``operation`` and, when ``event`` is named, the event
    ``token.<event>`` (written only when a webhook of the tenant subscribes to it)."""
    audit.stage(rows, caller, entity_type=token.type, entity_id=token.id, operation=operation)
    if event:
        events.emit(
            session,
            tenant_id=token.tenant_id,
            type=f"token.{event}",
            data={"token": {"id": token.id, "type": token.type}},
            trace_id=caller.trace_id,
            rows=rows,
        )


# ---- create --------------------------------------------------------------------------------------


def create_tokens(
    session: Session, caller: Caller, requests: list[TokenRequest], *, now: dt.datetime | None = None
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
    _check_references(session, tenant_id, requests, now)
    keyring = get_keyring()
    fingerprints = [
        keyring.fingerprint(session, tenant_id, r.fingerprint_input) if r.fingerprint_input else None for r in requests
    ]
    existing = _dedup_candidates(session, caller, requests, fingerprints, now)
    read_only = caller.tenant_settings.get("token_deduplication_behavior") == "read_existing"
    results: list[Created] = []
    rows, fresh = Rows(), Rows()
    try:
        with session.no_autoflush:  # one batched flush at the end, not one per token
            for request, fingerprint in zip(requests, fingerprints, strict=True):
                match = existing.get((request.type, request.classification, fingerprint)) if fingerprint else None
                if match is not None and _deduplicates(caller, request):
                    results.append(_deduplicate(session, rows, caller, match, request, read_only, now))
                    continue
                token = _new_token(session, rows, caller, request, fingerprint, now)
                if fingerprint:
                    existing.setdefault((request.type, request.classification, fingerprint), token)
                results.append(Created(token, request.data))
        for result in results:
            if isinstance(result.token, NewToken) and not result.deduplicated:
                _stage_new_token(session, fresh, result.token)
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


def _deduplicates(caller: Caller, request: TokenRequest) -> bool:
    if request.deduplicate_token is not None:
        return request.deduplicate_token
    return caller.setting("deduplicate_tokens")


def _check_references(session: Session, tenant_id: uuid.UUID, requests: list[TokenRequest], now: dt.datetime) -> None:
    errors = _Errors()
    aliases: dict[str, TokenRequest] = {}
    for request in requests:
        if request.id is not None:
            if request.id in aliases:
                errors.add(_key(request.path, "id"), "is used by another token of this request")
            aliases[request.id] = request
    if aliases:
        taken = session.exec(
            select(Token.id, Token.expires_at).where(
                col(Token.tenant_id) == tenant_id, col(Token.id).in_(list(aliases))
            )
        ).all()
        live = [token_id for token_id, expires_at in taken if expires_at is None or expires_at > now]
        if live:
            raise Problem(409, f"A token with the id {live[0]!r} already exists in the tenant.")
        if taken:
            _delete_rows(session, tenant_id, [token_id for token_id, _ in taken])
    parents = {r.parent_id for r in requests if r.parent_id is not None}
    if parents:
        found = set(
            session.exec(
                select(Token.id).where(col(Token.tenant_id) == tenant_id, col(Token.id).in_(list(parents)), _live(now))
            ).all()
        )
        for request in requests:
            if request.parent_id is not None and request.parent_id not in found:
                errors.add(_key(request.path, "parent_id"), "no token of the tenant has this id")
    if errors:
        raise validation_problem(errors)


def _dedup_candidates(
    session: Session, caller: Caller, requests: list[TokenRequest], fingerprints: list[str | None], now: dt.datetime
) -> dict[tuple[str, str, str], Token]:
    wanted = {fp for r, fp in zip(requests, fingerprints, strict=True) if fp and _deduplicates(caller, r)}
    if not wanted:
        return {}
    rows = session.exec(
        select(Token)
        .where(col(Token.tenant_id) == caller.tenant_id, col(Token.fingerprint).in_(list(wanted)), _live(now))
        .order_by(col(Token.created_at), Token.id)
    ).all()
    found: dict[tuple[str, str, str], Token] = {}
    for token in rows:
        found.setdefault((token.type, placement(token)[0], token.fingerprint), token)
    return found


def _new_token(
    session: Session, rows: Rows, caller: Caller, request: TokenRequest, fingerprint: str | None, now: dt.datetime
) -> NewToken:
    token_id = request.id or str(uuid.uuid4())
    token = NewToken(
        tenant_id=caller.tenant_id,
        id=token_id,
        type=request.type,
        data_ct=_seal(session, caller.tenant_id, token_id, request.data),
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
        cvc_expires_at=_cvc_expiry(request.type, request.data, now),
        index_values=request.index_values,
    )
    _touch(session, rows, caller, token, "create", "created")
    return token


def _deduplicate(
    session: Session,
    rows: Rows,
    caller: Caller,
    token: Token | NewToken,
    request: TokenRequest,
    read_only: bool,
    now: dt.datetime,
) -> Created:
    """Answer ``request`` with ``token`` (a stored token, or one made earlier in this batch and not
    written yet): read it, or replace its data (and metadata when given) and recompute its indexes."""
    if read_only:
        access = read_access(caller, token)
        data = _open(session, token, now) if _needs_data(token, access) else None
        _touch(session, rows, caller, token, "read", None)
        return Created(token, data, deduplicated=True)
    token.data_ct = _seal(session, token.tenant_id, token.id, request.data)
    token.cvc_expires_at = _cvc_expiry(token.type, request.data, now)
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
        _write_lookups(session, token, [v for v in values if v], replace=True)
    _touch(session, rows, caller, token, "update", "updated")
    return Created(token, request.data, deduplicated=True)


def create_token(session: Session, caller: Caller, body: Any, *, now: dt.datetime | None = None) -> dict:
    """``POST /tokens``: one token request object -> the token object (read rules applied).

    400 (``errors`` keyed ``data.number`` ...), 403, 409 as :func:`parse_token_request` and
    :func:`create_tokens` say; a deduplicated request answers with the existing token.
    """
    now = now or utcnow()
    request, errors = parse_token_request(body, caller, now=now)
    if errors:
        raise validation_problem(errors)
    (created,) = create_tokens(session, caller, [request], now=now)
    return token_view(created.token, created.data, caller)


@dataclass
class _Slot:
    """Where a created token goes in the tokenize answer: its id (bare values) or its object."""

    index: int
    bare: bool


@dataclass
class _Walk:
    caller: Caller
    now: dt.datetime
    requests: list[TokenRequest] = field(default_factory=list)
    errors: _Errors = field(default_factory=_Errors)

    def visit(self, node: Any, path: str, depth: int = 0) -> Any:
        if node is None:
            return None
        if depth > MAX_DEPTH:
            raise validation_problem({path: [f"the body is nested deeper than {MAX_DEPTH} levels"]})
        if isinstance(node, list):
            return [self.visit(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node)]
        if isinstance(node, dict) and not is_token_request(node):
            return {key: self.visit(value, _key(path, key), depth + 1) for key, value in node.items()}
        bare = not isinstance(node, dict)
        body = {"type": "token", "data": node} if bare else node
        request, errors = parse_token_request(body, self.caller, now=self.now, path=path)
        self.errors.update(errors)
        if request is None:
            return None
        self.requests.append(request)
        if len(self.requests) > MAX_TOKENS_PER_REQUEST:
            raise validation_problem({"body": [f"at most {MAX_TOKENS_PER_REQUEST} tokens per request"]})
        return _Slot(len(self.requests) - 1, bare)


def is_token_request(node: Any) -> bool:
    """True when a JSON object in a ``/tokenize`` body is a token request object: a string ``type``
    among the token types, a ``data`` member and no other keys than the token request fields."""
    return (
        isinstance(node, dict)
        and node.get("type") in TOKEN_TYPES
        and "data" in node
        and all(key in REQUEST_FIELDS for key in node)
    )


def tokenize(session: Session, caller: Caller, body: Any, *, now: dt.datetime | None = None) -> Any:
    """``POST /tokenize`` (spec: "Tokenize"): tokenize every value of ``body`` in one transaction.

    Objects and arrays are walked; a token request object (:func:`is_token_request`) is replaced by
    its token object, a bare string, number or boolean by the id of a new ``token``-type token;
    null stays null. The answer has the request's structure. All or nothing: errors of every
    request are answered together (400, keyed by path such as ``card.data.number`` or ``[2].data``),
    then 403/409 as :func:`create_tokens` says. At most :data:`MAX_TOKENS_PER_REQUEST` tokens.
    """
    now = now or utcnow()
    walk = _Walk(caller, now)
    skeleton = walk.visit(body, "")
    if walk.errors:
        raise validation_problem(walk.errors)
    created = create_tokens(session, caller, walk.requests, now=now)

    def fill(node: Any) -> Any:
        if isinstance(node, _Slot):
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
    errors = _Errors()
    if not isinstance(body, dict):
        raise validation_problem({"body": ["must be an object with card and metadata"]})
    for name in body:
        if name not in ("card", "metadata"):
            errors.add(name, "This property is not allowed.")
    data = _psp_card(body.get("card"), errors)
    options = body.get("metadata")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        errors.add("metadata", "must be an object")
        options = {}
    for name in options:
        if name not in PSP_OPTION_FIELDS:
            errors.add(f"metadata.{name}", "This property is not allowed.")
    if errors:
        raise validation_problem(errors)
    request_body = {**options, "type": "card", "data": data}
    request, found = parse_token_request(
        request_body, caller, now=now, path="metadata", data_path="card", default_fingerprint=STRINGIFIED_DATA
    )
    if found:
        renames = {"card.expiration_month": "card.exp_month", "card.expiration_year": "card.exp_year"}
        raise validation_problem({renames.get(k, k): v for k, v in found.items()})
    (created,) = create_tokens(session, caller, [request], now=now)
    access = read_access(caller, created.token)
    view = token_view(created.token, created.data, caller, access=access)
    if created.deduplicated and access != FULL:
        view.pop("data", None)
        view.pop("metadata", None)
    return view


def _psp_card(card: Any, errors: _Errors) -> dict:
    if not isinstance(card, dict):
        errors.add("card", "is required and must be an object")
        return {}
    data: dict[str, Any] = {}
    for name, value in card.items():
        if name not in PSP_CARD_FIELDS:
            errors.add(f"card.{name}", "This property is not allowed.")
        elif value is None:
            continue
        elif name in ("exp_month", "exp_year"):
            digits = 2 if name == "exp_month" else 4
            if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) != digits:
                errors.add(f"card.{name}", f"must be a string of {digits} digits")
            else:
                data["expiration_month" if name == "exp_month" else "expiration_year"] = int(value)
        else:
            data[name] = value
    if "number" not in data:
        errors.add("card.number", "is required")
    return data


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
    token = _get_live_row(session, caller.tenant_id, token_id, now)
    if of_type is not None and token.type != of_type:
        raise not_found("token")
    _require_read(caller, token)
    return _present(session, caller, [token], now)[0]


def load_token_data(
    session: Session, tenant_id: uuid.UUID, token_id: str, *, now: dt.datetime | None = None
) -> tuple[Token, Any]:
    """``(token, plain data)`` of a live token for platform features (network tokens, the account
    updater, the proxy). The data includes a card's ``cvc`` while it is retained. No permission
    check and no log row: the caller does both. Raises a 404 problem when missing or expired."""
    now = now or utcnow()
    token = _get_live(session, tenant_id, token_id, now)
    record_token_activity(session, tenant_id, [token.id], now=now)
    return token, _open(session, token, now)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch of ``target`` by ``patch`` (new values; the inputs are unchanged)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


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
    token = _get_live(session, caller.tenant_id, token_id, now, lock=True)
    classification, _ = placement(token)
    caller.require(f"token:{classification}:update")
    errors = _Errors()
    for name in patch:
        if name not in PATCHABLE_FIELDS:
            errors.add(
                name, "cannot be changed" if name in REQUEST_FIELDS | {"tenant_id"} else "This property is not allowed."
            )
    if errors:
        raise validation_problem(errors)
    current = {
        "data": _open(session, token, now),
        "metadata": token.meta,
        "mask": token.mask,
        "containers": token.containers,
        "search_indexes": token.search_indexes,
        "fingerprint_expression": token.fingerprint_expression,
        "deduplicate_token": token.deduplicate_token,
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
    }
    patched = merge_patch(
        {k: v for k, v in current.items() if v is not None}, {k: v for k, v in patch.items() if k != "privacy"}
    )
    request, errors = parse_token_request(
        {**patched, "type": token.type}, caller, now=now, validate_data="data" in patch
    )
    if errors:
        raise validation_problem(errors)
    if request.classification != classification:
        caller.require(f"token:{request.classification}:update")
    old_cvc = current["data"].get("cvc") if isinstance(current["data"], dict) else None
    new_cvc = request.data.get("cvc") if isinstance(request.data, dict) else None
    if not (new_cvc and new_cvc == old_cvc):
        token.cvc_expires_at = _cvc_expiry(token.type, request.data, now)
    fingerprint = request.fingerprint_input
    token.data_ct = _seal(session, token.tenant_id, token.id, request.data)
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
    _write_lookups(session, token, request.index_values, replace=True)
    rows = Rows()
    _touch(session, rows, caller, token, "update", "updated")
    stage_rows(session, rows)
    return token_view(token, request.data, caller)


def _descendants(session: Session, tenant_id: uuid.UUID, root: Token) -> list[Token]:
    """``root`` and every token below it (children, their children ...), each once."""
    found = {root.id: root}
    frontier = [root.id]
    while frontier:
        rows = session.exec(
            select(Token).where(col(Token.tenant_id) == tenant_id, col(Token.parent_id).in_(frontier))
        ).all()
        frontier = [t.id for t in rows if t.id not in found]
        found.update((t.id, t) for t in rows)
    return list(found.values())


def delete_token(session: Session, caller: Caller, token_id: str, *, now: dt.datetime | None = None) -> None:
    """``DELETE /tokens/{id}``: delete the token and its children (recursively).

    Needs ``token:<c>:delete`` for the classification of every token deleted (403 naming the first
    missing); 404 as :func:`read_token`. One ``delete`` log row and ``token.deleted`` event each.
    """
    now = now or utcnow()
    token = _get_live(session, caller.tenant_id, token_id, now, lock=True)
    doomed = _descendants(session, caller.tenant_id, token)
    for classification in dict.fromkeys(placement(t)[0] for t in doomed):
        caller.require(f"token:{classification}:delete")
    _delete_rows(session, caller.tenant_id, [t.id for t in doomed])
    rows = Rows()
    for gone in doomed:
        _touch(session, rows, caller, gone, "delete", "deleted")
    stage_rows(session, rows)


# ---- list, search, children ----------------------------------------------------------------------


def _cursor_page(
    session: Session, caller: Caller, stmt, *, size: int, position: dict | None, now: dt.datetime
) -> tuple[list[dict], dict | None]:
    """Newest first, keyset on (created_at, id), only live tokens of readable classifications."""
    readable = _readable_classifications(caller)
    stmt = stmt.where(Token.tenant_id == caller.tenant_id, _live(now))
    if len(readable) < len(CLASSIFICATIONS):
        first_container = Token.containers[0].as_string()
        stmt = stmt.where(or_(*(first_container.like(f"/{c}/%") for c in readable)))
    rows, following = keyset_page(
        session, stmt, order=(Token.created_at, Token.id), size=size, after=position, entity=lambda row: row
    )  # plain rows (columns), not ORM objects
    return _present(session, caller, rows, now), following


def _with_metadata(stmt, tenant_id: uuid.UUID, pairs: Iterable[tuple[str, str]]):
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
    stmt = _read_select()
    types = list(types)
    if types:
        stmt = stmt.where(col(Token.type).in_(types))
    if metadata is not None:
        stmt = _with_metadata(stmt, caller.tenant_id, [metadata])
    return _cursor_page(session, caller, stmt, size=size, position=position, now=now)


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
    stmt = _read_select()
    if parsed.id is not None:
        stmt = stmt.where(Token.id == parsed.id)
    if parsed.data is not None:
        digest = get_keyring().blind_index(session, caller.tenant_id, parsed.data)
        stmt = stmt.where(
            col(Token.id).in_(
                select(TokenSearchIndex.token_id).where(
                    col(TokenSearchIndex.tenant_id) == caller.tenant_id, col(TokenSearchIndex.digest) == digest
                )
            )
        )
    stmt = _with_metadata(stmt, caller.tenant_id, parsed.metadata)
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
    parent = _get_live_row(session, caller.tenant_id, parent_id, now)
    _require_read(caller, parent)
    conditions = [Token.tenant_id == caller.tenant_id, Token.parent_id == parent.id, _live(now)]
    ids, types = list(ids), list(types)
    if ids:
        conditions.append(col(Token.id).in_(ids))
    if types:
        conditions.append(col(Token.type).in_(types))
    total = session.exec(select(func.count()).select_from(Token).where(*conditions)).one()
    rows = session.exec(
        _read_select()
        .where(*conditions)
        .order_by(col(Token.created_at).desc(), col(Token.id).desc())
        .offset((page - 1) * size)
        .limit(size)
    ).all()
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
        _delete_rows(session, tenant_id, [t.id for t in tokens])
        system = system_caller(session.get(Tenant, tenant_id))
        staged = Rows()
        for token in tokens:
            _touch(session, staged, system, token, "delete", "deleted")
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
        data = _open(session, token, now)
        token.data_ct = _seal(session, token.tenant_id, token.id, _without_cvc(token.type, data))
        token.cvc_expires_at = None
        session.add(token)
    return len(rows)
