"""Tables: reactors and their invocations (core document sections 2 and 4, Reactors).

* ``reactors``: a tenant's reactor on the ``node22`` runtime. ``code``, ``runtime`` and the sealed
  ``configuration_ct`` describe the version that serves (``deployed_at`` set once a build made one);
  ``requested`` holds the pending version and a failed build's details (the spec's Requested object
  without its configuration, which is sealed apart in ``requested_configuration_ct``); ``build_job_id``
  is the build job working on it. ``configuration`` maps often hold vendor credentials: both are sealed
  under the tenant's data key (:mod:`storage.crypto`, purpose ``reactor-configuration``).
* ``reactor_runs``: one invocation (``react``, ``react-async``, or a proxy's code transform), run by
  the job ``job_id``. ``request_ct`` (what the code receives) and ``result_ct`` (its answer or the
  problem it ended in) are sealed (purpose ``reactor-run``); ``caller`` keeps who invoked it (ids and
  permission names, never a key) so the worker acts with the same rights.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, Column, ForeignKey, Index, LargeBinary, Text
from sqlmodel import Field, SQLModel

from storage.states import ReactorRunStatus, ReactorState
from storage.types import state_type
from storage.types import ts_column as _ts
from storage.types import utcnow as _created_at


class Reactor(SQLModel, table=True):
    """A reactor of a tenant; ``state`` is ``creating``, ``updating``, ``active``, ``failed`` or
    ``outdated`` (``domain.reactors.service``)."""

    __tablename__ = "reactors"
    __table_args__ = (Index("ix_reactors_list", "tenant_id", "created_at", "id"),)

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    name: str = Field(max_length=200)
    state: ReactorState = Field(sa_type=state_type())
    code: str = Field(sa_column=Column(Text, nullable=False))
    runtime: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    configuration_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    requested: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    requested_configuration_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    build_job_id: uuid.UUID | None = None
    deployed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
    created_by: uuid.UUID | None = None
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    modified_by: uuid.UUID | None = None
    modified_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))


class ReactorRun(SQLModel, table=True):
    """One invocation: ``kind`` ``react`` (the synchronous endpoint), ``async`` (``react-async``) or
    ``transform`` (a proxy's code transform, ``program`` holding its code and runtime); ``status``
    ``pending``, ``completed`` or ``failed`` (``error_status`` the HTTP status of its problem)."""

    __tablename__ = "reactor_runs"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    tenant_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True)
    )
    reactor_id: uuid.UUID | None = Field(
        default=None, sa_column=Column(ForeignKey("reactors.id", ondelete="CASCADE"), nullable=True, index=True)
    )
    kind: str = Field(max_length=16)
    program: dict | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    caller: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    job_id: uuid.UUID | None = None
    status: ReactorRunStatus = Field(default=ReactorRunStatus.PENDING, sa_type=state_type())
    request_ct: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    result_ct: bytes | None = Field(default=None, sa_column=Column(LargeBinary, nullable=True))
    error_status: int | None = None
    trace_id: str | None = Field(default=None, max_length=64)
    created_at: dt.datetime = Field(default_factory=_created_at, sa_column=_ts())
    completed_at: dt.datetime | None = Field(default=None, sa_column=_ts(nullable=True))
