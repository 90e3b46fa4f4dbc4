"""Identifier helpers."""

from __future__ import annotations

import uuid


def parse_uuid(value: object) -> uuid.UUID | None:
    """``value`` as a UUID (a UUID or its text form); None when it is not one."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None
