"""Document tasks (``documents.*`` on the ``files`` queue; beat sends its sweep on ``sweeps``).

* ``documents.purge`` (a recorded job, subject: the document): removes a deleted document's S3 object,
  then its row. S3 failures are retried with backoff; a lost message is re-sent by the outbox relay,
  and the sweep below removes whatever a dead letter leaves.
* ``documents.sweep_documents`` (beat): removes deleted documents and abandoned uploads from S3 and the
  database, in batches with ``SKIP LOCKED``, safe to run twice or on two beat processes.
"""

from __future__ import annotations

import uuid
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from sqlmodel import Session

from domain.documents import service as documents
from infra.celery import celery_app
from infra.jobs import TransientError
from infra.task import JobTask, TesseraTask
from storage.models import Job
from storage.types import utcnow
from tasks.sweeps import in_batches

#: Documents purged per transaction of the sweep (each costs S3 calls).
SWEEP_BATCH = 100


class PurgeDocument(JobTask):
    """Remove the S3 object (outside any transaction), then the row in the completing one."""

    name = documents.PURGE_TASK
    lease_seconds = 120.0

    def perform(self, job: Job, inputs: dict[str, Any]) -> bool:
        """True when the object was removed now; False when the document is not (or no longer) deleted.

        Raises :class:`~infra.jobs.TransientError` when S3 refuses or cannot be reached."""
        with self.session_scope() as session:
            found = documents.deleted_document_object(session, uuid.UUID(job.subject_id))
        if found is None:
            return False
        try:
            documents.remove_object(*found)
        except (ClientError, BotoCoreError) as exc:
            raise TransientError(f"S3: {exc}") from exc
        return True

    def apply(self, session: Session, job: Job, outcome: bool) -> dict:
        removed = outcome and documents.remove_deleted_document(session, uuid.UUID(job.subject_id))
        return {"purged": bool(removed)}


celery_app.register_task(PurgeDocument())


@celery_app.task(name="documents.sweep_documents", base=TesseraTask)
def sweep_documents() -> int:
    """Remove deleted documents and abandoned uploads from S3 and the database; returns how many."""
    return in_batches(lambda s: documents.sweep_documents(s, now=utcnow(), batch=SWEEP_BATCH), SWEEP_BATCH)
