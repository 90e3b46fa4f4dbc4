"""Shared pieces of request and response models."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

#: A resource name (application, tenant, webhook ...): 1 to 200 characters (spec section 8).
Name = Annotated[str, Field(min_length=1, max_length=200)]


class RequestModel(BaseModel):
    """Base of request bodies: unknown properties are refused (400 naming each one)."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class ResponseModel(BaseModel):
    """Base of response shapes: every answer is validated and serialised through its model
    (``app/api.py``), and a property the model does not declare is a server bug (500, logged), so
    the served shape is the documented one."""

    model_config = ConfigDict(extra="forbid")


class Audited(ResponseModel):
    """Creator and modifier fields carried by most resources."""

    created_by: uuid.UUID | None = None
    created_at: dt.datetime
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = None
