"""Pre-configured proxies: create, read, list, update, merge-patch, delete, and find by key.

Core document section 4, Proxy rule 3 (the management endpoints are ours; permissions
``proxy:create``, ``proxy:read``, ``proxy:update``, ``proxy:delete``). Functions run inside the
caller's unit of work (``fn(session, caller, ...)``) and never commit. Every change and single read
writes a log row (entity type ``proxy``). The proxy key is returned once, by :func:`create_proxy`;
only its SHA-256 digest is stored. ``configuration`` is sealed under the tenant's data key.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from domain.proxy.detokenize import DETOKENIZE_RIGHTS, Detokenized, detokenize, is_whole_expression
from domain.proxy.errors import invalid_expression
from domain.proxy.models import ProxyRequest, request_errors
from domain.proxy.transforms import KEPT_CODE, CodeTransform, dump_transforms, load_transforms
from domain.proxy.values import SqlValueLoader
from domain.proxy.views import proxy_view
from domain.tenancy import audit
from domain.tenancy.auth import KeyCache, caller_cache, key_digest
from domain.tenancy.caller import Caller
from domain.tenancy.permissions import effective_permissions, require_grantable
from domain.tokens.validation import merge_patch
from infra.errors import validation_problem
from infra.lookup import get_owned
from infra.node_runtime.owners import PROXY, end_owner_after_commit
from storage.crypto import get_keyring
from storage.db import Rows, on_commit, stage_rows
from storage.models import Application, Tenant
from storage.models_proxy import Proxy
from storage.types import utcnow

ENTITY_TYPE = "proxy"
CONFIGURATION_PURPOSE = "proxy-configuration"
KEY_PREFIX = "pxk_"


def _seal(session: Session, tenant_id: uuid.UUID, proxy_id: uuid.UUID, configuration: dict[str, str]) -> bytes | None:
    if not configuration:
        return None
    plain = json.dumps(configuration, separators=(",", ":"), ensure_ascii=False).encode()
    return get_keyring().encrypt(session, tenant_id, CONFIGURATION_PURPOSE, str(proxy_id), plain)


def configuration_of(session: Session, proxy: Proxy) -> dict[str, str]:
    """The proxy's plain configuration map (empty when none)."""
    if proxy.configuration_ct is None:
        return {}
    plain = get_keyring().decrypt(
        session, proxy.tenant_id, CONFIGURATION_PURPOSE, str(proxy.id), proxy.configuration_ct
    )
    return json.loads(plain)


def _check_application(session: Session, caller: Caller, request: ProxyRequest) -> uuid.UUID | None:
    if request.application is None:
        return None
    application = session.get(Application, request.application.id)
    if application is None or application.tenant_id != caller.tenant_id:
        raise validation_problem({"application.id": ["No application of this tenant has this id."]})
    return application.id


def _check_code_grants(caller: Caller, request: ProxyRequest) -> None:
    """403 when a code transform's ``runtime.permissions`` names a permission the calling key does
    not hold (customer code gets no right its creator lacks)."""
    for side in ("request_transforms", "response_transforms"):
        for transform in getattr(request, side):
            granted = (transform.runtime or {}).get("permissions") if isinstance(transform, CodeTransform) else None
            if isinstance(granted, list):
                require_grantable(
                    caller.permissions, [str(name) for name in granted], field=side, what="a proxy's code transform"
                )


def _apply(session: Session, caller: Caller, proxy: Proxy, request: ProxyRequest) -> None:
    _check_code_grants(caller, request)
    proxy.name = request.name
    proxy.destination_url = request.destination_url
    proxy.request_transforms = dump_transforms(request.request_transforms)
    proxy.response_transforms = dump_transforms(request.response_transforms)
    proxy.configuration_ct = _seal(session, caller.tenant_id, proxy.id, request.configuration)
    proxy.require_auth = request.require_auth
    proxy.application_id = _check_application(session, caller, request)


