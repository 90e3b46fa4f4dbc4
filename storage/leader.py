"""One holder at a time across processes and hosts: the leader lock of a role that must run once
(beat's scheduler).

On PostgreSQL the lock is a session-level advisory lock (``pg_try_advisory_lock``) held on a connection
of its own, opened with TCP keepalives: it is released the moment its process dies (the server sees the
socket close) or, when its host vanishes, once the keepalives give up (about 25 s); a holder that
cannot reach the database any more gives the lock up too, so two holders never act at once. On the
embedded SQLite database (one host) it is an exclusive ``flock`` on a file of the data dir, released
by the kernel when the process ends.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.pool import NullPool

log = logging.getLogger("tessera.leader")

#: TCP keepalives of the lock's connection (libpq): a vanished holder's lock is freed within
#: ``idle + interval * count`` seconds.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


class LeaderLock:
    """The lock ``name`` for the database at ``database_url`` (file locks in ``data_dir`` on SQLite).

    :meth:`hold` is called periodically (each scheduler tick): it takes the lock when it is free and
    checks that a lock already held still is. Not thread-safe: one caller per instance."""

    def __init__(self, name: str, *, database_url: str, data_dir: Path) -> None:
        self.name = name
        self._url = database_url
        self._path = data_dir / f"{name.replace(':', '_')}.lock"
        self._connection: Connection | None = None
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        """True while this instance holds the lock (as of the last :meth:`hold`)."""
        return self._connection is not None or self._file is not None

    def hold(self) -> bool:
        """Take the lock if it is free, or check that it is still ours; True when held. Never raises:
        a database that does not answer means not held (and a lock held on it is given up)."""
        if self._url.startswith("postgresql"):
            return self._hold_advisory()
        return self._hold_file()

    def release(self) -> None:
        """Give the lock up (closing its connection or file)."""
        if self._connection is not None:
            try:
                self._connection.close()
            except Exception:
                log.debug("closing the %s lock's connection failed", self.name, exc_info=True)
            self._connection = None
        if self._file is not None:
            self._file.close()  # the flock goes with the descriptor
            self._file = None

    def _hold_advisory(self) -> bool:
        try:
            if self._connection is not None:
                self._connection.execute(text("SELECT 1"))
                return True
            engine = create_engine(self._url, poolclass=NullPool, connect_args=dict(KEEPALIVES))
            connection = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            taken = connection.execute(
                text("SELECT pg_try_advisory_lock(hashtext(:name))"), {"name": f"tessera:{self.name}"}
            ).scalar_one()
            if not taken:
                connection.close()
                return False
            self._connection = connection
            return True
        except Exception:
            log.warning("the %s lock cannot be checked; not holding it", self.name, exc_info=True)
            self.release()
            return False

    def _hold_file(self) -> bool:
        if self._file is not None:
            return True
        self._path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self._path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return True
