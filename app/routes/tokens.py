"""Tokens: tokenize, create, read, update, delete, list and search (v2), children, the deprecated
decrypt endpoints, the shut-down v1 list and search, and the payment-forwarding tokenize.

Spec, core document: "Token", "Tokenize", "Token children", "Payment-forwarding connection",
sections 5, 7, 8 and 9; ``spec/README.md`` decisions 7 and 8. Handlers are thin: the rules live in
:mod:`domain.tokens.service`; the token request object and its validation are
:class:`domain.tokens.validation.TokenRequestBody`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Awaitable
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from app.api import Api, Call, JsonAnswer, query_extras
from app.pagination import CursorPage, OffsetPage, cursor_page, cursor_query, decode_cursor, offset_page, offset_query
from app.schemas import RequestModel, ResponseModel
from domain.tokens import idempotency, service
from domain.tokens.validation import TokenOptions, TokenRequestBody, TokenType
from infra.errors import Problem, validation_problem

api = Api()
TAG = "Tokens"

#: RFC 9745 ``Deprecation`` value: the decrypt endpoints were deprecated on January 3, 2022.
DECRYPT_DEPRECATION = {"Deprecation": f"@{int(dt.datetime(2022, 1, 3, tzinfo=dt.UTC).timestamp())}"}
MERGE_PATCH = "application/merge-patch+json"

READ_RULES = (
    "Data by read access: the token's impact level is the lowest level of its containers; with "
    "`token:<classification>:read:<level>` at or above it the data is complete, with a lower read level of "
    "the classification it is masked (no mask: left out), without any read permission of the classification "
    "it is left out. A card's `cvc` is never returned. Classification: card -> pci, bank -> bank, token -> "
    "general (a `token` placed in the containers of another classification takes theirs)."
)
READ_ONE = (
    "Permission: `token:<classification>:read:<impact_level>`; a key without any read permission of the "
    "token's classification: 403.\n\n"
)
DECRYPT_TEXT = (
    f"Deprecated on January 3, 2022 (no shutdown date; answers carry "
    f"`Deprecation: {DECRYPT_DEPRECATION['Deprecation']}`). "
)
SHUT_DOWN = "Permission: any valid API key (no `token:<classification>:read:<impact_level>` is checked).\n\n"
EXPIRY = "A token whose `expires_at` has passed answers 404 at once (a sweep deletes it later)."


class TokenOut(ResponseModel):
    id: str = Field(description="A uuid, or the alias given at creation.")
    tenant_id: uuid.UUID
    type: TokenType
    data: Any = Field(None, description="Complete, masked or absent by the caller's read access.")
    mask: Any = None
    containers: list[str]
    metadata: dict[str, str] | None = Field(
        None,
        description="Left out of a deduplicated payment-forwarding answer "
        "unless the key reads the token's container completely.",
    )
    search_indexes: list[str]
    fingerprint: str | None = None
    fingerprint_expression: str | None = None
    deduplicate_token: bool | None = None
    parent_id: str | None = None
    created_by: uuid.UUID | None = None
    created_at: dt.datetime
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None


class TokenPatch(TokenOptions[str | None]):
    """An RFC 7396 merge patch of a token: objects merge, null removes. ``id``, ``type`` and
    ``parent_id`` cannot change (400)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    data: Any = None
    metadata: dict[str, str | None] | None = Field(None, description="Merged; a null value removes the key.")
    privacy: Any = Field(None, description="Ignored.")


class ConvertIn(TokenOptions[str]):
    """Options of the token made from a token intent; ``type`` and ``data`` come from the intent (400)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})


class PspCard(RequestModel):
    number: str
    exp_month: str | None = Field(None, pattern=r"^\d{2}$")
    exp_year: str | None = Field(None, pattern=r"^\d{4}$")
    cvc: str | int | None = None
    name: str | None = None


class PspOptions(RequestModel):
    id: str | None = None
    mask: Any = None
    containers: list[str] | None = None
    metadata: dict[str, str] | None = None
    search_indexes: list[str] | None = None
    fingerprint_expression: str | None = Field(None, description="Default: the stringified data.")
    deduplicate_token: bool | None = None
    expires_at: dt.datetime | None = None


class PspForwardIn(RequestModel):
    """A card in a payment processor's forwarding format, with the token options in ``metadata``."""

    card: PspCard
    metadata: PspOptions | None = None


