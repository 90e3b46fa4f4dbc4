"""Proxy transforms: their objects (pydantic) and the non-code ones as pure functions.

Core document section 4, Proxy rule 10 ("transform structure depends on the runtime image"); the
shapes are ours, in the API's style (snake_case, ``type`` discriminator, per-field errors):

* ``{"type": "tokenize", "location": "$.card", "token": {"type": "card", "containers": [...],
  "metadata": {...}, ...}}``: each value ``location`` selects in the JSON body becomes the ``data`` of
  a token made from the ``token`` template and is replaced by that token's id;
* ``{"type": "mask", "matcher": "jsonpath" | "regex", "expression": "...", "replacement": "*"}``:
  every string ``expression`` selects (JSONPath in a JSON body; a regular expression, its groups
  when it has any, in any text body) is overwritten with ``replacement`` repeated to its length;
  a non-string JSON value becomes ``replacement``;
* ``{"type": "append_json", "location": "$.a.b", "value": <any JSON>}``: sets a member of the JSON
  body, making the objects on the way;
* ``{"type": "append_text", "value": "..."}``: appends text to the body;
* ``{"type": "append_header", "location": "<Header-Name>", "value": "..."}``: adds a header;
* ``{"type": "code", "code": "...", "runtime": {"image": "node22", ...}}``: run by the ``code_runner``
  the caller gives (the reactor runtime, in a worker); without one, invoking answers 503 ``Proxy
  request transform is initializing``. A new code transform needs a Node runtime image (section 9:
  an omitted image or ``node-svc`` answers 400 since October 5, 2026); transforms already stored
  (:func:`load_transforms`, or those a merge patch keeps: :data:`KEPT_CODE`) are unaffected.

Request transforms apply to the outgoing request; response transforms to the destination's answer,
only when its status is 2xx. Transforms run in the order given. Tokenizing calls out to a
:class:`Tokenizer` the platform implements with :mod:`domain.tokens` (:class:`DomainTokenizer`).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal, Protocol

import jsonpath
from jsonpath.segments import JSONPathChildSegment
from jsonpath.selectors import IndexSelector, NameSelector
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from sqlmodel import Session

from domain.proxy.errors import TRANSFORM_FAILED, TRANSFORM_INITIALIZING, ProxyError
from domain.tenancy.caller import Caller
from domain.tokens import service as tokens
from domain.tokens.validation import REQUEST_FIELDS

MAX_CODE_LENGTH = 50_000
"""Longest code of a code transform, in characters (core document section 8, reactor code)."""
MAX_TRANSFORMS = 20
MAX_PATTERN_LENGTH = 1024
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,256}")


class _Transform(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_path(value: str, *, singular: bool) -> str:
    if not value.startswith("$"):
        raise ValueError("must be a JSONPath starting with '$'")
    try:
        compiled = _compiled(value)
    except jsonpath.JSONPathError as err:
        raise ValueError(f"is not a valid JSONPath ({str(err).splitlines()[0]})") from None
    if singular and not _names(compiled):
        raise ValueError("must be a path of member names and indexes, such as $.a.b or $.items[0]")
    return value


class TokenizeTransform(_Transform):
    """Tokenize the values ``location`` selects; ``token`` is the token request template (its
    ``type`` required, ``data`` taken from the body)."""

    type: Literal["tokenize"]
    location: str = Field(max_length=MAX_PATTERN_LENGTH)
    token: dict[str, Any]

    @field_validator("location")
    @classmethod
    def _location(cls, value: str) -> str:
        return _check_path(value, singular=False)

    @field_validator("token")
    @classmethod
    def _token(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value.get("type"), str):
            raise ValueError('must hold the token type, e.g. {"type": "card"}')
        if "data" in value:
            raise ValueError("takes its data from the body; remove data")
        unknown = set(value) - (REQUEST_FIELDS - {"data", "id", "parent_id", "privacy"})
        if unknown:
            raise ValueError(f"has unknown properties: {', '.join(sorted(unknown))}")
        return value


class MaskTransform(_Transform):
    """Overwrite what ``expression`` selects with ``replacement`` (one character or more)."""

    type: Literal["mask"]
    matcher: Literal["jsonpath", "regex"]
    expression: str = Field(min_length=1, max_length=MAX_PATTERN_LENGTH)
    replacement: str = Field(default="*", min_length=1, max_length=16)

    @field_validator("expression")
    @classmethod
    def _expression(cls, value: str, info) -> str:
        if info.data.get("matcher") == "jsonpath":
            return _check_path(value, singular=False)
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"is not a valid regular expression ({err})") from None
        return value


class AppendJsonTransform(_Transform):
    """Set the member at ``location`` of the JSON body to ``value``."""

    type: Literal["append_json"]
    location: str = Field(max_length=MAX_PATTERN_LENGTH)
    value: Any

    @field_validator("location")
    @classmethod
    def _location(cls, value: str) -> str:
        return _check_path(value, singular=True)


class AppendTextTransform(_Transform):
    """Append ``value`` to the body."""

    type: Literal["append_text"]
    value: str = Field(max_length=65_536)


class AppendHeaderTransform(_Transform):
    """Add the header ``location`` with ``value``."""

    type: Literal["append_header"]
    location: str
    value: str = Field(max_length=8192)

    @field_validator("location")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _HEADER_NAME.fullmatch(value):
            raise ValueError("must be an HTTP header name")
        return value

    @field_validator("value")
    @classmethod
    def _value(cls, value: str) -> str:
        if any(ch in value for ch in "\r\n\0"):
            raise ValueError("may not hold line breaks or NUL")
        return value


RUNTIME_IMAGE_ERROR = "runtime_image"
"""The pydantic error type of the runtime image rule; its message belongs to ``runtime.image``."""
NODE_IMAGE = "node22"
NODE_SVC_SHUTDOWN = "October 5, 2026"
KEPT_CODE = "kept_code"
"""Validation context key: the codes of the code transforms a proxy already stores, which a merge
patch may keep as they are (existing resources are unaffected by the runtime image rule)."""
STORED = "stored"
"""Validation context key: true when loading stored transforms (no creation rule applies)."""


class CodeTransform(_Transform):
    """Code run by the reactor runtime; stored as given (``runtime`` as in reactors). A new one needs
    ``runtime.image`` ``node22``: an omitted runtime or image (meaning ``node-svc``) or ``node-svc``
    itself answers 400 (``node-svc`` is deprecated since October 5, 2026)."""

    type: Literal["code"]
    code: str = Field(min_length=1, max_length=MAX_CODE_LENGTH)
    runtime: dict[str, Any] | None = Field(None, validate_default=True)

    @field_validator("runtime")
    @classmethod
    def _node_image(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        context = info.context or {}
        if context.get(STORED) or info.data.get("code") in context.get(KEPT_CODE, ()):
            return value
        image = (value or {}).get("image")
        if image is None or image == "node-svc":
            raise PydanticCustomError(
                RUNTIME_IMAGE_ERROR,
                "a Node runtime image is required: node-svc is deprecated for new proxy code transforms since "
                f"{NODE_SVC_SHUTDOWN} (an omitted runtime or image means node-svc); use {NODE_IMAGE}",
            )
        if image != NODE_IMAGE:
            raise PydanticCustomError(RUNTIME_IMAGE_ERROR, f"must be {NODE_IMAGE}")
        return value


Transform = Annotated[
    TokenizeTransform
    | MaskTransform
    | AppendJsonTransform
    | AppendTextTransform
    | AppendHeaderTransform
    | CodeTransform,
    Field(discriminator="type"),
]
TransformList = Annotated[list[Transform], Field(max_length=MAX_TRANSFORMS)]
_LIST = TypeAdapter(TransformList)


def load_transforms(stored: Sequence[dict]) -> list[Any]:
    """Stored transform objects (JSON) back as models (they were validated when stored; rules for new
    transforms, such as the code transform's runtime image, do not apply)."""
    return _LIST.validate_python(list(stored), context={STORED: True})


def dump_transforms(transforms: Sequence[Any]) -> list[dict]:
    """Transform models as the JSON objects stored and shown."""
    return [t.model_dump(mode="json", exclude_none=True) for t in transforms]


# ---- the tokenize call-out ---------------------------------------------------------------------


class Tokenizer(Protocol):
    """Makes tokens for the ``tokenize`` transform."""

    def tokenize(self, requests: list[dict]) -> list[str] | Awaitable[list[str]]:
        """Create one token per token request object (``{type, data, ...}``) and return their ids,
        in order (or an awaitable of them, for a tokenizer that works off the event loop). Raises a
        problem (403 without ``token:<c>:create``, 400 for invalid data)."""
        ...


@dataclass
class DomainTokenizer:
    """:class:`Tokenizer` on :func:`domain.tokens.service.tokenize`, in the caller's session."""

    session: Session
    caller: Caller

    def tokenize(self, requests: list[dict]) -> list[str]:
        """See :meth:`Tokenizer.tokenize`."""
        if not requests:
            return []
        created = tokens.tokenize(self.session, self.caller, requests)
        return [str(token["id"]) for token in created]


# ---- applying ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """Headers (``(name, value)`` pairs) and body of a request or response, with its media type."""

    headers: list[tuple[str, str]]
    body: bytes | None
    content_type: str | None = None


CodeRunner = Callable[[CodeTransform, Message, str], Awaitable[Message]]
"""Runs a code transform: ``await runner(transform, message, side)`` with ``side`` ``"request"`` or
``"response"``; returns the transformed message, raises a ``ProxyError`` when the code fails."""


@lru_cache(maxsize=256)
def _compiled(path: str) -> jsonpath.JSONPath:
    compiled = jsonpath.compile(path)
    if not isinstance(compiled, jsonpath.JSONPath):
        raise jsonpath.JSONPathError("compound queries are not supported")
    return compiled


def _names(compiled: jsonpath.JSONPath) -> list[str | int] | None:
    """The member names and indexes of a singular path, or None when it is not one."""
    parts: list[str | int] = []
    for segment in compiled.segments:
        if type(segment) is not JSONPathChildSegment or len(segment.selectors) != 1:
            return None
        selector = segment.selectors[0]
        if type(selector) is NameSelector:
            parts.append(selector.name)
        elif type(selector) is IndexSelector:
            parts.append(selector.index)
        else:
            return None
    return parts or None


def _failed(detail: str, where: str) -> ProxyError:
    return ProxyError(400, detail, title=TRANSFORM_FAILED, errors={where: [detail]})


def _json_body(message: Message, where: str) -> Any:
    try:
        return json.loads(message.body or b"")
    except (ValueError, UnicodeDecodeError):
        raise _failed("The body is not JSON, so this transform cannot apply to it.", where) from None


def _text_body(message: Message, where: str) -> str:
    try:
        return (message.body or b"").decode("utf-8")
    except UnicodeDecodeError:
        raise _failed("The body is not UTF-8 text, so this transform cannot apply to it.", where) from None


def _encode(document: Any) -> bytes:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _set(document: Any, parts: Sequence[str | int], value: Any) -> Any:
    if not parts:
        return value
    node = document
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(node, list) or not -len(node) <= part < len(node):
                raise LookupError
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            if not isinstance(node, dict):
                raise LookupError
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
    return document


def _matches(document: Any, path: str) -> list[tuple[tuple, Any]]:
    return [(tuple(m.parts), m.obj) for m in _compiled(path).finditer(document)]


async def _tokenize(transform: TokenizeTransform, message: Message, tokenizer: Tokenizer, where: str) -> Message:
    document = _json_body(message, where)
    found = _matches(document, transform.location)
    if not found:
        return message
    ids = tokenizer.tokenize([{**copy.deepcopy(transform.token), "data": value} for _, value in found])
    if inspect.isawaitable(ids):
        ids = await ids
    for (parts, _), token_id in zip(found, ids, strict=True):
        document = _set(document, parts, token_id)
    return Message(message.headers, _encode(document), message.content_type)


def _overwrite(text: str, replacement: str) -> str:
    return (replacement * (len(text) // len(replacement) + 1))[: len(text)]


def _mask(transform: MaskTransform, message: Message, where: str) -> Message:
    if transform.matcher == "jsonpath":
        document = _json_body(message, where)
        for parts, value in _matches(document, transform.expression):
            masked = _overwrite(value, transform.replacement) if isinstance(value, str) else transform.replacement
            document = _set(document, parts, masked)
        return Message(message.headers, _encode(document), message.content_type)
    pattern = re.compile(transform.expression)
    text = _text_body(message, where)

    def replace(match: re.Match) -> str:
        if not pattern.groups:
            return _overwrite(match.group(0), transform.replacement)
        out, position = [], match.start()
        for group in range(1, pattern.groups + 1):
            start, end = match.span(group)
            if start < 0 or start < position:
                continue
            out.append(text[position:start])
            out.append(_overwrite(text[start:end], transform.replacement))
            position = end
        out.append(text[position : match.end()])
        return "".join(out)

    return Message(message.headers, pattern.sub(replace, text).encode("utf-8"), message.content_type)


def _append_json(transform: AppendJsonTransform, message: Message, where: str) -> Message:
    document = _json_body(message, where) if message.body else {}
    try:
        document = _set(document, _names(_compiled(transform.location)) or [], copy.deepcopy(transform.value))
    except LookupError:
        raise _failed(f"The body has no place for {transform.location}.", where) from None
    return Message(message.headers, _encode(document), message.content_type)


async def _apply(
    transforms: Sequence[Any], message: Message, tokenizer: Tokenizer, side: str, code_runner: CodeRunner | None
) -> Message:
    for index, transform in enumerate(transforms):
        where = f"{side}_transforms[{index}]"
        if isinstance(transform, CodeTransform):
            if code_runner is None:
                raise ProxyError(
                    503,
                    "The code transform's runtime is not available yet; retry shortly.",
                    title=TRANSFORM_INITIALIZING,
                    errors={where: ["runtime initializing"]},
                )
            message = await code_runner(transform, message, side)
        elif isinstance(transform, TokenizeTransform):
            message = await _tokenize(transform, message, tokenizer, where)
        elif isinstance(transform, MaskTransform):
            message = _mask(transform, message, where)
        elif isinstance(transform, AppendJsonTransform):
            message = _append_json(transform, message, where)
        elif isinstance(transform, AppendTextTransform):
            message = Message(
                message.headers,
                _text_body(message, where).encode("utf-8") + transform.value.encode("utf-8"),
                message.content_type,
            )
        elif isinstance(transform, AppendHeaderTransform):
            message = Message(
                [*message.headers, (transform.location, transform.value)], message.body, message.content_type
            )
    return message


async def apply_request_transforms(
    transforms: Sequence[Any], message: Message, tokenizer: Tokenizer, *, code_runner: CodeRunner | None = None
) -> Message:
    """Apply ``transforms`` (models from :func:`load_transforms`) to an outgoing request, in order.

    Returns the new :class:`Message` (the input is unchanged). A code transform is run by
    ``code_runner(transform, message, "request")``; without one it raises a 503 ``Proxy request
    transform is initializing``. Raises :class:`~domain.proxy.errors.ProxyError`: 400 ``Proxy
    transform failed`` when a transform does not fit the body (not JSON, not text, no place for a
    member); what the tokenizer or the code runner raise.
    """
    return await _apply(transforms, message, tokenizer, "request", code_runner)


async def apply_response_transforms(
    transforms: Sequence[Any],
    status: int,
    message: Message,
    tokenizer: Tokenizer,
    *,
    code_runner: CodeRunner | None = None,
) -> Message:
    """Apply response ``transforms`` to the destination's answer when ``status`` is 2xx; any other
    answer is returned unchanged. Same errors as :func:`apply_request_transforms` (the 503's title
    says ``response``); a code transform runs as ``code_runner(transform, message, "response")``."""
    if not 200 <= status < 300:
        return message
    return await _apply(transforms, message, tokenizer, "response", code_runner)