def create_proxy(session: Session, caller: Caller, request: ProxyRequest) -> dict:
    """``POST /proxies``: store a proxy and return its object with its ``key`` (shown only here).

    403 without ``proxy:create``; 400 with ``errors["application.id"]`` for an unknown application.
    """
    caller.require("proxy:create")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    proxy = Proxy(
        tenant_id=caller.tenant_id,
        name=request.name,
        destination_url=request.destination_url,
        key_digest=key_digest(key),
        created_by=caller.application_id,
    )
    _apply(session, caller, proxy, request)
    session.add(proxy)
    session.flush()
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=proxy.id, operation="create")
    return proxy_view(proxy, configuration_of(session, proxy), key=key)


def _get(session: Session, caller: Caller, proxy_id: object, *, lock: bool = False) -> Proxy:
    return get_owned(session, Proxy, proxy_id, caller.tenant_id, what="proxy", lock=lock)


def read_proxy(session: Session, caller: Caller, proxy_id: object) -> dict:
    """``GET /proxies/{id}``: 403 without ``proxy:read``; 404 when absent or another tenant's."""
    caller.require("proxy:read")
    proxy = _get(session, caller, proxy_id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=proxy.id, operation="read")
    return proxy_view(proxy, configuration_of(session, proxy))


def list_proxies(
    session: Session, caller: Caller, *, size: int, after: dict | None = None, name: str | None = None
) -> tuple[list[dict], dict | None]:
    """``GET /proxies``: newest first, keyset on (created_at, id); ``name`` keeps proxies whose name
    contains it (case-insensitive). Returns ``(views, next position or None)``; 400 for a cursor
    this endpoint did not make; 403 without ``proxy:read``."""
    caller.require("proxy:read")
    stmt = select(Proxy).where(Proxy.tenant_id == caller.tenant_id)
    if name:
        escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        stmt = stmt.where(func.lower(Proxy.name).like(f"%{escaped.lower()}%", escape="\\"))
    if after:
        try:
            at, last = dt.datetime.fromisoformat(after["t"]), uuid.UUID(str(after["id"]))
        except (KeyError, TypeError, ValueError):
            raise validation_problem({"start": ["This is not a cursor returned by this endpoint."]}) from None
        stmt = stmt.where(or_(col(Proxy.created_at) < at, (col(Proxy.created_at) == at) & (col(Proxy.id) < last)))
    rows = session.exec(stmt.order_by(col(Proxy.created_at).desc(), col(Proxy.id).desc()).limit(size + 1)).all()
    more = len(rows) > size
    rows = rows[:size]
    following = {"t": rows[-1].created_at.isoformat(), "id": str(rows[-1].id)} if more else None
    return [proxy_view(proxy, configuration_of(session, proxy)) for proxy in rows], following


def _update(session: Session, caller: Caller, proxy: Proxy, request: ProxyRequest) -> dict:
    _apply(session, caller, proxy, request)
    on_commit(session, target_cache.clear)
    end_owner_after_commit(session, proxy.tenant_id, PROXY, proxy.id)  # its code transforms' processes
    proxy.modified_by = caller.application_id
    proxy.modified_at = utcnow()
    session.add(proxy)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=proxy.id, operation="update")
    return proxy_view(proxy, configuration_of(session, proxy))


def update_proxy(session: Session, caller: Caller, proxy_id: object, request: ProxyRequest) -> dict:
    """``PUT /proxies/{id}``: replace every field (the key stays). 403 without ``proxy:update``; 404."""
    caller.require("proxy:update")
    return _update(session, caller, _get(session, caller, proxy_id, lock=True), request)


def _stored_code(proxy: Proxy) -> frozenset[str]:
    return frozenset(
        t.get("code")
        for t in (*(proxy.request_transforms or []), *(proxy.response_transforms or []))
        if t.get("type") == "code"
    )