#: ``POST /tokenize``: any JSON value, walked recursively by the domain (which validates each token
#: request object it finds); the union documents the forms.
TokenizeIn = Annotated[
    TokenRequestBody | str | float | bool | list[Any] | dict[str, Any] | None,
    Field(
        description="A token request object, a bare string/number/boolean, or objects and arrays of them "
        "(mixed types), walked recursively."
    ),
]
#: The answer mirrors the request: each token request object replaced by its token, each bare value by its id.
TokenizeOut = Annotated[
    TokenOut | str | list[Any] | dict[str, Any] | None,
    Field(
        description="The request's structure with each token request object replaced by its token object and "
        "each bare value by the id of its token."
    ),
]


class SearchIn(RequestModel):
    query: str = Field(
        max_length=4096,
        description="id:<id>, data:<value>, metadata.<key>:<value>, or "
        "metadata.<key>:<value> terms joined by AND. Values may be double-quoted.",
    )
    size: int = Field(20, ge=1, le=100)
    start: str | None = Field(None, description="The cursor from pagination.next.")


TokenPage = CursorPage[TokenOut]


async def _deprecated(answer: Awaitable[Any]) -> Any:
    """Await a deprecated endpoint's answer; its problems carry the ``Deprecation`` header too."""
    try:
        return await answer
    except Problem as problem:
        problem.headers.update(DECRYPT_DEPRECATION)
        raise


ListQuery = cursor_query(100, type=(list[TokenType], Field(default_factory=list, description="Token types.")))
ChildrenQuery = offset_query(
    100,
    id=(list[str], Field(default_factory=list, description="Child token ids (repeatable).")),
    type=(list[TokenType], Field(default_factory=list, description="Child token types (repeatable).")),
)
METADATA_PARAMETER = {
    "name": "metadata.<key>",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "At most one: tokens whose metadata <key> equals the value exactly (case-sensitive).",
}


# ---- create --------------------------------------------------------------------------------------

IDEMPOTENCY_TEXT = (
    "\n\nIdempotency (a decision of this implementation, as the hosted service does for tokens): an optional header "
    "`<prefix>-IDEMPOTENCY-KEY` (prefix: `TESSERA_HEADER_PREFIX`, default `TS`; 1 to 255 printable ASCII "
    "characters; 400 otherwise). The key alone defines sameness within the tenant and this endpoint (the body "
    "is not compared): a repeated key answers the original 201 answer, as it was, and creates nothing. A "
    "request that fails (400, 403, 409) keeps nothing, so its key may be sent again. Keys are kept at least "
    "24 hours from their first use; after that a key may start a new creation. Two concurrent requests with "
    "one key create once: the second waits for the first and answers its answer."
)


def _idempotency_key(call: Call) -> str | None:
    """The request's ``<prefix>-IDEMPOTENCY-KEY`` (None without one); 400 for a malformed key."""
    header = call.settings.header("IDEMPOTENCY-KEY")
    key = call.request.headers.get(header)
    if key is not None and (errors := idempotency.key_errors(key, header)):
        raise validation_problem(errors)
    return key


class _AnyJson:
    """The body adapter of ``POST /tokenize``: every JSON value fits :data:`TokenizeIn` (its union ends
    in any object, array, string, number, boolean or null), so validating against it refuses nothing
    and costs a pass over the body on the hot path; the domain walks the parsed JSON and validates
    each token request object it finds (:class:`domain.tokens.validation.TokenizeBody`)."""

    def validate_python(self, payload: Any) -> Any:
        """``payload`` itself (parsed JSON)."""
        return payload


