"""The token request object and its one validation (spec, core document: "Tokenize", "Token"; section 9).

:class:`TokenRequestBody` is the token request object: the route of ``POST /tokens`` takes it as its
body model (so it is also what the API documents), and :func:`parse_token_request` validates every
other token request with it (each one found in a ``/tokenize`` body, the payment-forwarding options,
the result of a merge patch, a token intent's conversion). What a model cannot say is checked after
it: the data of a card or bank (``domain.tokens.cards``), the expressions of a mask (errors keyed
``mask.number``), and the rendering of the mask, fingerprint and search index expressions against
the data. Errors answer 400 keyed by property path (``card.data.number``, ``[2].containers[0]``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationInfo
from pydantic import ValidationError as ModelError

from domain.tenancy.caller import Caller
from domain.tenancy.permissions import CLASSIFICATIONS, IMPACT_LEVELS, TYPE_CLASSIFICATION, parse_container
from domain.tokens.cards import (
    DEFAULT_FINGERPRINT_EXPRESSIONS,
    default_bank_mask,
    default_card_mask,
    validate_bank,
    validate_card,
)
from domain.tokens.errors import ExpressionError, FieldErrors, field_key
from domain.tokens.expressions import apply_mask, make_context, render, validate_expression, validate_mask
from infra.errors import validation_errors, validation_problem
from storage.types import utcnow

TOKEN_TYPES: tuple[str, ...] = ("token", "card", "bank")
TokenType = Literal["token", "card", "bank"]
ALIAS_PATTERN = r"^[A-Za-z0-9\-_.:]{1,400}$"
MAX_METADATA_PAIRS = 100
MAX_METADATA_KEY = 255
MAX_METADATA_VALUE = 1024
MAX_SEARCH_INDEXES = 20
MAX_CONTAINERS = 20
MAX_TOKENS_PER_REQUEST = 1000
MAX_DEPTH = 64
#: The fingerprint expression of a payment-forwarding card: its whole (stringified) data.
STRINGIFIED_DATA = "{{ data | stringify }}"
_DEFAULT_MASKS = {"card": default_card_mask, "bank": default_bank_mask}


# ---- the token request object (one model) --------------------------------------------------------


def _metadata_pairs(value: dict[str, Any]) -> dict[str, Any]:
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"must have at most {MAX_METADATA_PAIRS} pairs")
    if any(not key or len(key) > MAX_METADATA_KEY for key in value):
        raise ValueError(f"keys must be 1 to {MAX_METADATA_KEY} characters")
    return value


#: A metadata value: a string (a token's metadata), or a string or null (a merge patch; null removes the key).
MetadataValue = TypeVar("MetadataValue", str, str | None)


def _container(value: str, info: ValidationInfo) -> str:
    """A container path of the token's type's classification (card and bank; a ``token`` takes any)."""
    parsed = parse_container(value)
    if parsed is None:
        raise ValueError(
            "must be a path /<classification>/<impact_level>/ with classification "
            f"{', '.join(CLASSIFICATIONS)} and impact level {', '.join(IMPACT_LEVELS)}"
        )
    kind = info.data.get("type")
    own = TYPE_CLASSIFICATION.get(str(kind), "general")
    if kind in ("card", "bank") and parsed[0] != own:
        raise ValueError(f"a {kind} token must be in /{own}/ containers")
    return value


def _one_classification(value: list[str]) -> list[str]:
    if len({container_classification(c) for c in value}) > 1:
        raise ValueError("the containers of one token must share one classification")
    return list(dict.fromkeys(value))


def _expression(value: str) -> str:
    validate_expression(value)  # ExpressionError is a ValueError: its message is the field's
    return value


def _iso_datetime(value: Any) -> dt.datetime:
    """An ISO 8601 string (JSON has no date-time) as an aware date-time (UTC when it names no zone)."""
    moment: dt.datetime | None = value if isinstance(value, dt.datetime) else None
    if isinstance(value, str):
        try:
            moment = dt.datetime.fromisoformat(value)
        except ValueError:
            pass
    if moment is None:
        raise ValueError("must be an ISO 8601 date-time")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)


def _future(value: dt.datetime, info: ValidationInfo) -> dt.datetime:
    now = (info.context or {}).get("now") or utcnow()
    if value <= now:
        raise ValueError("must be in the future")
    return value


Container = Annotated[str, AfterValidator(_container)]
Expression = Annotated[str, AfterValidator(_expression)]
Alias = Annotated[str, Field(pattern=ALIAS_PATTERN)]
Expiry = Annotated[dt.datetime, BeforeValidator(_iso_datetime), AfterValidator(_future)]


class TokenOptions(BaseModel, Generic[MetadataValue]):
    """The options of a token request (every one optional; spec "Tokenize"). The rules a value must
    follow are checked here; what depends on the data (masks, rendering) by :func:`parse_token_request`,
    what depends on the tenant (aliases in use, parents) when the tokens are created (409, 400).
    Metadata: at most 100 pairs, keys of 1 to 255 characters, values of at most 1024."""

    model_config = ConfigDict(extra="forbid")

    id: Alias | None = Field(None, description="An alias; an id already used in the tenant answers 409.")
    metadata: (
        Annotated[
            dict[str, Annotated[MetadataValue, Field(max_length=MAX_METADATA_VALUE)]], AfterValidator(_metadata_pairs)
        ]
        | None
    ) = Field(None, description="At most 100 pairs; key <= 255, value <= 1024.")
    mask: Any = Field(
        None,
        description="Expressions mirroring the data; default for card: first six and last "
        "four of the number and the expiration; for bank: the account number's last four.",
    )
    containers: (
        Annotated[list[Container], Field(min_length=1, max_length=MAX_CONTAINERS), AfterValidator(_one_classification)]
        | None
    ) = Field(None, description="Default /<classification>/high/.")
    search_indexes: list[Expression] | None = Field(None, max_length=MAX_SEARCH_INDEXES)
    fingerprint_expression: Expression | None = Field(
        None, description="A Liquid expression; a comma where a filter's pipe belongs is read as the pipe."
    )
    deduplicate_token: StrictBool | None = None
    expires_at: Expiry | None = Field(None, description="ISO 8601, in the future.")
    parent_id: Alias | None = Field(None, description="An existing token of the tenant.")


def _not_null(value: Any) -> Any:
    if value is None:
        raise ValueError("is required")
    return value


class _Typed(BaseModel):
    """The type of a token request, validated before its options (whose container rules read it)."""

    type: TokenType


class TokenRequestBody(TokenOptions[str], _Typed):
    """The token request object. ``data`` by type: card ``{number,
    expiration_month, expiration_year, cvc, name}`` (Luhn and the form of the expiration checked, not
    its date; a numeric ``cvc`` is taken as its digits), bank ``{routing_number, account_number}``,
    token any JSON value."""

    model_config = ConfigDict(
        extra="forbid",
        title="TokenRequest",
        json_schema_extra={
            "examples": [
                {
                    "type": "card",
                    "data": {"number": "4111111111111111", "expiration_month": 12, "expiration_year": 2031},
                    "metadata": {"order": "1234"},
                }
            ],
        },
    )
    data: Annotated[Any, AfterValidator(_not_null)] = Field(
        description="card: {number, expiration_month, expiration_year, cvc, name}; "
        "bank: {routing_number, account_number}; token: any JSON value."
    )
    privacy: Any = Field(None, description="Shut down on February 1, 2023: accepted and ignored.")


#: Properties of a token request object.
REQUEST_FIELDS = frozenset(TokenRequestBody.model_fields)
#: Properties a merge patch may change (the ``privacy`` attribute is accepted and ignored).
PATCHABLE_FIELDS = REQUEST_FIELDS - {"type", "id", "parent_id"}
#: Properties of the ``metadata`` object of the payment-forwarding tokenize body.
PSP_OPTION_FIELDS = REQUEST_FIELDS - {"type", "data", "privacy", "parent_id"}
PSP_CARD_FIELDS = ("number", "exp_month", "exp_year", "cvc", "name")


def container_classification(container: str) -> str | None:
    """The classification of a container path (``/pci/high/`` -> ``pci``); None when malformed."""
    parsed = parse_container(container)
    return parsed[0] if parsed else None


# ---- validated requests --------------------------------------------------------------------------


@dataclass
class ValidatedTokenRequest:
    """A token request that passed :func:`parse_token_request`, with its expressions rendered.

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