def patch_proxy(session: Session, caller: Caller, proxy_id: object, patch: Any) -> dict:
    """``PATCH /proxies/{id}`` with an RFC 7396 merge patch over the proxy's fields (``name``,
    ``destination_url``, transforms, ``configuration``, ``require_auth``, ``application``); the
    result is validated like a PUT body (400 with per-field errors, nothing changed), except that code
    transforms the proxy already stores are kept as they are (the runtime image rule is for new ones).
    403, 404."""
    caller.require("proxy:update")
    if not isinstance(patch, dict):
        raise validation_problem({"body": ["A merge patch must be a JSON object."]})
    proxy = _get(session, caller, proxy_id, lock=True)
    current = {
        "name": proxy.name,
        "destination_url": proxy.destination_url,
        "request_transforms": proxy.request_transforms or [],
        "response_transforms": proxy.response_transforms or [],
        "configuration": configuration_of(session, proxy),
        "require_auth": proxy.require_auth,
        "application": {"id": str(proxy.application_id)} if proxy.application_id else None,
    }
    for side in ("request", "response"):
        if patch.get(f"{side}_transform") is not None:
            current[f"{side}_transforms"] = []  # the deprecated singular form replaces the list
    merged = merge_patch({k: v for k, v in current.items() if v is not None}, patch)
    try:
        request = ProxyRequest.model_validate(merged, context={KEPT_CODE: _stored_code(proxy)})
    except ValidationError as exc:
        raise validation_problem(request_errors(exc)) from None
    return _update(session, caller, proxy, request)


def delete_proxy(session: Session, caller: Caller, proxy_id: object) -> None:
    """``DELETE /proxies/{id}``: 403 without ``proxy:delete``; 404 when absent."""
    caller.require("proxy:delete")
    proxy = _get(session, caller, proxy_id, lock=True)
    session.delete(proxy)
    on_commit(session, target_cache.clear)
    end_owner_after_commit(session, proxy.tenant_id, PROXY, proxy.id)
    audit.record(session, caller, entity_type=ENTITY_TYPE, entity_id=proxy.id, operation="delete")


@dataclass(frozen=True)
class Target:
    """A pre-configured proxy as an invocation needs it (Proxy rule 3): ``proxy_id``, ``tenant_id``,
    ``destination_url``, ``require_auth``, the transforms as models, and ``anonymous``: the caller
    acting when no API key is sent to a proxy that does not require one (the permissions of the
    proxy's ``application``; none without one). ``configuration``: the proxy's plain configuration
    map, read only when a code transform needs it (empty otherwise)."""

    proxy_id: uuid.UUID
    tenant_id: uuid.UUID
    destination_url: str
    require_auth: bool
    request_transforms: list
    response_transforms: list
    anonymous: Caller | None
    configuration: dict[str, str] = field(default_factory=dict)

    @property
    def has_code(self) -> bool:
        """True when a request or response transform is a code transform (run by the reactor runtime)."""
        return any(isinstance(t, CodeTransform) for t in (*self.request_transforms, *self.response_transforms))

    def with_trace(self, trace_id: str | None) -> Target:
        """This target for one request: its anonymous caller carries the request's ``trace_id``."""
        if self.anonymous is None:
            return self
        return replace(self, anonymous=replace(self.anonymous, trace_id=trace_id))


target_cache: KeyCache[Target] = KeyCache(Target.with_trace, cleared_with=caller_cache)
"""The process's invocation targets by proxy key digest (:func:`invocation_target`'s answers), kept
``TESSERA_AUTH_CACHE_SECONDS`` like callers: cleared when a proxy is updated or deleted in this
process, and with the callers when keys, applications or tenants change here; a change made by another
process is seen within the TTL."""


