"""The database URL in ``TESSERA_URL`` as ``PG*`` variable assignments for a POSIX shell's ``eval``:
``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGPASSWORD``, ``PGDATABASE`` (only those the URL has), each
exported. pg_dump and pg_restore read them, so no password is ever on a command line (``ps`` shows
those). Used by ``scripts/backup.sh`` and ``scripts/restore.sh``; any SQLAlchemy driver suffix
(``postgresql+psycopg2``) is accepted, other schemes refused (exit status 2)."""

from __future__ import annotations

import os
import shlex
import sys
from urllib.parse import unquote, urlsplit


def assignments(url: str) -> str:
    """``export PGHOST=...`` lines for ``url`` (``postgresql[+driver]://user:password@host:port/name``)."""
    parts = urlsplit(url)
    if parts.scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL (scheme {parts.scheme!r})")
    values = {
        "PGHOST": parts.hostname,
        "PGPORT": str(parts.port) if parts.port else None,
        "PGUSER": unquote(parts.username) if parts.username else None,
        "PGPASSWORD": unquote(parts.password) if parts.password else None,
        "PGDATABASE": unquote(parts.path.lstrip("/")) or None,
    }
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in values.items() if value)


if __name__ == "__main__":
    try:
        print(assignments(os.environ["TESSERA_URL"]))
    except (KeyError, ValueError) as exc:
        print(f"pg_env: {exc}", file=sys.stderr)
        sys.exit(2)
