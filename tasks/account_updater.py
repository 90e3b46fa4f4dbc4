"""Account updater tasks (``account_updater.*``, on the ``files`` queue); the rules are in
:mod:`domain.account_updater` (``service`` and the modules of its concerns).

Job tasks (``infra.task.JobTask``: leased, retried with backoff on transient failures, a dead letter
after ``max_attempts``; every step recorded as a platform job so the outbox relay re-sends a lost one):

* ``account_updater.prepare`` (subject: the job id): read and check the request file, cut it into chunks.
* ``account_updater.process_chunk`` (subject: the job id and the chunk number): one chunk, in parallel.
* ``account_updater.finish`` (subject: the job id): write the result file, complete the job.

A permanent failure or a dead letter of any step fails the account updater job (with the event).

Other tasks: ``account_updater.detect`` (``job_id``: look for one job's file, sent by polls and S3
notifications), and the beat sweeps ``account_updater.detect_uploads`` (every 5 s) and
``account_updater.remove_expired_jobs`` (every 60 s).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlmodel import Session

from domain.account_updater import chunks, csv_files, results, s3_files, service, steps
from infra.celery import celery_app
from infra.jobs import PermanentError, TransientError
from infra.task import JobTask, TesseraTask
from storage.db import session_scope
from storage.models import Job
from storage.types import utcnow

log = logging.getLogger("tessera.tasks.account_updater")


def _failure_message(error: Exception) -> str:
    if isinstance(error, PermanentError):
        return str(error)
    if isinstance(error, TransientError):
        return f"Processing stopped after repeated failures: {error}."
    return "Processing failed."


class _AccountUpdaterJobTask(JobTask):
    """The shared part: the lease follows ``TESSERA_JOB_LEASE_SECONDS``; failures fail the job."""

    abstract = True
    #: ``TESSERA_JOB_LEASE_SECONDS``: a chunk takes about a second, far below it.
    lease_seconds = 0.0
    lease_settings = {"job_lease_seconds": 1.0}

    @staticmethod
    def job_id(job: Job) -> uuid.UUID:
        """The account updater job a platform job works on (its subject)."""
        return uuid.UUID(job.subject_id)

    def on_job_failure(self, session: Session, job: Job, error: Exception) -> None:
        service.fail_job(session, self.job_id(job), [_failure_message(error)])


class Prepare(_AccountUpdaterJobTask):
    """Read and check the request file; record its chunks (``domain.account_updater.service.scan_job_file``)."""

    name = steps.PREPARE_TASK

    def perform(self, job: Job, inputs: dict[str, Any]) -> csv_files.Scan:
        return service.scan_job_file(self.job_id(job))

    def apply(self, session: Session, job: Job, outcome: csv_files.Scan) -> dict:
        return service.apply_scan(session, self.job_id(job), outcome)


class ProcessChunk(_AccountUpdaterJobTask):
    """Process one chunk (``domain.account_updater.chunks.process_chunk`` / ``apply_chunk``)."""

    name = steps.CHUNK_TASK
    pause_gc = True  # a chunk makes a few objects per row of thousands: no collector passes meanwhile

    @staticmethod
    def chunk_number(job: Job) -> int:
        """The chunk a platform job processes (its subject number)."""
        if job.subject_number is None:
            raise ValueError(f"account-updater chunk job {job.id} has no chunk number")
        return job.subject_number

    def perform(self, job: Job, inputs: dict[str, Any]) -> chunks.ChunkOutcome:
        return chunks.process_chunk(self.job_id(job), self.chunk_number(job))

    def apply(self, session: Session, job: Job, outcome: chunks.ChunkOutcome) -> dict:
        return chunks.apply_chunk(session, self.job_id(job), self.chunk_number(job), outcome)


class Finish(_AccountUpdaterJobTask):
    """Write the result file and complete the job (``domain.account_updater.results.write_result``)."""

    name = steps.FINISH_TASK

    def perform(self, job: Job, inputs: dict[str, Any]) -> str | None:
        return results.write_result(self.job_id(job))

    def apply(self, session: Session, job: Job, outcome: str | None) -> dict:
        if outcome is None:
            return {"skipped": True}
        return {"completed": service.complete_job(session, self.job_id(job), outcome), "key": outcome}


prepare = celery_app.register_task(Prepare())
process_chunk = celery_app.register_task(ProcessChunk())
finish = celery_app.register_task(Finish())


@celery_app.task(name=steps.DETECT_TASK, base=TesseraTask)
def detect(job_id: str) -> str:
    """Look for one pending job's file; start the job when it is there. A lost message is harmless:
    the sweep looks too."""
    try:
        return service.detect_upload(uuid.UUID(job_id))
    except TransientError:
        log.warning("S3 did not answer while looking for the file of job %s", job_id)
        return "unavailable"


@celery_app.task(name="account_updater.detect_uploads", base=TesseraTask)
def detect_uploads() -> int:
    """Beat sweep: start pending jobs whose file has been uploaded."""
    return service.detect_uploads()


@celery_app.task(name="account_updater.remove_expired_jobs", base=TesseraTask)
def remove_expired_jobs() -> int:
    """Beat sweep: remove jobs still pending after their upload window, and their files."""
    total = 0
    for _ in range(20):
        with session_scope() as session:
            keys = service.remove_expired_jobs(session, now=utcnow(), batch=500)
        for key in keys:
            s3_files.delete_object(key)
        total += len(keys)
        if len(keys) < 500:
            break
    return total
