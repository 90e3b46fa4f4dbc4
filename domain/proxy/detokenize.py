"""Detokenization: the ``{{ ... }}`` expressions of a proxied request (core document section 4,
Proxy rules 1, 7 and 8; section 8: 20 tokens per request).

Forms (each a python-liquid expression of :mod:`domain.tokens.expressions`, its one environment and
filters; the head names the value, the filters after it work on that value):

* ``{{ <token_id> }}``, ``{{ <token_id> | json: "$.number" }}``: the token's data;
* ``{{ token: <id> | json: "$.data.number" }}``: the token object (``id, type, data, metadata,
  containers ...``);
* ``{{ network_token: <id> | json: "$.data.number" }}``: the network token object with its number
  (DPAN) complete; cryptograms and ECI values are not part of it and are never generated here;
* ``{{ token_intent: <id> | json: "$.data.number" }}``: the token intent object;
* ``{{ wallet-a: <id> | json: "$.data.number" }}``, ``{{ wallet-b: <id> | ... }}``: the wallet token
  resource, complete (spec 001 sections 2 and 9); reading it uses up its cryptogram;
* ``{{ encrypted | json: "$.data.number" }}`` and ``{{ encrypted | json: "$.<name>.data.<field>" }}``:
  the decrypted ``<prefix>-ENCRYPTED`` payload, single and multiple forms.

A comma where a filter's pipe belongs is read as the pipe (``{{ id, json: "$.number", last4 }}``), by
the expression engine's one rule for it.
A bare head is always a token id (aliases included); the words ``token``, ``network_token``,
``token_intent`` followed by ``:`` and the word ``encrypted`` are reserved.

Order of checks, before any value is rendered: the expressions parse (400), the caller holds
``proxy:invoke`` (403), at most :data:`MAX_TOKENS` distinct ids (400), every id exists in the tenant
(400 naming the unknown ids), and the caller may use each value: ``token:<classification>:use:proxy``
for the token's containers (the legacy ``token:use`` is already mapped to
``token:general:use:proxy``), the ``pci`` right for a token intent (403). All errors are
``proxy_error`` (:mod:`domain.proxy.errors`); no detokenized value ever reaches an error message.

What is asked of the caller is a :class:`Rights`: :data:`PROXY_RIGHTS` for a proxied request,
:data:`DETOKENIZE_RIGHTS` for ``POST /detokenize`` (token values only, where the caller must also
read each token's data plainly, since the values are answered to it).

Placement, by where the expression stands:

* JSON body: inside a JSON string the text is escaped as JSON string content; outside a string (a
  whole value) the value is written as JSON, so ``{{ id | json: "$.exp_month" | to_number }}`` gives a
  number and ``{{ id }}`` of an object gives an object. Inside a string the expression itself is read
  with JSON escapes undone (``\\"$.number\\"``), or as it stands when it is not valid JSON string
  text (bare ``"$.number"``: quotes inside an expression never end the JSON string).
* form body (``application/x-www-form-urlencoded``): values are percent-decoded, rendered and encoded
  again; pairs without expressions are left byte for byte.
* XML body: the text is XML-escaped. Other text bodies and headers: the text as it is (a header
  value may not become a line break).

A body that is not UTF-8 or holds no ``{{`` (``%7B%7B`` in a form) is sent unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote_plus, unquote_plus
from xml.sax.saxutils import escape as xml_escape

from domain.proxy.errors import ProxyError, invalid_expression, invalid_request, missing_right
from domain.proxy.values import KINDS, NETWORK_TOKEN, TOKEN, TOKEN_INTENT, WALLET_A, WALLET_B, Loaded, ValueLoader
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import IMPACT_LEVELS, TYPE_CLASSIFICATION, parse_container, read_level
from domain.tokens.access import container_placement
from domain.tokens.errors import ExpressionError
from domain.tokens.expressions import evaluate, validate_expression
from domain.tokens.filters import stringify_filter
from infra.errors import Problem

MAX_TOKENS = 20
"""Most distinct ids one request may detokenize (core document section 8)."""
INVOKE = "proxy:invoke"
ENCRYPTED = "encrypted"
VALUE = "value"

# Linear scan: no '{' inside an expression (outside quotes), so a run of braces fails at once.
_EXPRESSION = re.compile(r"""\{\{((?:[^{}"']|"[^"]{0,4096}"|'[^']{0,4096}'|\}(?!\}))*)\}\}""")
_HEAD = re.compile(
    r"""\s*(?:(?P<kind>token_intent|network_token|token|wallet-a|wallet-b)\s*:\s*(?P<kid>[^\s|,]+)"""
    r"""|(?P<enc>encrypted)(?=[\s|,]|\Z)"""
    r"""|(?P<id>[^\s|,]+))(?P<rest>.*)\Z""",
    re.DOTALL,
)
_JSON_QUOTE = re.compile(r'\\.|"', re.DOTALL)  # an escape pair (skipped) or a quote
_TOKEN_ID = re.compile(r"[A-Za-z0-9\-_.:]{1,400}")


@dataclass(frozen=True)
class Ref:
    """One id an expression reads: ``kind`` (:data:`~domain.proxy.values.KINDS`) and ``id``."""

    kind: str
    id: str


@dataclass(frozen=True)
class Expression:
    """A parsed ``{{ ... }}``: ``ref`` (None for ``encrypted``), whether the bare form reads the
    token's data (``bare``), and ``source``, the Liquid expression over the variable ``value``."""

    ref: Ref | None
    bare: bool
    source: str


def is_whole_expression(text: str) -> bool:
    """Whether ``text`` (surrounding whitespace aside) is exactly one ``{{ ... }}`` expression."""
    return _EXPRESSION.fullmatch(text.strip()) is not None


def parse_expression(inner: str, *, where: str) -> Expression:
    """Parse the text between ``{{`` and ``}}``; raises a 400 ``proxy_error`` naming ``where``."""
    match = _HEAD.match(inner)
    if match is None:
        raise invalid_expression("An expression must name a token id or a value.", where=where)
    rest = match.group("rest").strip()
    if rest and rest[0] not in "|,":
        raise invalid_expression("Expected a filter ('| name') after the value.", where=where)
    if match.group("enc"):
        ref, bare = None, False
    elif match.group("kind"):
        ref, bare = Ref(match.group("kind"), match.group("kid")), False
    else:
        ref, bare = Ref(TOKEN, match.group("id")), True
    if ref is not None:
        if not _TOKEN_ID.fullmatch(ref.id):
            raise invalid_expression("A token id holds characters that are not allowed.", where=where)
        if ref.kind != TOKEN:
            try:
                uuid.UUID(ref.id)
            except ValueError:
                raise invalid_expression(f"A {ref.kind} id must be a UUID.", where=where) from None
    # a comma standing for a pipe (after the value or among filters) is read by the expression engine
    source = "{{ " + VALUE + (" " + rest if rest else "") + " }}"
    try:
        validate_expression(source)
    except ExpressionError as err:
        raise invalid_expression(str(err), where=where) from None
    return Expression(ref, bare, source)


# ---- finding expressions in the parts of a request ---------------------------------------------


@dataclass
class _Site:
    """One expression found in one part: its span in the part's text and how to write its value."""

    start: int
    end: int
    expression: Expression
    in_json_string: bool = False


def _json_sites(text: str, where: str) -> list[_Site]:
    """Expressions of a JSON text, each told whether it stands inside a JSON string."""
    sites = []
    position, in_string = 0, False
    for match in _EXPRESSION.finditer(text):
        for quote in _JSON_QUOTE.finditer(text, position, match.start()):
            if quote.group() == '"':
                in_string = not in_string
        inner = match.group(1)
        if in_string:
            try:
                inner = json.loads(f'"{inner}"')
            except ValueError:
                pass  # written with bare quotes ("$.number"): read as it stands
        sites.append(_Site(match.start(), match.end(), parse_expression(inner, where=where), in_string))
        position = match.end()
    return sites


def _text_sites(text: str, where: str) -> list[_Site]:
    return [_Site(m.start(), m.end(), parse_expression(m.group(1), where=where)) for m in _EXPRESSION.finditer(text)]


class _Part:
    """A part of the request holding expressions: the body (by content type) or one header."""

    def __init__(self, text: str, kind: str, where: str):
        self.text, self.kind, self.where = text, kind, where
        self.form_pairs: list[tuple[str, list[_Site] | None, str]] = []
        if kind == "json":
            self.sites = _json_sites(text, where)
        elif kind == "form":
            self.sites = []
            for pair in text.split("&"):
                name, sep, raw = pair.partition("=")
                decoded = unquote_plus(raw)
                found = _text_sites(decoded, where) if "{{" in decoded else None
                self.form_pairs.append((name + sep, found, decoded if found else raw))
                self.sites += found or []
        else:
            self.sites = _text_sites(text, where)

    def render(self, values: Mapping[int, Any]) -> str:
        """The part with every expression replaced; ``values`` maps ``id(site)`` to its value."""
        if self.kind == "form":
            return "&".join(
                head + (quote_plus(_splice(raw, sites, values, self._text_of)) if sites else raw)
                for head, sites, raw in self.form_pairs
            )
        return _splice(self.text, self.sites, values, self._write)

    def _text_of(self, site: _Site, value: Any) -> str:
        return _as_text(value)

    def _write(self, site: _Site, value: Any) -> str:
        if self.kind == "json":
            if site.in_json_string:
                return json.dumps(_as_text(value), ensure_ascii=False)[1:-1]
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        if self.kind == "xml":
            return xml_escape(_as_text(value), {'"': "&quot;", "'": "&apos;"})
        text = _as_text(value)
        if self.kind == "header" and any(ch in text for ch in "\r\n\0"):
            raise invalid_expression("An expression in a header produced a line break or NUL.", where=self.where)
        return text


def _splice(text: str, sites: Sequence[_Site], values: Mapping[int, Any], write) -> str:
    out, position = [], 0
    for site in sites:
        out.append(text[position : site.start])
        out.append(write(site, values[id(site)]))
        position = site.end
    out.append(text[position:])
    return "".join(out)


def _json_value(value: Any) -> Any:
    """An evaluated value as plain JSON data (what Liquid may return besides: tuples, ranges, its
    own null objects); raises ExpressionError for anything that is not JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float) and value == value and value not in (float("inf"), float("-inf")):
        return value
    try:
        return json.loads(stringify_filter(value))
    except Exception:  # noqa: BLE001 - Liquid raises its own error types; the message is fixed
        raise ExpressionError("The expression's value cannot be written as JSON.") from None


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return stringify_filter(value)


def body_kind(content_type: str | None) -> str:
    """How expressions in a body are written: ``json``, ``form``, ``xml`` or ``text``, from the
    media type of ``Content-Type`` (``application/json``, ``*+json``; ``...x-www-form-urlencoded``;
    ``*/xml``, ``*+xml``; anything else is text)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media.endswith("/json") or media.endswith("+json"):
        return "json"
    if media == "application/x-www-form-urlencoded":
        return "form"
    if media.endswith("/xml") or media.endswith("+xml"):
        return "xml"
    return "text"


# ---- resolving and rendering -------------------------------------------------------------------


@dataclass(frozen=True)
class Rights:
    """What a detokenization asks of its caller: ``invoke``, the permission any expression needs
    (None: none beyond the per-value ones); ``kinds``, the kinds of value expressions may read
    (``encrypted`` among them for the ``<prefix>-ENCRYPTED`` payload); ``plain_read``, whether each
    token's data must also be readable plainly by the caller (``token:<classification>:read:<level>``
    at or above the token's impact level)."""

    invoke: str | None
    kinds: frozenset[str]
    plain_read: bool = False


PROXY_RIGHTS = Rights(INVOKE, frozenset((*KINDS, ENCRYPTED)))
"""A proxied request: ``proxy:invoke`` and the use right of each value, every kind of value."""
DETOKENIZE_RIGHTS = Rights(None, frozenset({TOKEN}), plain_read=True)
"""``POST /detokenize``: token values only, each needing its use right and its plain read right."""


@dataclass(frozen=True)
class Detokenized:
    """The request after detokenization: ``headers`` (pairs, in order), ``body`` (bytes or None),
    ``refs`` (the distinct ids read, for the invocation's log row; never their values)."""

    headers: list[tuple[str, str]]
    body: bytes | None
    refs: tuple[Ref, ...]


def required_permission(loaded: Loaded) -> str | None:
    """The right needed beyond ``proxy:invoke`` to use ``loaded`` (core document section 5):
    ``token:<classification>:use:proxy`` of its containers (the type's default classification
    without containers); None for a network token."""
    if loaded.kind in (NETWORK_TOKEN, WALLET_A, WALLET_B):  # wallets: proxy:invoke only (spec 001 section 9)
        return None
    parsed = [parse_container(c) for c in loaded.containers]
    classifications = [p[0] for p in parsed if p is not None]
    if classifications:
        classification = classifications[0]
    else:
        kind = loaded.record.get("type") if isinstance(loaded.record, dict) else None
        classification = TYPE_CLASSIFICATION.get(str(kind), "general")
    return f"token:{classification}:use:proxy"


def _leaves(value: Any, out: set[str]) -> set[str]:
    if isinstance(value, Mapping):
        for item in value.values():
            _leaves(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _leaves(item, out)
    elif value is not None and not isinstance(value, bool):
        text = str(value)
        if len(text) >= 3:
            out.add(text)
    return out


def _scrub(message: str, secrets: set[str]) -> str:
    """``message`` unless it quotes a value being detokenized; then a fixed message."""
    if any(secret in message for secret in secrets):
        return "The expression could not be rendered with this value."
    return message


def detokenize(
    caller: Caller,
    loader: ValueLoader,
    *,
    headers: Iterable[tuple[str, str]],
    body: bytes | None,
    content_type: str | None,
    encrypted_header: str | None = None,
    rights: Rights = PROXY_RIGHTS,
) -> Detokenized:
    """Replace the expressions of a request's body and headers by the values they read.

    ``headers`` are the ``(name, value)`` pairs to forward (already filtered by
    :func:`domain.proxy.rules.forward_headers`); ``body`` the raw body; ``content_type`` its media
    type; ``encrypted_header`` the ``<prefix>-ENCRYPTED`` value, opened only when an expression reads
    ``encrypted``. Returns the rewritten headers and body (a body without expressions is returned as
    the same bytes, and nothing is loaded). Raises :class:`~domain.proxy.errors.ProxyError`: 400 for
    a malformed expression, more than :data:`MAX_TOKENS` distinct ids, unknown ids, a missing or
    unreadable encrypted payload, a render failure, a kind of value ``rights`` does not allow; 403
    without ``rights.invoke`` (``proxy:invoke``), a use right or (``rights.plain_read``) a read right.
    """
    header_list = list(headers)
    parts: list[tuple[str, int | None, _Part]] = []  # (target, header index, part)
    for index, (name, value) in enumerate(header_list):
        if "{{" in value:
            parts.append(("header", index, _Part(value, "header", f"headers.{name}")))
    kind = body_kind(content_type)
    if body and (b"{{" in body or (kind == "form" and b"%7b%7b" in body.lower())):
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None:
            parts.append(("body", None, _Part(text, kind, "body")))
    sites = [(part, site) for _, _, part in parts for site in part.sites]
    if not sites:
        return Detokenized(header_list, body, ())
    if rights.invoke is not None and not caller.has(rights.invoke):
        raise missing_right(rights.invoke, where=sites[0][0].where)
    for part, site in sites:
        kind = ENCRYPTED if site.expression.ref is None else site.expression.ref.kind
        if kind not in rights.kinds:
            raise invalid_expression(f"Only token values can be read here ({kind} cannot).", where=part.where)
    refs = tuple(dict.fromkeys(site.expression.ref for _, site in sites if site.expression.ref is not None))
    if len(refs) > MAX_TOKENS:
        raise invalid_request(
            f"A request may detokenize at most {MAX_TOKENS} tokens; this one names {len(refs)}.", where="body"
        )
    where: dict[Ref, str] = {}
    for part, site in sites:
        if site.expression.ref is not None:
            where.setdefault(site.expression.ref, part.where)
    loaded = _load(caller, loader, refs, where, rights)
    encrypted = None
    if any(site.expression.ref is None for _, site in sites):
        encrypted = _open_encrypted(caller, loader, encrypted_header)
    secrets: set[str] = set()
    for item in loaded.values():
        _leaves(item.record, secrets)
    if encrypted is not None:
        _leaves(encrypted, secrets)
    values: dict[int, Any] = {}
    for part, site in sites:
        expression = site.expression
        read: Any
        if expression.ref is None:
            read = encrypted
        else:
            item = loaded[expression.ref]
            read = item.data if expression.bare else item.record
        try:
            values[id(site)] = _json_value(evaluate(expression.source, {VALUE: read}))
        except ExpressionError as err:
            raise invalid_expression(_scrub(str(err), secrets), where=part.where) from None
    new_headers = list(header_list)
    new_body = body
    for target, header_index, part in parts:
        rendered = part.render(values)
        if target == "header":
            assert header_index is not None  # a header part always carries its index
            new_headers[header_index] = (header_list[header_index][0], rendered)
        else:
            new_body = rendered.encode("utf-8")
    return Detokenized(new_headers, new_body, refs)


def _load(
    caller: Caller, loader: ValueLoader, refs: Sequence[Ref], where: Mapping[Ref, str], rights: Rights
) -> dict[Ref, Loaded]:
    loaded: dict[Ref, Loaded] = {}
    unknown: list[Ref] = []
    for kind in KINDS:
        ids = [ref.id for ref in refs if ref.kind == kind]
        if not ids:
            continue
        found = loader.load(caller.tenant_id, kind, ids)
        for token_id in ids:
            if token_id in found:
                loaded[Ref(kind, token_id)] = found[token_id]
            else:
                unknown.append(Ref(kind, token_id))
    if unknown:
        names = ", ".join(ref.id if ref.kind == TOKEN else f"{ref.kind}: {ref.id}" for ref in unknown)
        raise invalid_expression(f"Unknown id(s): {names}.", where=where[unknown[0]])
    for ref in refs:
        item = loaded[ref]
        if not item.usable:
            reason = item.reason or "The value cannot be used."
            raise ProxyError(422, reason, title="Value not usable", errors={where[ref]: [reason]})
        permission = required_permission(item)
        if permission is not None and not caller.has(permission):
            raise missing_right(permission, where=where[ref])
        if rights.plain_read and item.kind == TOKEN:
            classification, rank = container_placement(item.containers, item.record.get("type"))
            if read_level(caller.permissions, classification) < rank:
                raise missing_right(f"token:{classification}:read:{IMPACT_LEVELS[rank]}", where=where[ref])
            if isinstance(item.data, dict) and "cvc" in item.data:  # answered to the caller: never a cvc
                data = {key: value for key, value in item.data.items() if key != "cvc"}
                loaded[ref] = replace(item, data=data, record={**item.record, "data": data})
    return loaded


def _open_encrypted(caller: Caller, loader: ValueLoader, header_value: str | None) -> dict:
    if not header_value:
        raise invalid_expression("An expression reads 'encrypted' but no encrypted header was sent.", where="encrypted")
    try:
        return loader.open_encrypted(caller.tenant_id, header_value)
    except ProxyError:
        raise
    except Problem as problem:
        raise ProxyError(
            problem.status, problem.detail or problem.title, title=problem.title, errors=problem.errors
        ) from None


__all__ = [
    "DETOKENIZE_RIGHTS",
    "ENCRYPTED",
    "KINDS",
    "MAX_TOKENS",
    "NETWORK_TOKEN",
    "PROXY_RIGHTS",
    "TOKEN",
    "TOKEN_INTENT",
    "Detokenized",
    "Expression",
    "Ref",
    "Rights",
    "body_kind",
    "detokenize",
    "is_whole_expression",
    "parse_expression",
    "required_permission",
]
