"""The two pagination forms of the spec (core document: Pagination objects; section 8 limits).

* Offset: query ``page`` (default 1) and ``size`` (default 20, max 100 unless the endpoint says
  less); answer ``{"pagination": {total_items, page_number, page_size, total_pages}, "data": [...]}``.
* Cursor: query ``size`` (default 20, max 100) and ``start`` (an opaque cursor from
  ``pagination.next``); answer ``{"pagination": {page_size, next?}, "data": [...]}``; the last page
  has no ``next``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from infra.errors import validation_problem

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


def cursor_page(data: list, *, size: int, next_position: dict | None) -> dict:
    """The cursor pagination object; ``next_position`` is encoded into ``pagination.next``."""
    pagination: dict[str, Any] = {"page_size": size}
    if next_position is not None:
        pagination["next"] = encode_cursor(next_position)
    return {"pagination": pagination, "data": data}


def encode_cursor(position: dict) -> str:
    """An opaque cursor for a keyset position."""
    return base64.urlsafe_b64encode(json.dumps(position, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, keys: tuple[str, ...]) -> dict | None:
    """The keyset position in ``cursor`` (None for no cursor); 400 when it is not one of ours."""
    if not cursor:
        return None
    try:
        position = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, UnicodeDecodeError):
        position = None
    if not isinstance(position, dict) or set(position) != set(keys):
        raise validation_problem({"start": ["This is not a cursor returned by this endpoint."]})
    return position
