"""Tasks of reactors (``reactors.*``, routed to the ``reactors`` queue): builds and invocations.

Each is a :class:`infra.task.JobTask` running one recorded job:

* ``reactors.build`` installs a requested version's pinned dependencies (npm, ``--ignore-scripts``,
  cached by dependency set) and scans them (:meth:`domain.reactors.runtime.ReactorRuntime.build`),
  and loads the code once in a sandboxed process, then :func:`domain.reactors.service.apply_build`
  makes it serve or refuses it (``invalid_code`` when the code does not load). npm failing to
  install and a registry refusing the scan (a 4xx) are permanent (``build_failed`` at once); a scan
  that could not be made otherwise is retried, then ``build_failed``.
* ``reactors.run`` runs one invocation's code in this worker's warm Node.js processes
  (:mod:`domain.reactors.runs`); one attempt only: a run whose worker died is not run again.
* ``reactors.purge_results`` is the beat sweep of old invocations (on the ``sweeps`` queue).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

from celery.worker.control import control_command
from sqlmodel import Session

from config.settings import get_settings
from domain.reactors import runs, service
from domain.reactors.runtime import reactor_runtime, retire_owner
from infra.celery import celery_app
from infra.dispatch import send_task
from infra.fairness import fair_next
from infra.jobs import PermanentError, TransientError
from infra.node_runtime.owners import END_CODE_COMMAND
from infra.node_runtime.packages import AuditRefused, AuditUnavailable, InstallFailed
from infra.node_runtime.sandbox import SandboxUnavailable
from infra.task import JobTask, TesseraTask
from storage.db import session_scope
from storage.models import Job
from storage.types import utcnow
from tasks.sweeps import in_batches


class BuildReactor(JobTask):
    """``reactors.build``: install and scan the requested version of a reactor."""

    name = service.BUILD_TASK
    lease_seconds = 600.0
    backoff_base = 5.0

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """The :class:`~domain.reactors.runtime.Build` (None: nothing to build any more)."""
        with session_scope() as session:
            version = service.build_input(session, job)
        if version is None:
            return None
        try:
            return reactor_runtime().build(version.runtime, version=version)
        except InstallFailed as exc:
            raise PermanentError(service.BUILD_FAILED, str(exc)) from None
        except AuditRefused as exc:
            raise PermanentError(service.BUILD_FAILED, service.audit_refused_message(exc)) from None
        except AuditUnavailable as exc:
            raise TransientError(f"the vulnerability scan could not be made: {exc}") from None
        except SandboxUnavailable as exc:
            raise TransientError(f"the code cannot be loaded in a sandbox on this worker: {exc}") from None

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.reactors.service.apply_build`."""
        return service.apply_build(session, job, outcome)

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        """See :func:`domain.reactors.service.build_failed`."""
        service.build_failed(session, job, error)


class RunReactor(JobTask):
    """``reactors.run``: run invocations (``react``, ``react-async``, code transforms), fairly.

    A message is a token (:mod:`infra.fairness`): the thread that takes it runs the run the rule
    picks among all takeable ones (the fewest held slots first, each tenant at most its share of
    ``TESSERA_REACTOR_SLOTS`` while others wait), then picks again, until no eligible run is left
    or :data:`RUNS_PER_MESSAGE` ran (then it sends one token on, so nothing waits for the relay).
    """

    name = runs.RUN_TASK
    #: Its own rule (:func:`infra.fairness.fair_next`), not the one at lease time.
    fair_between_tenants = False
    #: The longest runtime timeout (30 s) twice over, plus a cold start and the dependencies' install.
    lease_seconds = 120.0
    #: Runs one message may carry a thread through (bounded, so a run's time limit is not outlived).
    RUNS_PER_MESSAGE = 8

    def run(self, job_id: str, sibling_ids: Sequence[str] = ()) -> str:
        """Run the fairest eligible runs (not necessarily ``job_id``: see the class text); runs are
        never recorded together, so no message names ``sibling_ids``."""
        slots = get_settings().reactor_slots
        outcome = "skipped"
        started = time.monotonic()
        for _ in range(self.RUNS_PER_MESSAGE):
            with session_scope() as session:
                chosen = fair_next(session, self.name, slots=slots)
            if chosen is None:
                return outcome
            if super().run(str(chosen)) != "skipped":
                outcome = "succeeded"
            if time.monotonic() - started > self.lease_seconds / 2:
                break
        with session_scope() as session:
            following = fair_next(session, self.name, slots=slots)
        if following is not None:
            send_task(self.name, job_id=str(following))
        return outcome

    def perform(self, job: Job, inputs: dict[str, Any]) -> Any:
        """See :func:`domain.reactors.runs.perform_run`."""
        return runs.perform_run(job)

    def apply(self, session: Session, job: Job, outcome: Any) -> dict | None:
        """See :func:`domain.reactors.runs.apply_run`."""
        return runs.apply_run(session, job, outcome)

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        """See :func:`domain.reactors.runs.run_failed`."""
        runs.run_failed(session, job, error)


celery_app.register_task(BuildReactor())
celery_app.register_task(RunReactor())


@control_command(name=END_CODE_COMMAND, args=[("prefix", str)], signature="<prefix>")
def end_code(state, prefix: str) -> dict:
    """Remote-control command (:data:`infra.node_runtime.owners.END_CODE_COMMAND`): end this
    worker's processes of customer code whose key starts with ``prefix`` (a deleted reactor or proxy,
    or a replaced version); answers how many keys it ended."""
    return {"ok": f"{retire_owner(prefix)} ended"}


@celery_app.task(name=runs.PURGE_TASK, base=TesseraTask)
def purge_results() -> int:
    """Beat sweep: delete invocations settled longer ago than ``TESSERA_REACTOR_RESULT_RETENTION_HOURS``
    (their sealed arguments and answers), in batches of 500."""
    before = utcnow() - dt.timedelta(hours=get_settings().reactor_result_retention_hours)
    return in_batches(lambda session: runs.purge_results(session, before=before, batch=500), 500)