def invocation_target(session: Session, key: str, *, trace_id: str | None = None) -> Target | None:
    """The proxy whose key is ``key`` ready to be invoked, or None when no proxy of a live tenant has
    it. ``anonymous`` is set only when the proxy does not require authentication."""
    proxy = find_by_key(session, key)
    if proxy is None:
        return None
    tenant = session.get(Tenant, proxy.tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        return None
    anonymous = None
    if not proxy.require_auth:
        application = session.get(Application, proxy.application_id) if proxy.application_id else None
        if application is not None and application.tenant_id != tenant.id:
            application = None
        anonymous = Caller(
            tenant_id=tenant.id,
            tenant_type=tenant.type,
            application_id=application.id if application else None,
            application_type=application.type if application else None,
            permissions=effective_permissions(application.permissions) if application else frozenset(),
            tenant_settings=dict(tenant.settings or {}),
            trace_id=trace_id,
            actor_type="application" if application else "anonymous",
        )
    target = Target(
        proxy.id,
        proxy.tenant_id,
        proxy.destination_url,
        proxy.require_auth,
        load_transforms(proxy.request_transforms or []),
        load_transforms(proxy.response_transforms or []),
        anonymous,
    )
    if target.has_code:
        target = replace(target, configuration=configuration_of(session, proxy))
    return target


EPHEMERAL = "ephemeral"
"""The log's ``entity_id`` of an ephemeral proxy invocation (a pre-configured one logs its id)."""


def prepare_invocation(
    session: Session,
    caller: Caller,
    proxy_id: uuid.UUID | None,
    *,
    headers: list[tuple[str, str]],
    body: bytes | None,
    content_type: str | None,
    encrypted_header: str | None,
) -> Detokenized:
    r"""Detokenize an outgoing request and log the invocation, in one unit of work.

    Returns :func:`~domain.proxy.detokenize.detokenize`'s result and raises its ``ProxyError``\ s
    (nothing is written then). Writes, in one statement (:func:`storage.db.stage_rows`, shared with
    the units of work of its group), the log row (entity type ``proxy``, ``entity_id`` the proxy's
    id or :data:`EPHEMERAL`, operation ``invoke``; never the body) and the usage of the detokenized
    tokens (counted as used this month).
    """
    rows = Rows()
    detokenized = detokenize(
        caller,
        SqlValueLoader(session, rows=rows),
        headers=headers,
        body=body,
        content_type=content_type,
        encrypted_header=encrypted_header,
    )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=proxy_id or EPHEMERAL, operation="invoke")
    stage_rows(session, rows)
    return detokenized


DETOKENIZE = "detokenize"
"""The ``entity_id`` of ``POST /detokenize``'s log rows (entity type ``proxy``, operation ``invoke``)."""


def _json_text(value: Any) -> str:
    """``value`` as JSON text, except that a string which is one whole expression is written bare
    (outside quotes), so its value takes its own JSON type (an object, a number) in the answer."""
    if isinstance(value, str):
        return value.strip() if is_whole_expression(value) else json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{_json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(item) for item in value) + "]"
    return json.dumps(value)


def detokenize_document(session: Session, caller: Caller, document: Any) -> Any:
    """``POST /detokenize``: ``document`` (any JSON) with every token expression in its strings
    replaced by the token data, by the proxy's expression engine and limits
    (:data:`~domain.proxy.detokenize.DETOKENIZE_RIGHTS`: ``{{ <id> }}``, ``{{ <id> | json: '$.number' }}``,
    ``{{ token: <id> | ... }}``; at most 20 distinct tokens; each token's use right
    ``token:<classification>:use:proxy`` and its plain read right). A string that is one whole
    expression becomes the value itself (an object, a number ...); an expression inside a longer
    string is written as text. Logged like a proxy invocation (entity ``proxy``, id
    :data:`DETOKENIZE`, operation ``invoke``) and the tokens counted as used this month, in one
    statement with the group's rows. Raises the engine's ``ProxyError`` problems (nothing written)."""
    rows = Rows()
    detokenized = detokenize(
        caller,
        SqlValueLoader(session, rows=rows),
        headers=(),
        body=_json_text(document).encode("utf-8"),
        content_type="application/json",
        rights=DETOKENIZE_RIGHTS,
    )
    audit.stage(rows, caller, entity_type=ENTITY_TYPE, entity_id=DETOKENIZE, operation="invoke")
    try:
        answer = json.loads(detokenized.body or b"null")
    except ValueError:  # an expression that rendered no JSON value where a whole value stood
        raise invalid_expression("The document's expressions did not render to JSON.", where="body") from None
    stage_rows(session, rows)
    return answer


def find_by_key(session: Session, key: str) -> Proxy | None:
    """The proxy whose key is ``key`` (``<prefix>-PROXY-KEY`` or the ``<prefix>-proxy-key`` query
    parameter, Proxy rule 3), of any tenant; None when no proxy has it."""
    if not key or len(key) > 256:
        return None
    return session.exec(select(Proxy).where(Proxy.key_digest == key_digest(key))).first()
