"""The public shapes of documents (core document section 2, Document)."""

from __future__ import annotations

from storage.models_documents import Document


def document_view(document: Document) -> dict:
    """The public document object (core document section 2, Document)."""
    return {
        "id": document.id,
        "tenant_id": document.tenant_id,
        "metadata": dict(document.meta or {}),
        "content_type": document.content_type,
        "created_by": document.created_by,
        "created_at": document.created_at,
    }
