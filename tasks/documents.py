"""Document tasks (``documents.*`` on the ``files`` queue).

``documents.purge(document_id)``: removes a deleted document's S3 object and row (a lost message is
harmless: the ``tenant_admin.sweep_documents`` sweep removes what is left).
"""

from __future__ import annotations

import uuid

from domain.documents import service as documents
from infra.celery import celery_app
from infra.task import TesseraTask


@celery_app.task(name=documents.PURGE_TASK, base=TesseraTask, bind=True)
def purge_document(self, document_id: str) -> bool:
    """Remove a deleted document's S3 object and row; False when there was nothing to do."""
    with self.session_scope() as session:
        return documents.purge_document(session, uuid.UUID(document_id))