def parse_token_request(
    body: Any,
    caller: Caller,
    *,
    now: dt.datetime,
    path: str = "",
    data_path: str | None = None,
    default_fingerprint: str | None = None,
    validate_data: bool = True,
) -> tuple[ValidatedTokenRequest | None, FieldErrors]:
    """Validate one token request object (:class:`TokenRequestBody`, or one already validated by it)
    and render its expressions.

    Card and bank data follow ``domain.tokens.cards``; a mask's expressions are checked leaf by leaf
    (``mask.number``), then the mask, the fingerprint expression (default: ``default_fingerprint``, else
    the type's; a ``token`` has one only when given or when the tenant's ``fingerprint_tokens`` is on)
    and the search index expressions are rendered against the data. Errors are keyed under ``path``
    (``card.data.number``); ``data_path`` overrides the prefix of data errors. ``validate_data`` False
    takes ``data`` as already valid (a stored token's data, unchanged by a patch).

    Returns ``(request, errors)``: ``request`` is None exactly when ``errors`` is not empty. Never raises.
    """
    errors = FieldErrors()
    model: TokenRequestBody | None = body if isinstance(body, TokenRequestBody) else None
    if model is None:
        if not isinstance(body, dict):
            errors.add(path or "body", "must be a token request object")
            return None, errors
        try:
            model = TokenRequestBody.model_validate(body, context={"now": now})
        except ModelError as exc:
            errors.update(validation_errors(exc, prefix=path))
    kind = model.type if model else body.get("type")
    data = model.data if model else body.get("data")
    data_key = data_path or field_key(path, "data")
    if data is not None and validate_data and kind in ("card", "bank"):
        if kind == "card":
            data, found = validate_card(data, today=now.date(), prefix=data_key, check_expiry=False)
        else:
            data, found = validate_bank(data, prefix=data_key)
        errors.update(found)
    mask = model.mask if model else body.get("mask")
    if mask is not None:
        for problem in validate_mask(mask):
            where, _, message = problem.partition(": ")
            errors.add(field_key(path, where), message)
    if model is None or errors:
        return None, errors

    containers = model.containers or [f"/{TYPE_CLASSIFICATION[model.type]}/high/"]
    context = make_context(model.type, data, model.metadata)
    if mask is None:
        mask = _DEFAULT_MASKS[model.type]() if model.type in _DEFAULT_MASKS else None
    else:
        try:
            apply_mask(mask, context)
        except ExpressionError as exc:
            where, _, message = str(exc).partition(": ")
            errors.add(field_key(path, where), message)
    expression = model.fingerprint_expression
    if expression is None and (model.type != "token" or caller.setting("fingerprint_tokens")):
        expression = default_fingerprint or DEFAULT_FINGERPRINT_EXPRESSIONS[model.type]
    fingerprint_input = _render(expression, context, field_key(path, "fingerprint_expression"), errors)
    index_values = []
    for position, source in enumerate(model.search_indexes or ()):
        value = _render(source, context, field_key(path, f"search_indexes[{position}]"), errors)
        if value:
            index_values.append(value)
    if errors:
        return None, errors
    return ValidatedTokenRequest(
        type=model.type,
        data=data,
        classification=container_classification(containers[0]) or TYPE_CLASSIFICATION[model.type],
        containers=containers,
        metadata=model.metadata or {},
        metadata_given=model.metadata is not None,
        mask=mask,
        search_indexes=model.search_indexes or [],
        index_values=index_values,
        fingerprint_expression=expression,
        fingerprint_input=fingerprint_input or None,
        deduplicate_token=model.deduplicate_token,
        expires_at=model.expires_at,
        id=model.id,
        parent_id=model.parent_id,
        path=path,
    ), errors