@api.route(
    "POST",
    "/tokenize",
    body=TokenizeIn,
    body_adapter=_AnyJson(),
    status=201,
    response=TokenizeOut,
    answer_adapter=JsonAnswer(TokenizeOut),
    tag=TAG,
    summary="Tokenize one or many values",
    errors=(400, 401, 403, 409),
    description="Permission: `token:<classification>:create` for every classification tokenized (403 names "
    "the missing one).\n\nThe body is walked recursively and the answer (201) has the same structure: an "
    "object is a token request object when it has a string `type` among token, card, bank, a `data` member "
    "and no keys outside the token request fields; it is replaced by the created token object. Any other "
    "object or array is walked. A bare string, number or boolean becomes a `token`-type token and is "
    "replaced by its id; null stays null. One transaction: every request valid or nothing written; errors "
    "are keyed by path (`card.data.number`, `[2].data`). At most 1000 tokens per request.\n\n"
    "Fingerprints: card and bank always (default expression of the type unless `fingerprint_expression`); "
    "`token` when the tenant setting `fingerprint_tokens` is 'true' or an expression is given. "
    "Deduplication when `deduplicate_token` is true (or unset and the tenant's `deduplicate_tokens` is "
    "'true'): another live token of the same type and fingerprint is answered instead (still 201, no second "
    "row); under `token_deduplication_behavior` `update_existing` (default) its data (and metadata when "
    "given) is replaced, under `read_existing` it is unchanged. A card's `cvc` is kept one hour for provider "
    "calls, then dropped. " + READ_RULES + IDEMPOTENCY_TEXT,
)
async def tokenize(call: Call):
    return await call.db_grouped(
        idempotency.once, call.caller, idempotency.TOKENIZE, _idempotency_key(call), service.tokenize, call.payload
    )


@api.route(
    "POST",
    "/tokens",
    body=TokenRequestBody,
    status=201,
    response=TokenOut,
    tag=TAG,
    summary="Create a token",
    errors=(400, 401, 403, 409),
    description="Permission: `token:<classification>:create` (card -> pci, bank -> bank, token -> the "
    "classification of its containers, default general).\n\nContainers must parse as "
    "/<classification>/<impact_level>/ and, for card and bank, be of the type's classification. "
    "Unknown properties: 400. An alias `id` already used by a live token of the tenant: 409. Card data: "
    "Luhn and expiry checked. Deduplication and fingerprints as for POST /tokenize (201 with the existing "
    "token on a hit). " + READ_RULES + IDEMPOTENCY_TEXT,
)
async def create(call: Call):
    return await call.db_grouped(
        idempotency.once, call.caller, idempotency.TOKENS, _idempotency_key(call), service.create_token, call.body
    )


@api.route(
    "POST",
    "/connections/psp-forward/tokenize",
    permission="token:pci:create",
    body=PspForwardIn,
    status=201,
    response=TokenOut,
    tag=TAG,
    summary="Tokenize a card in a payment processor's forwarding format",
    errors=(400, 401, 403, 409),
    description="`token:create` is the retired legacy name of `token:pci:create`. `card` "
    "{number, exp_month 'MM', exp_year 'YYYY', cvc, name} becomes card token data {number, "
    "expiration_month (integer), expiration_year (integer), cvc, name}, so expressions refer to "
    "`data.expiration_month`. `metadata` carries the token options {id, mask, containers, metadata, "
    "search_indexes, fingerprint_expression (default the stringified data), deduplicate_token, "
    "expires_at}. Errors are keyed `card.<field>` and `metadata.<field>`. When the answer is an existing "
    "token found by deduplication, `data` and `metadata` are left out unless the key reads the token's "
    "container completely. " + READ_RULES,
)
async def psp_forward(call: Call):
    return await call.db_grouped(service.psp_forward_tokenize, call.caller, call.payload)


# ---- list and search -----------------------------------------------------------------------------


def _list_filters(call: Call) -> tuple[str, str] | None:
    """The one ``metadata.<key>`` filter of a v2 list (400 for ``id``, several metadata or others)."""
    extras = query_extras(call.query)
    if "id" in extras:
        message = (
            "The id query parameter is not supported by GET /v2/tokens; read one token with "
            "GET /tokens/{id} or search id:<id> with POST /v2/tokens/search."
        )
        raise validation_problem({"id": [message]})
    unknown = [name for name in extras if not name.startswith("metadata.")]
    if unknown:
        raise validation_problem({name: ["This query parameter is not supported."] for name in unknown})
    pairs = [(name, value) for name in extras for value in call.request.query.getall(name)]
    if len(pairs) > 1:
        raise validation_problem(
            {
                "metadata": [
                    "Only one metadata.<key> query parameter is supported; combine the "
                    "values into one metadata field or filter client-side."
                ]
            }
        )
    if not pairs:
        return None
    name, value = pairs[0]
    key = name[len("metadata.") :]
    if not key:
        raise validation_problem({name: ["Name the metadata key: metadata.<key>=<value>."]})
    return key, value


