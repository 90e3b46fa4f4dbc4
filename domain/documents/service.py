"""Encrypted documents in S3 (core document sections 2 and 4: Documents; section 8: 25 requests per minute).

Storage format. The content is cut into plaintext chunks of :data:`CHUNK_SIZE` (1 MiB; the last one
shorter) and each chunk ``i`` is sealed on its own with AES-256-GCM under the tenant's data key
(``storage.crypto.seal``: version byte, 12-byte nonce, ciphertext, 16-byte tag), binding
``document:<tenant_id>:<document_id>:<i>`` as associated data, so chunks cannot be reordered, moved
to another document or tenant, or altered. The sealed chunks are concatenated into one S3 object
``documents/<tenant_id>/<document_id>``: written with a multipart upload of parts of
:data:`PART_CHUNKS` sealed chunks (S3 parts must be at least 5 MiB, except the last), or one
``PutObject`` when the whole document fits in one part. The row keeps ``size`` and ``chunk_count``;
a reader checks the object against them, so a truncated object is detected.

Memory. An upload holds at most one plaintext chunk and one part of sealed chunks (about 6 MiB)
whatever the document's size; a download holds one sealed chunk at a time.

Life of a row: ``uploading`` (written before the first byte goes to S3, so a crashed upload is
found and cleaned) -> ``ready`` -> ``deleted`` (invisible at once; the object is removed by the
``documents.purge`` job recorded with the delete, or by the ``documents.sweep_documents`` sweep,
which also removes uploads left ``uploading`` for more than :data:`STALE_UPLOAD_SECONDS`).
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass
from typing import Protocol

from botocore.exceptions import ClientError
from sqlalchemy import and_, or_
from sqlmodel import Session, col, select

from domain.documents.errors import CorruptDocument
from domain.documents.views import document_view
from domain.tenancy import audit
from domain.tenancy.caller import Caller
from infra import jobs
from infra.lookup import get_owned
from storage import s3
from storage.crypto import get_keyring, open_sealed, seal
from storage.models_documents import Document
from storage.states import DocumentStatus
from storage.types import utcnow

log = logging.getLogger("tessera.documents")

DOCUMENT = "document"
PURGE_TASK = "documents.purge"
#: Attempts of a purge job before it is a dead letter (the sweep still removes what is left).
PURGE_MAX_ATTEMPTS = 5
#: Plaintext bytes per sealed chunk.
CHUNK_SIZE = 1024 * 1024
#: Bytes a sealed chunk adds: version (1), nonce (12), tag (16).
SEAL_OVERHEAD = 29
#: Sealed chunks per S3 part: 5 x (1 MiB + 29) is just over S3's 5 MiB minimum part size.
PART_CHUNKS = 5
#: An upload still ``uploading`` after this long is abandoned and removed by the sweep.
STALE_UPLOAD_SECONDS = 3600
DEFAULT_CONTENT_TYPE = "application/octet-stream"


def object_key(tenant_id: uuid.UUID, document_id: uuid.UUID) -> str:
    """The S3 key of a document's sealed content."""
    return f"documents/{tenant_id}/{document_id}"


def chunk_aad(tenant_id: uuid.UUID, document_id: uuid.UUID, index: int) -> bytes:
    """The associated data of chunk ``index``: binds tenant, document and position."""
    return f"document:{tenant_id}:{document_id}:{index}".encode()


# ---- database units of work ----------------------------------------------------------------------


def begin_upload(session: Session, caller: Caller, *, document_id: uuid.UUID, content_type: str) -> bytes:
    """Record an ``uploading`` row and return the tenant's data key to seal the chunks with (its
    active version, recorded in the row)."""
    keys = get_keyring().keys(session, caller.tenant_id)
    session.add(
        Document(
            id=document_id,
            tenant_id=caller.tenant_id,
            content_type=content_type,
            chunk_size=CHUNK_SIZE,
            object_key=object_key(caller.tenant_id, document_id),
            key_version=keys.version,
            status=DocumentStatus.UPLOADING,
            created_by=caller.application_id,
        )
    )
    return keys.data_key


def note_upload_id(session: Session, document_id: uuid.UUID, upload_id: str) -> None:
    """Remember the S3 multipart upload of an ``uploading`` row (so an abandoned one can be aborted)."""
    document = session.get(Document, document_id)
    if document is not None:
        document.upload_id = upload_id
        session.add(document)


def finish_upload(
    session: Session, caller: Caller, document_id: uuid.UUID, *, size: int, chunk_count: int, metadata: dict
) -> dict:
    """Mark the upload ``ready`` with its size, chunk count and metadata; returns the document object."""
    document = session.get(Document, document_id)
    if document is None:
        raise LookupError(f"the uploading document {document_id} is gone")
    document.size = size
    document.chunk_count = chunk_count
    document.meta = metadata
    document.upload_id = None
    document.status = DocumentStatus.READY
    session.add(document)
    audit.record(session, caller, entity_type=DOCUMENT, entity_id=document.id, operation="create")
    return document_view(document)


