"""A rotation's sweep through one column of sealed values (:func:`domain.keys.service.rotate_pass`):
chunks read without locks and resealed (:func:`storage.sealed.reseal_values`) while threads of their
own write the previous chunks with the rotation's progress (:data:`WRITERS` at once: the database's
side of a write, an ``UPDATE`` of thousands of rows and its index entries, is most of the work and
runs on another core than the reading), and the adaptive pause (:class:`Throttle`).

Measured on 200,000 tokens (one chunk of 5,000 values): reading ~25 µs per value (an index scan in
key order), resealing ~5 µs, writing ~45-75 µs (a row moved off a full page writes an entry in each
of the table's indexes); hence several writers for one reader."""

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
#: Chunks written at once, each by a thread and a database connection of its own.
WRITERS = 2


class Throttle:
    """The pause after each written chunk of a rotation, adapting to how busy the database is.

    The time a chunk's write takes per value is compared with the fastest seen in this pass with as
    many of the sweep's writes under way together (the database with room to spare; two writes at
    once each take longer than one alone, which is no sign of a busy database). While it stays
    within :data:`SLOWDOWN` times of that, there is no pause at all; beyond it (the tenant's own
    requests, which use the same tables and the same CPU, are being slowed down too) the rotation
    pauses for ``slowdown - 1`` times the chunk's time, up to :data:`MAX_PAUSE_SECONDS`: the busier
    the database, the smaller the rotation's share of its time (a half at twice the fastest, a third
    at three times...). A pause holds every writer of the sweep (:meth:`wait`), not only the one
    whose chunk was slow. Safe to use from several threads."""

    def __init__(self) -> None:
        self._fastest: dict[int, float] = {}
        self._lock = threading.Lock()
        self._until = 0.0
        self.paused = 0.0

    def pause_after(self, seconds: float, values: int, together: int = 1) -> float:
        """The pause (seconds) after a chunk of ``values`` written in ``seconds`` while at most
        ``together`` writes of the sweep were under way (itself included); also added to
        :attr:`paused`, and :meth:`wait` holds every writer until it has passed."""
        if values <= 0:
            return 0.0
        each = seconds / values
        with self._lock:
            fastest = self._fastest.get(together)
            if fastest is None or each < fastest:
                fastest = self._fastest[together] = each
            slowdown = each / fastest
            pause = 0.0 if slowdown <= SLOWDOWN else min(MAX_PAUSE_SECONDS, seconds * (slowdown - 1))
            if pause:
                now = time.monotonic()
                until = max(self._until, now) + pause  # pauses of several writers add up
                self.paused += until - max(self._until, now)
                self._until = until
        return pause

    def wait(self) -> None:
        """Sleep until the pauses decided so far have passed (before a chunk's write)."""
        while (left := self._until - time.monotonic()) > 0:
            time.sleep(left)


class _Writer:
    """Writes resealed chunks on :data:`WRITERS` threads of its own (each chunk with the rotation's
    progress, in its own transaction, after the :class:`Throttle`'s pauses), so the next chunk is
    read and resealed meanwhile. Chunks are written in any order (each is its own rows; the progress
    is a sum). At most one chunk per writer waits; an error of a writer is raised by the next
    :meth:`put` or by :meth:`close`."""

    def __init__(self, spec: SealedColumn, tenant_id: uuid.UUID, rotation_id: uuid.UUID, throttle: Throttle) -> None:
        self._spec, self._tenant_id, self._rotation_id, self._throttle = spec, tenant_id, rotation_id, throttle
        self._queue: queue.Queue[tuple[Sequence[Any], list[bytes]] | None] = queue.Queue(maxsize=WRITERS)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._under_way: list[list[int]] = []  # per write under way: the most under way together
        self.changed = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"rotation-writer-{n}", daemon=True) for n in range(WRITERS)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the reader stops at its next put
            try:
                self._throttle.wait()
                together = self._begin()
                began = time.perf_counter()
                try:
                    with session_scope() as session:
                        changed = write_resealed(session, self._spec, self._tenant_id, *chunk)
                        session.execute(
                            update(KeyRotation)
                            .where(col(KeyRotation.id) == self._rotation_id)
                            .values(done=col(KeyRotation.done) + changed)
                        )
                finally:
                    took = time.perf_counter() - began
                    with self._lock:  # by identity: two records may hold the same count
                        self._under_way = [other for other in self._under_way if other is not together]
                with self._lock:
                    self.changed += changed
                self._throttle.pause_after(took, len(chunk[0]), together[0])
            except Exception as exc:  # noqa: BLE001 - raised again in the reading thread (put, close)
                self._error = exc

    def _begin(self) -> list[int]:
        """Count a write under way: its record of the most writes under way together while it runs."""
        with self._lock:
            together = [len(self._under_way) + 1]
            self._under_way.append(together)
            for other in self._under_way:
                other[0] = max(other[0], together[0])
            return together

    def put(self, rows: Sequence[Any], sealed: list[bytes]) -> None:
        """Queue one chunk (waits while a chunk per writer is still queued)."""
        if self._error is not None:
            raise self._error
        self._queue.put((rows, sealed))

    def close(self) -> int:
        """Wait for the queued chunks to be written; how many values changed."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
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
    came first, else None)``. Each chunk is read and resealed while the previous ones are written."""
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