async def _list(call: Call) -> dict:
    q = call.query
    metadata = _list_filters(call)
    position = decode_cursor(call, q.start)
    data, following = await call.db(
        service.list_tokens, call.caller, types=q.type, metadata=metadata, size=q.size, position=position
    )
    return cursor_page(call, data, size=q.size, next_position=following)


LIST_TEXT = (
    "Cursor pagination, newest first (size 1..100, default 20). Filters: `type` (repeatable) and at most one "
    "`metadata.<key>=<value>` (exact, case-sensitive). The `id` parameter, several metadata parameters or any "
    "other parameter: 400. Only tokens of classifications the key can read are listed (403 when it can read "
    "none). "
)


@api.route(
    "GET",
    "/v2/tokens",
    query=ListQuery,
    response=TokenPage,
    tag=TAG,
    summary="List tokens",
    errors=(400, 401, 403),
    openapi_extra={"parameters": [METADATA_PARAMETER]},
    description="Permission: any `token:<classification>:read:<impact_level>`.\n\n"
    + LIST_TEXT
    + READ_RULES
    + " "
    + EXPIRY,
)
async def list_v2(call: Call):
    return await _list(call)


@api.route(
    "POST",
    "/v2/tokens/search",
    body=SearchIn,
    response=TokenPage,
    tag=TAG,
    summary="Search tokens",
    errors=(400, 401, 403),
    description="Permission: any `token:<classification>:read:<impact_level>`.\n\n`query` takes one "
    "`id:<id>` term, one `data:<value>` term (matched against the tokens' search indexes, stored only as "
    "keyed digests), one `metadata.<key>:<value>` term, or several `metadata.<key>:<value>` terms joined by "
    "` AND ` (exact, case-sensitive). Any other form (OR, NOT, `-term`, grouping, the fields type, "
    "fingerprint, container, created_*, modified_*, free text, mixed id/metadata/data) answers 400 naming "
    "what is unsupported (complex queries were shut down on January 23, 2024). Cursor pagination as "
    "GET /v2/tokens (`size`, `start` in the body). " + READ_RULES,
)
async def search_v2(call: Call):
    b = call.body
    position = decode_cursor(call, b.start)
    data, following = await call.db(service.search_tokens, call.caller, b.query, size=b.size, position=position)
    return cursor_page(call, data, size=b.size, next_position=following)


@api.route(
    "GET",
    "/tokens",
    status=410,
    tag=TAG,
    summary="List tokens v1 (shut down)",
    errors=(410,),
    deprecated=True,
    description=SHUT_DOWN + "Shut down on March 1, 2025: answers 410. Use GET /v2/tokens.",
)
async def list_v1(call: Call):
    raise Problem(
        410,
        "List tokens v1 was shut down on March 1, 2025; use GET /v2/tokens (cursor pagination; "
        "no id parameter; at most one metadata.<key> parameter, matched exactly and case-sensitively).",
    )


@api.route(
    "POST",
    "/tokens/search",
    status=410,
    tag=TAG,
    summary="Search tokens v1 (shut down)",
    errors=(410,),
    deprecated=True,
    description=SHUT_DOWN + "Shut down on March 1, 2025: answers 410. Use POST /v2/tokens/search.",
)
async def search_v1(call: Call):
    raise Problem(
        410,
        "Search tokens v1 was shut down on March 1, 2025; use POST /v2/tokens/search (cursor "
        "pagination; id:<id>, data:<value>, metadata.<key>:<value> terms, metadata terms joined by AND).",
    )