def discard_upload(session: Session, document_id: uuid.UUID) -> None:
    """Forget a failed upload's row (its S3 object or multipart upload was already removed)."""
    document = session.get(Document, document_id)
    if document is not None and document.status == DocumentStatus.UPLOADING:
        session.delete(document)


def get_document(session: Session, caller: Caller, document_id: uuid.UUID) -> Document:
    """The tenant's ready document, else 404."""
    return get_owned(
        session,
        Document,
        document_id,
        caller.tenant_id,
        what="document",
        where=lambda document: document.status == DocumentStatus.READY,
    )


def read_document(session: Session, caller: Caller, document_id: uuid.UUID) -> dict:
    """``GET /documents/{id}``: the metadata only."""
    document = get_document(session, caller, document_id)
    audit.record(session, caller, entity_type=DOCUMENT, entity_id=document.id, operation="read")
    return document_view(document)


@dataclass(frozen=True)
class Source:
    """What a download needs: where the sealed content is and how to open it."""

    tenant_id: uuid.UUID
    document_id: uuid.UUID
    object_key: str
    content_type: str
    size: int
    chunk_count: int
    chunk_size: int
    data_key: bytes


def open_document(session: Session, caller: Caller, document_id: uuid.UUID) -> Source:
    """``GET /documents/{id}/data``: the document's content location and key (logged as a read)."""
    document = get_document(session, caller, document_id)
    audit.record(session, caller, entity_type=DOCUMENT, entity_id=document.id, operation="read")
    return Source(
        tenant_id=document.tenant_id,
        document_id=document.id,
        object_key=document.object_key,
        content_type=document.content_type,
        size=document.size,
        chunk_count=document.chunk_count,
        chunk_size=document.chunk_size,
        data_key=get_keyring().data_key(session, document.tenant_id, document.key_version),
    )


def delete_document(session: Session, caller: Caller, document_id: uuid.UUID) -> None:
    """``DELETE /documents/{id}``: gone at once; the S3 object is removed after the commit."""
    document = get_document(session, caller, document_id)
    document.status = DocumentStatus.DELETED
    document.deleted_at = utcnow()
    session.add(document)
    jobs.record(
        session,
        kind=PURGE_TASK,
        tenant_id=document.tenant_id,
        subject_type="document",
        subject_id=str(document.id),
        trace_id=caller.trace_id,
        max_attempts=PURGE_MAX_ATTEMPTS,
    )
    audit.record(session, caller, entity_type=DOCUMENT, entity_id=document.id, operation="delete")


# ---- S3: writing and reading sealed chunks (blocking; run off the event loop) --------------------


class SealedWriter:
    """Seals plaintext chunks and streams them to S3; at most one part is held in memory.

    Call :meth:`write` with each full chunk (:data:`CHUNK_SIZE` bytes; only the last may be
    shorter), then :meth:`finish`; :meth:`abort` removes whatever was written. Not thread-safe: one
    call at a time.
    """

    def __init__(self, *, tenant_id: uuid.UUID, document_id: uuid.UUID, data_key: bytes, key: str):
        self.tenant_id = tenant_id
        self.document_id = document_id
        self.key = key
        self._data_key = data_key
        self._client = s3.get_client()
        self._bucket = s3.bucket()
        self._buffer = bytearray()
        self._buffered_chunks = 0
        self._parts: list[dict] = []
        self.upload_id: str | None = None
        self.chunks = 0
        self.size = 0

    def write(self, plaintext: bytes) -> bool:
        """Seal and buffer one chunk; uploads a part when the buffer is full. True when this call
        started the multipart upload (the caller records :attr:`upload_id`)."""
        self._buffer += seal(self._data_key, plaintext, chunk_aad(self.tenant_id, self.document_id, self.chunks))
        self.chunks += 1
        self.size += len(plaintext)
        self._buffered_chunks += 1
        started = False
        if self._buffered_chunks >= PART_CHUNKS:
            started = self.upload_id is None
            self._upload_part()
        return started

    def _upload_part(self) -> None:
        if self.upload_id is None:
            answer = self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self.key, ServerSideEncryption="AES256", ContentType=DEFAULT_CONTENT_TYPE
            )
            self.upload_id = answer["UploadId"]
        number = len(self._parts) + 1
        answer = self._client.upload_part(
            Bucket=self._bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=self._buffer
        )
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        self._buffer = bytearray()
        self._buffered_chunks = 0

    def finish(self) -> None:
        """Write what is buffered and complete the object."""
        if self.upload_id is None:
            self._client.put_object(
                Bucket=self._bucket,
                Key=self.key,
                Body=bytes(self._buffer),
                ServerSideEncryption="AES256",
                ContentType=DEFAULT_CONTENT_TYPE,
            )
            self._buffer = bytearray()
            return
        if self._buffered_chunks:
            self._upload_part()
        self._client.complete_multipart_upload(
            Bucket=self._bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self._parts}
        )

    def abort(self) -> None:
        """Remove the multipart upload or object written so far (best effort, logged)."""
        self._buffer = bytearray()
        remove_object(self.key, self.upload_id)


