"""The platform jobs that carry an account updater job through its steps, and the event that ends it
(second document, section 4 "Account updater jobs"; section 6 event 1).

Every step is a platform job (``infra.jobs``: leased, retried, relayed when its message is lost):
``account_updater.prepare`` (read and cut the file), one ``account_updater.process_chunk`` per chunk,
then ``account_updater.finish`` (the result file), all with the job as subject.
"""

from __future__ import annotations

from sqlmodel import Session

from domain.webhooks.events import emit
from infra import jobs
from storage.models_account_updater import AccountUpdaterJob

PREPARE_TASK = "account_updater.prepare"
CHUNK_TASK = "account_updater.process_chunk"
FINISH_TASK = "account_updater.finish"
DETECT_TASK = "account_updater.detect"
#: The subject type of the platform jobs working on an account updater job (``Job.subject_type``).
SUBJECT = "account_updater_job"
COMPLETED_EVENT = "account-updater.job.completed"


def record_step(session: Session, job: AccountUpdaterJob, kind: str, *, number: int | None = None) -> None:
    """Record the platform job ``kind`` (one of the ``*_TASK`` names) working on ``job`` (on its chunk
    ``number`` for a chunk step), in ``session``'s transaction; its message is sent after commit."""
    jobs.record(
        session,
        kind=kind,
        tenant_id=job.tenant_id,
        subject_type=SUBJECT,
        subject_id=str(job.id),
        subject_number=number,
        trace_id=job.trace_id,
    )


def emit_outcome(session: Session, job: AccountUpdaterJob) -> None:
    """``account-updater.job.completed`` with ``{job: {id, status}}`` for a job that has ended
    (completed or failed)."""
    emit(
        session,
        tenant_id=job.tenant_id,
        type=COMPLETED_EVENT,
        data={"job": {"id": str(job.id), "status": job.status}},
        trace_id=job.trace_id,
    )