@api.route(
    "GET",
    "/tokens/decrypt",
    query=ListQuery,
    response=TokenPage,
    tag=TAG,
    summary="List tokens with data (deprecated)",
    errors=(400, 401, 403),
    deprecated=True,
    extra_headers=DECRYPT_DEPRECATION,
    openapi_extra={"parameters": [METADATA_PARAMETER]},
    description="Permission: any `token:<classification>:read:<impact_level>`.\n\n"
    + DECRYPT_TEXT
    + "Answers exactly like GET /v2/tokens: data is returned according to the key's read access. "
    + LIST_TEXT,
)
async def list_decrypt(call: Call):
    return await _deprecated(_list(call))


# ---- one token -----------------------------------------------------------------------------------


@api.route(
    "GET",
    "/tokens/{id}",
    response=TokenOut,
    tag=TAG,
    summary="Get a token",
    errors=(401, 403, 404),
    description=READ_ONE + READ_RULES + " " + EXPIRY,
)
async def get(call: Call):
    return await call.db(service.read_token, call.caller, call.params["id"])


@api.route(
    "GET",
    "/tokens/{id}/decrypt",
    response=TokenOut,
    tag=TAG,
    summary="Get a token (deprecated)",
    errors=(401, 403, 404),
    deprecated=True,
    extra_headers=DECRYPT_DEPRECATION,
    description=READ_ONE + DECRYPT_TEXT + "Answers exactly like GET /tokens/{id}: data according to the key's "
    "read access.",
)
async def get_decrypt(call: Call):
    return await _deprecated(call.db(service.read_token, call.caller, call.params["id"]))


@api.route(
    "GET",
    "/atomic/banks/{id}/decrypt",
    response=TokenOut,
    tag=TAG,
    summary="Get a bank token (deprecated)",
    errors=(401, 403, 404),
    deprecated=True,
    extra_headers=DECRYPT_DEPRECATION,
    description=READ_ONE + DECRYPT_TEXT + "Answers like GET /tokens/{id} for a token of type bank "
    "(another type: 404); data according to the key's read access.",
)
async def get_bank_decrypt(call: Call):
    return await _deprecated(call.db(service.read_token, call.caller, call.params["id"], of_type="bank"))


@api.route(
    "PATCH",
    "/tokens/{id}",
    body=TokenPatch,
    request_content_type=MERGE_PATCH,
    response=TokenOut,
    tag=TAG,
    summary="Update a token (merge patch)",
    errors=(400, 401, 403, 404, 415),
    description="Permission: `token:<classification>:update` (of the new classification too when the "
    "containers change it).\n\nContent-Type must be `application/merge-patch+json` (415 otherwise). The "
    "patch may hold data, metadata, mask, containers, search_indexes, fingerprint_expression, "
    "deduplicate_token, expires_at (privacy is ignored); objects merge recursively and null removes (a "
    "removed mask, container list or fingerprint expression returns to the type's default). id, type and "
    "parent_id cannot change (400). The result is validated like a new token (card data re-validated) and "
    "its fingerprint and search indexes recomputed. Answers 200 with the token. " + READ_RULES,
)
async def update(call: Call):
    return await call.db(service.update_token, call.caller, call.params["id"], call.payload)


@api.route(
    "DELETE",
    "/tokens/{id}",
    status=204,
    tag=TAG,
    summary="Delete a token and its children",
    errors=(401, 403, 404),
    description="Permission: `token:<classification>:delete` for every token deleted.\n\nThe token's children "
    "(and theirs) are deleted with it.",
)
async def delete(call: Call):
    await call.db(service.delete_token, call.caller, call.params["id"])


@api.route(
    "GET",
    "/tokens/{parent_id}/children",
    query=ChildrenQuery,
    response=OffsetPage[TokenOut],
    tag=TAG,
    summary="List a token's children",
    errors=(400, 401, 403, 404),
    description="Permission: `token:<classification>:read:<impact_level>` on the parent (403 without any "
    "read permission of its classification).\n\nOffset pagination (page, size 1..100), newest first; filters "
    "`id` and `type` (repeatable). Children are tokens created with `parent_id`. " + READ_RULES,
)
async def list_children(call: Call):
    q = call.query
    data, total = await call.db(
        service.children, call.caller, call.params["parent_id"], ids=q.id, types=q.type, page=q.page, size=q.size
    )
    return offset_page(data, total=total, page=q.page, size=q.size)
