"""A rotation's sweep through one column of sealed values (:func:`domain.keys.service.rotate_pass`):
chunks read without locks and resealed (:func:`storage.sealed.reseal_values`) while threads of their
own write the previous chunks with the rotation's progress (:data:`WRITERS` at once: the database's
side of a write, an ``UPDATE`` of the chunk's rows, is most of the work and runs on another core than
the reading), and the pause that yields to the tenants' own work (:class:`Throttle`).

Measured on 300,000 tokens (chunks of 500 values): reading ~25 µs per value (an index scan in key
order), resealing ~5 µs, writing ~20-40 µs (a HOT update: ``tokens`` pages keep room for it, migration
``0016_tokens_fillfactor``); about 29,000 values/s on two cores with nothing else running."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import update
from sqlmodel import col

from storage.crypto import get_keyring
from storage.db import name_transaction, others_at_work, session_scope
from storage.models import KeyRotation
from storage.sealed import SealedColumn, key_of, reseal_values, stale_rows, write_resealed

#: The ``application_name`` of a rotation's database transactions, which the :class:`Throttle`'s look
#: at the database's other sessions leaves out.
ROTATION_SESSIONS = "tessera-key-rotation"
#: The rotation's share of the time while other sessions are at work in the database: after each
#: write, a pause of ``1 / BUSY_SHARE - 1`` times the write's time (three times at a quarter).
BUSY_SHARE = 0.25
#: How long one sight of another session's statement keeps the rotation to :data:`BUSY_SHARE`
#: (seconds), and the longest pause after one chunk.
BUSY_HOLD_SECONDS = 1.0
MAX_PAUSE_SECONDS = 0.5
#: Chunks written at once, each by a thread and a database connection of its own.
WRITERS = 2


class Throttle:
    """The pause after each written chunk of a rotation: none while the database serves no one
    else, and while it does, a pause giving the rotation :data:`BUSY_SHARE` of the time.

    Each chunk's read looks at the database's other sessions (:meth:`observe`, the count of
    :func:`storage.db.others_at_work`): a statement of anyone else's running at that instant (the
    tenants' requests, other jobs) makes the rotation yield for :data:`BUSY_HOLD_SECONDS` from then
    on. Measured with ``benchmarks/key_rotation.py`` on two cores: chunk writes at full speed beside
    ``POST /tokenize`` (8 clients) raised its p99 about 2.7 times (the rotation's processes took the
    CPU the api's needed); a quarter of the time, 1.7 times (1,000,000 tokens: 10,800 values/s under
    that load, 40,000 alone). A pause holds every writer of the sweep
    (:meth:`wait`), and pauses of several writers add up. Safe to use from several threads;
    ``clock`` is ``time.monotonic`` but in tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._until = 0.0
        self._busy_until = float("-inf")
        self.paused = 0.0

    def observe(self, others_at_work: int) -> None:
        """Note how many other sessions of the database ran a statement when a chunk was read."""
        if others_at_work > 0:
            with self._lock:
                self._busy_until = self._clock() + BUSY_HOLD_SECONDS

    @property
    def busy(self) -> bool:
        """Whether another session was seen at work within the last :data:`BUSY_HOLD_SECONDS`."""
        return self._clock() < self._busy_until

    def pause_after(self, seconds: float) -> float:
        """The pause (seconds) after a chunk written in ``seconds``: 0 unless :attr:`busy`, else
        ``seconds * (1 / BUSY_SHARE - 1)`` up to :data:`MAX_PAUSE_SECONDS`; also added to
        :attr:`paused`, and :meth:`wait` holds every writer until it has passed."""
        if not self.busy:
            return 0.0
        pause = min(MAX_PAUSE_SECONDS, seconds * (1 / BUSY_SHARE - 1))
        with self._lock:
            now = self._clock()
            until = max(self._until, now) + pause  # pauses of several writers add up
            self.paused += until - max(self._until, now)
            self._until = until
        return pause

    def wait(self) -> None:
        """Sleep until the pauses decided so far have passed (before a chunk's write)."""
        while (left := self._until - self._clock()) > 0:
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
                began = time.perf_counter()
                with session_scope() as session:
                    name_transaction(session, ROTATION_SESSIONS)
                    changed = write_resealed(session, self._spec, self._tenant_id, *chunk)
                    session.execute(
                        update(KeyRotation)
                        .where(col(KeyRotation.id) == self._rotation_id)
                        .values(done=col(KeyRotation.done) + changed)
                    )
                took = time.perf_counter() - began
                with self._lock:
                    self.changed += changed
                self._throttle.pause_after(took)
            except Exception as exc:  # noqa: BLE001 - raised again in the reading thread (put, close)
                self._error = exc

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
                name_transaction(session, ROTATION_SESSIONS)
                throttle.observe(others_at_work(session, ROTATION_SESSIONS))
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