def remove_object(key: str, upload_id: str | None) -> None:
    """Abort a multipart upload and delete an object (both idempotent; failures are logged)."""
    client, bucket = s3.get_client(), s3.bucket()
    try:
        if upload_id:
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("NoSuchUpload", "404"):
                    raise
        client.delete_object(Bucket=bucket, Key=key)
    except ClientError:
        log.warning("could not remove the S3 object %s", key, exc_info=True)
        raise


def copy_sealed(source: Source, *, data_key: bytes, key: str) -> None:
    """Write a document's content again, sealed under ``data_key``, to the object ``key`` (a key
    rotation); chunk by chunk, at most one part in memory. Raises :class:`CorruptDocument` when the
    stored content does not open; the partial copy is then removed."""
    reader = SealedReader(source)
    writer = SealedWriter(tenant_id=source.tenant_id, document_id=source.document_id, data_key=data_key, key=key)
    reader.open()
    try:
        while (chunk := reader.next_chunk()) is not None:
            writer.write(chunk)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()


class _Body(Protocol):
    """The streaming body of an S3 GET (botocore's ``StreamingBody``)."""

    def read(self, amt: int | None = None) -> bytes: ...

    def close(self) -> None: ...


class SealedReader:
    """Reads a document's sealed chunks from S3 and opens them one at a time."""

    def __init__(self, source: Source):
        self.source = source
        self._body: _Body | None = None
        self._index = 0

    def open(self) -> None:
        """Start the S3 GET (blocking)."""
        answer = s3.get_client().get_object(Bucket=s3.bucket(), Key=self.source.object_key)
        self._body = answer["Body"]

    def next_chunk(self) -> bytes | None:
        """The next plaintext chunk; None after the last. Raises :class:`CorruptDocument`."""
        src = self.source
        body = self._body
        if body is None:
            raise RuntimeError("a chunk read before the S3 GET was opened")
        if self._index >= src.chunk_count:
            if body.read(1):
                raise CorruptDocument("the object is longer than its chunks")
            body.close()
            return None
        last = self._index == src.chunk_count - 1
        plain_len = src.size - src.chunk_size * (src.chunk_count - 1) if last else src.chunk_size
        sealed = body.read(plain_len + SEAL_OVERHEAD)
        if len(sealed) != plain_len + SEAL_OVERHEAD:
            raise CorruptDocument("the object is shorter than its chunks")
        try:
            chunk = open_sealed(src.data_key, sealed, chunk_aad(src.tenant_id, src.document_id, self._index))
        except Exception as exc:  # any failure to open is corruption
            raise CorruptDocument(f"chunk {self._index} does not authenticate") from exc
        self._index += 1
        return chunk

    def close(self) -> None:
        """Release the S3 connection."""
        if self._body is not None:
            self._body.close()


# ---- purging (worker, beat) ----------------------------------------------------------------------


def _purge_rows(session: Session, rows: list[Document]) -> int:
    purged = 0
    for document in rows:
        try:
            remove_object(document.object_key, document.upload_id)
        except ClientError:
            continue  # left for the next sweep
        session.delete(document)
        purged += 1
    return purged


def deleted_document_object(session: Session, document_id: uuid.UUID) -> tuple[str, str | None] | None:
    """``(object_key, upload_id)`` of deleted document ``document_id``; None when it is not deleted
    or already purged (the ``documents.purge`` job's read)."""
    row = session.exec(
        select(Document.object_key, Document.upload_id).where(
            Document.id == document_id, Document.status == DocumentStatus.DELETED
        )
    ).first()
    return None if row is None else (row[0], row[1])


def remove_deleted_document(session: Session, document_id: uuid.UUID) -> bool:
    """Delete deleted document ``document_id``'s row once its S3 object is gone; False when
    there was none (purged already by the sweep)."""
    document = session.exec(
        select(Document).where(Document.id == document_id, Document.status == DocumentStatus.DELETED).with_for_update()
    ).first()
    if document is None:
        return False
    session.delete(document)
    return True


def sweep_documents(session: Session, *, now: dt.datetime | None = None, batch: int = 100) -> int:
    """Purge up to ``batch`` deleted documents and uploads abandoned ``uploading`` (``SKIP LOCKED``)."""
    now = now or utcnow()
    stale = now - dt.timedelta(seconds=STALE_UPLOAD_SECONDS)
    rows = session.exec(
        select(Document)
        .where(
            or_(
                col(Document.status) == DocumentStatus.DELETED,
                and_(col(Document.status) == DocumentStatus.UPLOADING, col(Document.created_at) < stale),
            )
        )
        .order_by(col(Document.created_at))
        .limit(batch)
        .with_for_update(skip_locked=True)
    ).all()
    return _purge_rows(session, list(rows))