def _render(source: str | None, context: dict, key: str, errors: FieldErrors) -> str | None:
    if not source:
        return None
    try:
        return render(source, context)
    except ExpressionError as exc:
        errors.add(key, str(exc))
        return None


def require_token_request(body: Any, caller: Caller, *, now: dt.datetime, **options: Any) -> ValidatedTokenRequest:
    """:func:`parse_token_request`, raising its errors as a 400 problem."""
    request, errors = parse_token_request(body, caller, now=now, **options)
    if request is None:
        raise validation_problem(errors)
    return request


# ---- the bodies that carry token requests ---------------------------------------------------------


def is_token_request(node: Any) -> bool:
    """True when a JSON object in a ``/tokenize`` body is a token request object: a string ``type``
    among the token types, a ``data`` member and no other keys than the token request fields."""
    return (
        isinstance(node, dict)
        and node.get("type") in TOKEN_TYPES
        and "data" in node
        and all(key in REQUEST_FIELDS for key in node)
    )


@dataclass
class Slot:
    """Where a created token goes in the tokenize answer: the index of its request, and whether the
    request was a bare value (answered by the token's id) or an object (answered by the token)."""

    index: int
    bare: bool


@dataclass
class TokenizeBody:
    """The token requests of a ``POST /tokenize`` body (spec: "Tokenize"), found by :meth:`visit`."""

    caller: Caller
    now: dt.datetime
    requests: list[ValidatedTokenRequest] = field(default_factory=list)
    errors: FieldErrors = field(default_factory=FieldErrors)

    def visit(self, node: Any, path: str = "", depth: int = 0) -> Any:
        """The skeleton of the answer: ``node`` with each token request object (:func:`is_token_request`)
        and each bare string, number or boolean (a ``token``-type request) replaced by its :class:`Slot`;
        objects and arrays walked, null kept. Collects the requests and their errors (keyed by path);
        raises a 400 problem past :data:`MAX_DEPTH` levels or :data:`MAX_TOKENS_PER_REQUEST` tokens."""
        if node is None:
            return None
        if depth > MAX_DEPTH:
            raise validation_problem({path: [f"the body is nested deeper than {MAX_DEPTH} levels"]})
        if isinstance(node, list):
            return [self.visit(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node)]
        if isinstance(node, dict) and not is_token_request(node):
            return {key: self.visit(value, field_key(path, key), depth + 1) for key, value in node.items()}
        bare = not isinstance(node, dict)
        body = {"type": "token", "data": node} if bare else node
        request, errors = parse_token_request(body, self.caller, now=self.now, path=path)
        self.errors.update(errors)
        if request is None:
            return None
        self.requests.append(request)
        if len(self.requests) > MAX_TOKENS_PER_REQUEST:
            raise validation_problem({"body": [f"at most {MAX_TOKENS_PER_REQUEST} tokens per request"]})
        return Slot(len(self.requests) - 1, bare)


