"""Fairness between tenants that wastes no capacity: a tenant alone uses every worker slot; while
other tenants wait, a worker that takes a busy tenant's message serves a waiting tenant in its place.

Two forms of one rule, both on the ``jobs`` rows (leases held and jobs waiting are counted in the
database, so the rule holds across worker processes and hosts):

* **In place, at lease time** (:func:`others_wait`, :func:`held_by_tenant`, :func:`pick_for_others`):
  for the job tasks sent one message per job, FIFO (provider jobs, account-updater chunks, mail: every
  :class:`infra.task.JobTask` whose ``fair_between_tenants`` is set), and for webhook deliveries
  (``domain/webhooks/deliveries.py``, a hundred a message). A kind's *group* is the fair kinds of its
  queue whose lease fits the run's time limit (:attr:`infra.task.JobTask.fair_group`). The lease
  statement of a job reads, in the same statement, whether another tenant has a job of the group due
  and not taken (two index range probes, below and above the job's tenant: a flood of the job's own
  tenant is not scanned). Only then (zero extra statements otherwise: a tenant alone or with nobody
  waiting pays nothing more) the worker counts the runs each tenant holds (one grouped query: a
  tenant below two runs stops there); when the job's tenant holds at least two more than a waiting
  tenant (webhooks: it holds ``TESSERA_WEBHOOK_TENANT_SLOTS`` task runs and the waiting tenant none),
  the worker leases the waiting tenant's job instead (the tenants holding nothing first) and hands its
  own back (queued again, the attempt undone, its message sent again, behind those queued). The
  waiting tenant's own message later finds its job taken and is skipped. Bound: a newcomer's job is
  taken by the first message of the group any worker takes after its commit, so it waits at most for
  one run of the busy tenant's to end (a provider call, a chunk, one mail; a round of concurrent
  POSTs for webhooks), not for the flood queued ahead of it. Tenants waiting converge to equal shares
  of the busy slots.
* **A message is a token** (:func:`fair_next`): for work that holds a slot for long (customer code
  runs: up to 30 s each). A message of such a kind is a *token*, not an order: the worker thread
  that takes it leases the job :func:`fair_next` picks among every takeable job of the kind, and when
  that job is done it picks again, until nothing eligible is left. The rule (``slots``: how many runs
  of the kind one tenant may hold when alone): a tenant alone may hold every slot; while other
  tenants have takeable jobs or running ones, each may hold at most its share,
  ``slots // active tenants`` (at least one). Among the tenants below their share, the one holding
  fewest runs goes first, and its oldest due job.

The queries have the shape of the partial index ``ix_jobs_takeable`` on ``jobs (kind, tenant_id,
due_at)`` over the takeable statuses: equality on the kind, a range on the tenant, then the due time
(with it, the two probes of a lease statement take about 0.05 ms; without it they read every
takeable job due, tens of milliseconds behind a backlog of 50,000 deliveries). Webhook deliveries
use ``ix_jobs_deliveries_waiting`` (``tenant_id, due_at`` over the waiting deliveries).
"""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Collection, Mapping, Sequence

from sqlalchemy import ColumnElement, and_, exists, func, or_, select
from sqlmodel import Session, col

from storage.db import in_constants
from storage.models import Job
from storage.states import JOB_TAKEABLE, JobStatus
from storage.types import table_of, utcnow

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


_JOBS = table_of(Job)


