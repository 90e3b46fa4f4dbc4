"""The two pagination forms of the spec (core document: Pagination objects; section 8 limits).

* Offset: query ``page`` (default 1) and ``size`` (default 20, max 100 unless the endpoint says
  less); answer ``{"pagination": {total_items, page_number, page_size, total_pages}, "data": [...]}``.
* Cursor: query ``size`` (default 20, max 100) and ``start`` (an opaque cursor from
  ``pagination.next``); answer ``{"pagination": {page_size, next?}, "data": [...]}``; the last page
  has no ``next``. Cursors are keyset positions (``storage/keyset.py``) signed for the tenant and
  the route: a forged, altered or foreign cursor answers 400 naming ``start``.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model

from app.api import Call
from app.schemas import ResponseModel
from infra.errors import validation_problem
from storage.crypto import get_keyring

Item = TypeVar("Item")

#: The highest page number accepted: (page - 1) * size must stay far inside a SQL bigint OFFSET.
MAX_PAGE = 2**31 - 1


class _Query(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def offset_query(max_size: int = 100, **extra_fields: Any) -> type[BaseModel]:
    """A query model with ``page`` and ``size`` (1..max_size) plus ``extra_fields``."""
    return create_model(
        f"OffsetQuery{max_size}",
        __base__=_Query,
        page=(int, Field(1, ge=1, le=MAX_PAGE, description=f"Page number, 1 to {MAX_PAGE}.")),
        size=(int, Field(20, ge=1, le=max_size, description=f"Items per page, 1 to {max_size}.")),
        **extra_fields,
    )


def cursor_query(max_size: int = 100, **extra_fields: Any) -> type[BaseModel]:
    """A query model with ``size`` (1..max_size) and ``start`` plus ``extra_fields``."""
    return create_model(
        f"CursorQuery{max_size}",
        __base__=_Query,
        size=(int, Field(20, ge=1, le=max_size, description=f"Items per page, 1 to {max_size}.")),
        start=(str | None, Field(None, description="The cursor from pagination.next.")),
        **extra_fields,
    )


def offset_page(data: list, *, total: int, page: int, size: int) -> dict:
    """The offset pagination object."""
    return {
        "pagination": {
            "total_items": total,
            "page_number": page,
            "page_size": size,
            "total_pages": (total + size - 1) // size,
        },
        "data": data,
    }


class CursorPagination(ResponseModel):
    """The cursor form's pagination object."""

    page_size: int = Field(description="The requested size.")
    next: str | None = Field(None, description="The cursor of the next page, for `start`; absent on the last page.")


class CursorPage(ResponseModel, Generic[Item]):
    """One page of a cursor list."""

    pagination: CursorPagination
    data: list[Item]


class OffsetPagination(ResponseModel):
    """The offset form's pagination object."""

    total_items: int
    page_number: int
    page_size: int
    total_pages: int


class OffsetPage(ResponseModel, Generic[Item]):
    """One page of an offset list."""

    pagination: OffsetPagination
    data: list[Item]


def cursor_page(call: Call, data: list, *, size: int, next_position: dict | None) -> dict:
    """The cursor pagination object; ``next_position`` is signed into ``pagination.next`` for this
    caller's tenant and this route (see :func:`encode_cursor`)."""
    pagination: dict[str, Any] = {"page_size": size}
    if next_position is not None:
        pagination["next"] = encode_cursor(_scope(call), next_position)
    return {"pagination": pagination, "data": data}


#: Cursors are signed with a key derived from the master key material (``storage/crypto.py``).
_CURSOR_KEY_INFO = b"tessera cursor v1"
_MAC_BYTES = 16
_MAX_CURSOR = 1024
_FORGED = "This is not a cursor returned by this endpoint for this tenant; start from the first page."


def _scope(call: Call) -> bytes:
    """What a cursor is bound to: the tenant and the route (method and path template)."""
    route = call.request.match_info.route
    tenant = call.caller.tenant_id if call.caller is not None else ""
    return f"{tenant} {route.method} {route.resource.canonical if route.resource else ''}".encode()


def _mac(scope: bytes, payload: bytes) -> bytes:
    key = get_keyring().platform_key(_CURSOR_KEY_INFO)
    return hmac.new(key, scope + b"\n" + payload, hashlib.sha256).digest()[:_MAC_BYTES]


def _b64(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_cursor(scope: bytes, position: dict) -> str:
    """An opaque cursor for a keyset position ``{"t", "id"}`` (``storage/keyset.py``):
    ``base64url(JSON position) "." base64url(HMAC-SHA256(key, scope, payload)[:16])``. The
    position is readable but not choosable: a changed byte, another tenant's or another list's
    cursor fails :func:`decode_cursor`."""
    payload = _b64(json.dumps(position, separators=(",", ":")).encode())
    return (payload + b"." + _b64(_mac(scope, payload))).decode()


def decode_cursor(call: Call, cursor: str | None) -> dict | None:
    """The keyset position in ``cursor`` (None for no cursor); a 400 problem (``errors.start``) for a
    cursor this endpoint did not give this tenant: forged, altered, truncated or from elsewhere."""
    if not cursor:
        return None
    payload, _, mac = cursor.partition(".")
    try:
        valid = (
            len(cursor) <= _MAX_CURSOR
            and cursor.isascii()
            and hmac.compare_digest(_unb64(mac), _mac(_scope(call), payload.encode()))
        )
        position = json.loads(_unb64(payload)) if valid else None
        if not (
            isinstance(position, dict)
            and set(position) == {"t", "id"}
            and isinstance(position["t"], str)
            and isinstance(position["id"], str)
        ):
            raise ValueError
        dt.datetime.fromisoformat(position["t"])
    except ValueError:  # binascii.Error and JSONDecodeError are ValueErrors
        raise validation_problem({"start": [_FORGED]}) from None
    return position
