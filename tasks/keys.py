"""Tasks of keys (``keys.*``, on the ``files`` queue with the other long batch work): a tenant's data
key rotation, the rewrap of every wrapped key under the current wrapping key, and the purge of a
shredded tenant. Each is a :class:`infra.task.JobTask` of one pass that records the next pass while
work remains (:mod:`domain.keys.service`): a killed pass is leased again and resumes from the data.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from domain.keys import service
from domain.tenancy.tenants import PURGE_TASK
from infra.celery import celery_app
from infra.task import JobTask
from storage.models import Job

#: Seconds of work one pass does before it hands over to the next (a quarter of its lease).
PASS_SECONDS = 30.0


class RotateTenantKey(JobTask):
    """``keys.rotate``: one pass of a tenant's data key rotation."""

    name = service.ROTATE_TASK
    lease_seconds = 4 * PASS_SECONDS

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """See :func:`domain.keys.service.rotate_pass`."""
        return service.rotate_pass(job, budget_seconds=PASS_SECONDS)

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.keys.service.settle_pass`."""
        return service.settle_pass(session, job, outcome)


class RewrapKeys(JobTask):
    """``keys.rewrap``: one pass of the rewrap under the current wrapping key."""

    name = service.REWRAP_TASK
    lease_seconds = 4 * PASS_SECONDS

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """See :func:`domain.keys.service.rewrap_pass`."""
        return service.rewrap_pass(budget_seconds=PASS_SECONDS)

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.keys.service.settle_rewrap`."""
        return service.settle_rewrap(session, job, outcome)


class PurgeTenant(JobTask):
    """``keys.purge_tenant``: delete a shredded tenant's rows and S3 objects."""

    name = PURGE_TASK
    lease_seconds = 300.0

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """See :func:`domain.keys.service.purge_tenant`."""
        return service.purge_tenant(job)

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """The job result: how many stored objects were deleted."""
        return {"objects": outcome}


celery_app.register_task(RotateTenantKey())
celery_app.register_task(RewrapKeys())
celery_app.register_task(PurgeTenant())