def others_wait(kinds: Sequence[str], now: ColumnElement) -> ColumnElement[bool]:
    """A column expression over a ``jobs`` row being leased: true when a tenant other than the row's has
    a job of ``kinds`` due at ``now`` and not taken (two ``EXISTS`` probes, tenants below and above the
    row's, each an index range scan that stops at the first hit). A job without a tenant never waits for
    one. For the lease statement's reads, ``now`` its time (:data:`infra.jobs.LEASE_NOW`)."""
    others = _JOBS.alias("waiting_jobs")
    waiting = (
        in_constants(others.c.kind, kinds),  # literals: the generic plan of the prepared lease then uses
        in_constants(others.c.status, JOB_TAKEABLE),  # the partial index ix_jobs_takeable
        others.c.due_at <= now,
        or_(others.c.lease_expires_at.is_(None), others.c.lease_expires_at < now),
    )
    return or_(
        exists().where(*waiting, others.c.tenant_id < _JOBS.c.tenant_id),
        exists().where(*waiting, others.c.tenant_id > _JOBS.c.tenant_id),
    )


def held_by_tenant(
    session: Session, kinds: Sequence[str], *, now: dt.datetime, runs: bool = False
) -> dict[uuid.UUID, int]:
    """What each tenant holds of the jobs of ``kinds``: ``{tenant id: running jobs with a live lease}``
    (with ``runs``: distinct lease owners, i.e. task runs, for a kind leased in batches). One grouped
    query over the running jobs (at most a few per worker slot); tenants holding nothing are absent."""
    counted = func.count(func.distinct(col(Job.lease_owner))) if runs else func.count()
    rows = session.execute(
        select(col(Job.tenant_id), counted)
        .where(
            col(Job.kind).in_(list(kinds)),
            col(Job.status) == JobStatus.RUNNING,
            col(Job.lease_expires_at) > now,
            col(Job.tenant_id).is_not(None),
        )
        .group_by(col(Job.tenant_id))
    ).all()
    return {tenant: count for tenant, count in rows}


def _between(excluded: Collection[uuid.UUID]) -> list[ColumnElement[bool]]:
    """Conditions on ``jobs.tenant_id`` that together cover every tenant but ``excluded``: the open
    intervals between the excluded ids in order, so each probe seeks past an excluded tenant's rows
    in the index instead of reading them."""
    bounds = sorted(set(excluded))
    if not bounds:
        return [col(Job.tenant_id).is_not(None)]
    conditions: list[ColumnElement[bool]] = [col(Job.tenant_id) < bounds[0]]
    conditions += [
        and_(col(Job.tenant_id) > low, col(Job.tenant_id) < high) for low, high in itertools.pairwise(bounds)
    ]
    conditions.append(col(Job.tenant_id) > bounds[-1])
    return conditions


def pick_for_others(
    session: Session,
    kinds: Sequence[str],
    *,
    tenant: uuid.UUID,
    held: Mapping[uuid.UUID, int],
    below: int,
    limit: int,
    now: dt.datetime,
) -> list[tuple[uuid.UUID, str]]:
    """Up to ``limit`` jobs of ``kinds`` (``[(id, kind)]``) that a worker about to run ``tenant``'s work
    should take in its place: jobs due now and not taken of other tenants, first of tenants holding
    nothing (``held``: :func:`held_by_tenant`), else of tenants holding fewer than ``below``; empty when
    no such tenant waits. Reads only (the caller leases the ids; a job another worker took meanwhile is
    simply not leased). One index range probe per interval between excluded tenants (at most the
    tenants holding work, plus one)."""
    if limit <= 0:
        return []
    takeable = (
        col(Job.kind).in_(list(kinds)),
        col(Job.status).in_(JOB_TAKEABLE),
        col(Job.due_at) <= now,
        or_(col(Job.lease_expires_at).is_(None), col(Job.lease_expires_at) < now),
    )
    passes = [{tenant, *held}]
    if below > 1:
        passes.append({tenant, *(other for other, count in held.items() if count >= below)})
    for excluded in passes:
        found: list[tuple[uuid.UUID, str]] = []
        for interval in _between(excluded):
            rows = session.execute(
                select(col(Job.id), col(Job.kind)).where(*takeable, interval).limit(limit - len(found))
            ).all()
            found += [(job_id, kind) for job_id, kind in rows]
            if len(found) >= limit:
                return found
        if found:
            return found
    return []
