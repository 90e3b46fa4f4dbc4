"""A rotation's sweep through one column of sealed values (:func:`domain.keys.service.rotate_pass`):
chunks read without locks and resealed (:func:`storage.sealed.reseal_values`) while a thread of their
own writes the previous chunk with the rotation's progress, and the adaptive pause after each write
(:class:`Throttle`)."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import update
from sqlmodel import col

from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models import KeyRotation
from storage.sealed import SealedColumn, key_of, reseal_values, stale_rows, write_resealed

#: The :class:`Throttle`: no pause while a chunk's write takes at most this many times the fastest
#: seen per value, and the longest pause after one chunk (seconds).
SLOWDOWN = 1.5
MAX_PAUSE_SECONDS = 0.5


class Throttle:
    """The pause after each written chunk of a rotation, adapting to how busy the database is.

    The time a chunk's write takes per value is compared with the fastest seen in this pass (the
    database with room to spare). While it stays within :data:`SLOWDOWN` times of that, there is
    no pause at all; beyond it (the tenant's own requests, which use the same tables and the same
    CPU, are being slowed down too) the rotation pauses for ``slowdown - 1`` times the chunk's
    time, up to :data:`MAX_PAUSE_SECONDS`: the busier the database, the smaller the rotation's
    share of its time (a half at twice the fastest, a third at three times...)."""

    def __init__(self) -> None:
        self._fastest: float | None = None
        self.paused = 0.0

    def pause_after(self, seconds: float, values: int) -> float:
        """The pause (seconds) after a chunk of ``values`` written in ``seconds``; also added to
        :attr:`paused`."""
        if values <= 0:
            return 0.0
        each = seconds / values
        if self._fastest is None or each < self._fastest:
            self._fastest = each
        slowdown = each / self._fastest
        pause = 0.0 if slowdown <= SLOWDOWN else min(MAX_PAUSE_SECONDS, seconds * (slowdown - 1))
        self.paused += pause
        return pause


class _Writer:
    """Writes resealed chunks on a thread of its own (each chunk with the rotation's progress, in
    its own transaction, then the :class:`Throttle`'s pause), so the next chunk is read and
    resealed meanwhile. At most one chunk waits; an error of the writer is raised by the next
    :meth:`put` or by :meth:`close`."""

    def __init__(self, spec: SealedColumn, tenant_id: uuid.UUID, rotation_id: uuid.UUID, throttle: Throttle) -> None:
        self._spec, self._tenant_id, self._rotation_id, self._throttle = spec, tenant_id, rotation_id, throttle
        self._queue: queue.Queue[tuple[Sequence[Any], list[bytes]] | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self.changed = 0
        self._thread = threading.Thread(target=self._run, name="rotation-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the reader stops at its next put
            try:
                began = time.perf_counter()
                with session_scope() as session:
                    changed = write_resealed(session, self._spec, self._tenant_id, *chunk)
                    session.execute(
                        update(KeyRotation)
                        .where(col(KeyRotation.id) == self._rotation_id)
                        .values(done=col(KeyRotation.done) + changed)
                    )
                self.changed += changed
                time.sleep(self._throttle.pause_after(time.perf_counter() - began, len(chunk[0])))
            except Exception as exc:  # noqa: BLE001 - raised again in the reading thread (put, close)
                self._error = exc

    def put(self, rows: Sequence[Any], sealed: list[bytes]) -> None:
        """Queue one chunk (waits while the previous one is still queued)."""
        if self._error is not None:
            raise self._error
        self._queue.put((rows, sealed))

    def close(self) -> int:
        """Wait for the queued chunks to be written; how many values changed."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.changed


def sweep_column(
    spec: SealedColumn,
    tenant_id: uuid.UUID,
    version: int,
    rotation_id: uuid.UUID,
    deadline: float,
    throttle: Throttle,
    *,
    chunk: int,
    after: tuple | None = None,
) -> tuple[int, tuple | None]:
    """Re-seal one column's values under older versions, from its first row (or the one after the
    key ``after``) to its last, a keyset through the primary key, ``chunk`` values at a time, until
    ``deadline`` (``time.monotonic()``): ``(changed, the key of the last row done when the deadline
    came first, else None)``. Each chunk is read and resealed while the previous one is written."""
    keyring = get_keyring()
    finished = False
    writer = _Writer(spec, tenant_id, rotation_id, throttle)
    try:
        while time.monotonic() < deadline:
            with session_scope() as session:
                rows = stale_rows(session, spec, tenant_id, version, chunk, after)
                if not rows:
                    finished = True
                    break
                fresh = reseal_values(
                    keyring,
                    session,
                    tenant_id,
                    spec.purpose,
                    [spec.resource_of(row) for row in rows],
                    [row.sealed for row in rows],
                    version,
                )
            writer.put(rows, fresh)
            after = key_of(spec, rows[-1])
    finally:
        changed = writer.close()
    return changed, None if finished or after is None else after