def psp_forward_request(body: Any, caller: Caller, *, now: dt.datetime) -> ValidatedTokenRequest:
    """The card token request of a payment-forwarding tokenize body (spec: "Payment-forwarding
    connection"): ``card`` {number, exp_month "MM", exp_year "YYYY", cvc, name} becomes card data
    {number, expiration_month (int), expiration_year (int), cvc, name}; ``metadata`` holds the options
    (:data:`PSP_OPTION_FIELDS`; the fingerprint expression defaults to the stringified data). Raises
    a 400 problem keyed ``card.<field>`` and ``metadata.<field>``."""
    errors = FieldErrors()
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
    request, found = parse_token_request(
        {**options, "type": "card", "data": data},
        caller,
        now=now,
        path="metadata",
        data_path="card",
        default_fingerprint=STRINGIFIED_DATA,
    )
    if request is None:
        renames = {"card.expiration_month": "card.exp_month", "card.expiration_year": "card.exp_year"}
        raise validation_problem({renames.get(k, k): v for k, v in found.items()})
    return request


def _psp_card(card: Any, errors: FieldErrors) -> dict:
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


def check_token_patch(patch: dict) -> dict:
    """A token merge patch's own rules (``PATCH /tokens/{id}``): only :data:`PATCHABLE_FIELDS`; ``id``,
    ``type``, ``parent_id`` and ``tenant_id`` cannot change. Returns the patch without the ignored
    ``privacy``; raises a 400 problem. The patched token is then validated as a token request
    (:func:`parse_token_request`)."""
    errors = FieldErrors()
    for name in patch:
        if name not in PATCHABLE_FIELDS:
            errors.add(
                name, "cannot be changed" if name in REQUEST_FIELDS | {"tenant_id"} else "This property is not allowed."
            )
    if errors:
        raise validation_problem(errors)
    return {k: v for k, v in patch.items() if k != "privacy"}
