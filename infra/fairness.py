"""Fair choice of the next job of a kind between tenants, for work that holds a slot for long
(customer code runs: up to 30 s each).

A message of such a kind is a *token*, not an order: the worker thread that takes it leases the
job :func:`fair_next` picks among every takeable job of the kind, and when that job is done it picks
again, until nothing eligible is left. So a tenant's burst queued ahead of another tenant's request
in the broker does not delay it: the newcomer's job is picked by the next thread free.

The rule (``slots``: how many runs of the kind one tenant may hold when alone): a tenant alone may
hold every slot; while other tenants have takeable jobs or running ones, each may hold at most its
share, ``slots // active tenants`` (at least one). Among the tenants below their share, the one
holding fewest runs goes first, and its oldest due job. Runs held are counted in the database
(live leases), so the rule holds across worker processes and hosts.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import func, or_, select
from sqlmodel import Session, col

from storage.models import Job
from storage.states import JOB_TAKEABLE, JobStatus
from storage.types import utcnow

#: Statuses of a job that may be taken (its lease, if any, expired).
_TAKEABLE = JOB_TAKEABLE


def fair_share(slots: int, active_tenants: int) -> int:
    """The runs one tenant may hold: every slot when it is alone, else ``slots // active_tenants``
    (at least one)."""
    return slots if active_tenants <= 1 else max(1, slots // active_tenants)


def fair_next(session: Session, kind: str, *, slots: int, now: dt.datetime | None = None) -> uuid.UUID | None:
    """The id of the job of ``kind`` to run next under the rule of this module, or None when no
    tenant below its share has a takeable job. Reads only (the caller leases the id, and picks
    again when another worker took it first)."""
    now = now or utcnow()
    takeable = (
        col(Job.kind) == kind,
        col(Job.status).in_(_TAKEABLE),
        col(Job.due_at) <= now + dt.timedelta(seconds=1),
        or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
    )
    held: dict[uuid.UUID | None, int] = dict(
        session.execute(
            select(col(Job.tenant_id), func.count())
            .where(col(Job.kind) == kind, col(Job.status) == JobStatus.RUNNING, col(Job.lease_expires_at) >= now)
            .group_by(col(Job.tenant_id))
        ).all()
    )
    waiting = set(session.execute(select(col(Job.tenant_id)).where(*takeable).distinct()).scalars())
    share = fair_share(slots, len(waiting | set(held)))
    eligible = sorted((held.get(tenant, 0), str(tenant), tenant) for tenant in waiting if held.get(tenant, 0) < share)
    if not eligible:
        return None
    tenant = eligible[0][2]
    return session.execute(
        select(col(Job.id))
        .where(*takeable, col(Job.tenant_id) == tenant if tenant is not None else col(Job.tenant_id).is_(None))
        .order_by(col(Job.due_at), col(Job.created_at))
        .limit(1)
    ).scalar()
