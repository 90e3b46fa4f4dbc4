"""Streaming one document upload into S3 (``POST /documents``; core document section 4, Documents).

The front hands the multipart file part to an :class:`Upload`, which records the ``uploading`` row
(before the first byte goes to S3, so a crashed upload is found by the sweep), reads the part in
pieces of :data:`READ_SIZE` bytes, seals and uploads each full chunk of
:data:`~domain.documents.service.CHUNK_SIZE` bytes as it fills (:class:`~domain.documents.service.SealedWriter`),
notes the S3 multipart upload id once it exists, and completes the object and the row. On failure
:meth:`Upload.undo` removes what was written. At most one plaintext chunk and one S3 part are held in
memory, whatever the document's size.

The upload never blocks the event loop: database units of work go through the ``db`` runner (one
transaction each on the database pool) and the blocking S3 and crypto calls through the ``blocking``
runner (the application's file pool, so a large upload does not hold database threads); both are
given by the caller.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from domain.documents import service as documents
from domain.tenancy.caller import Caller
from infra.errors import Problem

log = logging.getLogger("tessera.documents")

#: Bytes read from the request at a time.
READ_SIZE = 256 * 1024

#: ``await db(fn, *args, **kwargs)`` runs ``fn(session, *args, **kwargs)`` in one transaction off the loop.
DbRunner = Callable[..., Awaitable[Any]]
#: ``await blocking(fn, *args)`` runs ``fn(*args)`` off the loop, in the caller's context.
BlockingRunner = Callable[..., Awaitable[Any]]


class Part(Protocol):
    """The file part of a multipart body (aiohttp's ``BodyPartReader``)."""

    async def read_chunk(self, size: int = ...) -> bytes:
        """The next bytes of the part, at most ``size``; ``b""`` at its end."""
        ...


class Upload:
    """One document upload in flight: its row id, its sealed writer and what to undo on failure."""

    def __init__(self, caller: Caller, *, db: DbRunner, blocking: BlockingRunner):
        self.caller = caller
        self._db = db
        self._blocking = blocking
        self.document_id: uuid.UUID | None = None
        self.writer: documents.SealedWriter | None = None

    async def begin(self, content_type: str) -> None:
        """Record the ``uploading`` row and open a sealed writer for it."""
        caller = self.caller
        document_id = self.document_id = uuid.uuid4()
        data_key = await self._db(documents.begin_upload, caller, document_id=document_id, content_type=content_type)
        self.writer = await self._blocking(
            lambda: documents.SealedWriter(
                tenant_id=caller.tenant_id,
                document_id=document_id,
                data_key=data_key,
                key=documents.object_key(caller.tenant_id, document_id),
            )
        )

    async def write(self, chunk: bytes) -> None:
        """Seal and upload one chunk; note the multipart upload id once it exists."""
        writer = self.writer
        if writer is None:
            raise RuntimeError("a chunk written before the upload began")
        if await self._blocking(writer.write, chunk):
            await self._db(documents.note_upload_id, self.document_id, writer.upload_id)

    async def stream(self, part: Part, max_bytes: int) -> None:
        """Read the file part in pieces, sealing and uploading each full chunk as it fills.

        Raises :class:`~infra.errors.Problem` 413 past ``max_bytes`` (``TESSERA_DOCUMENT_MAX_BYTES``)."""
        pending = bytearray()
        total = 0
        while piece := await part.read_chunk(READ_SIZE):
            total += len(piece)
            if total > max_bytes:
                raise Problem(413, f"The document is larger than {max_bytes} bytes (TESSERA_DOCUMENT_MAX_BYTES).")
            pending += piece
            while len(pending) >= documents.CHUNK_SIZE:
                chunk = bytes(pending[: documents.CHUNK_SIZE])
                del pending[: documents.CHUNK_SIZE]
                await self.write(chunk)
        if pending:
            await self.write(bytes(pending))

    async def finish(self, metadata: dict[str, str]) -> dict:
        """Complete the S3 object and mark the row ``ready``; the document object
        (:func:`~domain.documents.views.document_view`)."""
        writer = self.writer
        if writer is None:
            raise RuntimeError("an upload finished before it began")
        await self._blocking(writer.finish)
        return await self._db(
            documents.finish_upload,
            self.caller,
            self.document_id,
            size=writer.size,
            chunk_count=writer.chunks,
            metadata=metadata,
        )

    async def undo(self) -> None:
        """Remove what a failed upload wrote to S3 and its row."""
        if self.writer is not None:
            try:
                await self._blocking(self.writer.abort)
            except Exception:  # the documents sweep removes what is left
                log.warning("could not remove a failed upload's S3 object; the sweep will", exc_info=True)
        if self.document_id is not None:
            await self._db(documents.discard_upload, self.document_id)
