"""Request bodies of the pre-configured proxy endpoints (``POST /proxies``, ``PUT /proxies/{id}``,
``PATCH /proxies/{id}`` as a JSON merge patch): ours to design (the core document shows none), in
the API's style.

Fields: ``name`` (1-200 characters), ``destination_url`` (HTTPS, a DNS host: Proxy rule 5),
``request_transforms`` / ``response_transforms`` (:mod:`domain.proxy.transforms`, default []),
``configuration`` (map of string to string, sealed at rest), ``require_auth`` (default true),
``application`` (``{"id": <uuid>}``: the application whose permissions apply to callers without a
key). Deprecated since October 8, 2025 and still accepted: ``request_transform`` /
``response_transform`` (one transform; mapped to a one-item list, refused together with the list
form; the older ``{"code": ...}`` without ``type`` is read as a code transform, so it meets the
runtime image rule like any new code transform). Shut down on March 31, 2023 and refused (400):
``request_reactor_id`` / ``response_reactor_id``.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from domain.proxy.errors import ProxyError
from domain.proxy.rules import check_destination_base
from domain.proxy.transforms import RUNTIME_IMAGE_ERROR, Transform, TransformList
from infra.errors import validation_errors

REACTOR_IDS_SHUTDOWN = "March 31, 2023"
_SINGULAR = ("request_transform", "response_transform")
MAX_CONFIGURATION_ENTRIES = 100


class ApplicationRef(BaseModel):
    """``{"id": <uuid>}`` of an application of the tenant."""

    model_config = ConfigDict(extra="forbid")
    id: uuid.UUID


class ProxyRequest(BaseModel):
    """The body of ``POST /proxies`` and ``PUT /proxies/{id}`` (a PUT replaces every field)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    destination_url: str = Field(max_length=2048)
    request_transforms: TransformList = Field(default_factory=list)
    response_transforms: TransformList = Field(default_factory=list)
    request_transform: Transform | None = Field(default=None, deprecated="use request_transforms")
    response_transform: Transform | None = Field(default=None, deprecated="use response_transforms")
    configuration: dict[str, str] = Field(default_factory=dict, max_length=MAX_CONFIGURATION_ENTRIES)
    require_auth: bool = True
    application: ApplicationRef | None = None
    request_reactor_id: Any = None
    response_reactor_id: Any = None

    @model_validator(mode="before")
    @classmethod
    def _untyped_code(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for side in _SINGULAR:
            single = data.get(side)
            if isinstance(single, dict) and "type" not in single and "code" in single:
                data = {**data, side: {"type": "code", **single}}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    @field_validator("destination_url")
    @classmethod
    def _destination(cls, value: str) -> str:
        try:
            return check_destination_base(value)
        except ProxyError as err:
            raise ValueError(err.detail) from None

    @field_validator("request_reactor_id", "response_reactor_id")
    @classmethod
    def _shut_down(cls, value: Any, info) -> Any:
        if value is not None:
            side = info.field_name.split("_")[0]
            raise ValueError(f"was shut down on {REACTOR_IDS_SHUTDOWN}; use {side}_transforms")
        return value

    @model_validator(mode="after")
    def _singular_forms(self) -> ProxyRequest:
        for side in ("request", "response"):
            single = self.__dict__[f"{side}_transform"]  # read without the deprecation warning
            if single is None:
                continue
            if getattr(self, f"{side}_transforms"):
                raise ValueError(f"send {side}_transforms or the deprecated {side}_transform, not both")
            self.__dict__[f"{side}_transforms"] = [single]
            self.__dict__[f"{side}_transform"] = None
        return self


#: The tags of the transform union, which pydantic puts in an error's location (see
#: :func:`infra.errors.validation_errors`).
TRANSFORM_TAGS = frozenset({"tokenize", "mask", "append_json", "append_text", "append_header", "code"})
#: The runtime image rule of a code transform is checked on the whole transform; its error belongs to
#: ``runtime.image`` (see :func:`infra.errors.validation_errors`).
TRANSFORM_SUFFIXES = {RUNTIME_IMAGE_ERROR: ".image"}


def request_errors(exc: ValidationError) -> dict[str, list[str]]:
    """A proxy body's validation error as the problem's ``errors`` map (the one converter,
    :func:`infra.errors.validation_errors`, told the transforms' union tags and the image rule)."""
    return validation_errors(exc, union_tags=TRANSFORM_TAGS, suffixes=TRANSFORM_SUFFIXES)
