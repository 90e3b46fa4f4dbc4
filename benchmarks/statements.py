"""CPU per prepared statement on the driver's cursor (``storage.driver``) beside SQLAlchemy's execution.

Both run the same statement built once (:func:`storage.db.server_prepared`), a job row read by its id
with its 19 columns (the columns a lease returns), as a server-side prepared statement on a pooled
autocommit connection (:func:`storage.db.get_autocommit_engine`), reading the row as
a mapping:

- platform: :func:`storage.db.execute_once_more_on_disconnect`, which runs it on the driver;
- reference: the same statement through SQLAlchemy's ``Connection.execute`` on a connection of the
  same engine, as that function ran it before (``engine.connect()``, ``execute``,
  ``.mappings().first()``).

``--statements`` per round (3,000), ``--rounds`` rounds (5) alternating the two. Printed and published:
the thread's CPU time per statement (``time.thread_time``) and the wall time, medians of the rounds,
and their ratio. The rows read are compared: a difference fails the run.

Run from the repository root::

    .venv/bin/python benchmarks/statements.py [--statements 3000] [--rounds 5] [--database-url URL]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import datetime as dt
import time
import uuid
from collections.abc import Callable

from benchmarks import common

PLATFORM, SQLALCHEMY = "on the driver (storage.driver)", "SQLAlchemy's Connection.execute"
DEFAULT_DATABASE = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench_statements"


def one_round(run: Callable[[], object], statements: int) -> tuple[float, float]:
    """``statements`` runs of ``run``; returns (CPU, wall) microseconds per run."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(statements):
        run()
    return (time.thread_time() - cpu) / statements * 1e6, (time.perf_counter() - wall) / statements * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--statements", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_STATEMENTS_DATABASE_URL", DEFAULT_DATABASE))
    args = parser.parse_args()
    common.recreate_database(args.database_url)
    common.adopt_env({"TESSERA_DATABASE_URL": args.database_url})

    from sqlalchemy import bindparam, select

    from storage.db import execute_durable, execute_once_more_on_disconnect, get_autocommit_engine, server_prepared
    from storage.models import Job
    from storage.types import table_of

    jobs = table_of(Job)
    now = dt.datetime.now(dt.UTC)
    job_id = uuid.uuid4()
    execute_durable(
        jobs.insert().values(
            id=job_id,
            kind="bench.statements",
            subject_type="bench",
            subject_id=str(uuid.uuid4()),
            status="succeeded",
            attempts=1,
            max_attempts=6,
            due_at=now,
            result={"status": "active", "network_token_id": str(uuid.uuid4())},
            created_at=now,
            updated_at=now,
        )
    )
    statement = server_prepared(select(*jobs.columns).where(jobs.c.id == bindparam("job_id", type_=jobs.c.id.type)))
    params = {"job_id": job_id}
    engine = get_autocommit_engine()
    assert engine is not None

    def through_sqlalchemy():
        with engine.connect() as connection:
            return connection.execute(statement, params).mappings().first()

    variants = {
        PLATFORM: lambda: execute_once_more_on_disconnect(engine, statement, params),
        SQLALCHEMY: through_sqlalchemy,
    }
    if dict(variants[PLATFORM]()) != dict(variants[SQLALCHEMY]()):
        raise SystemExit("the two paths read different rows")
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for number in range(1, args.rounds + 1):
        for name, run in variants.items():
            figures[name].append(one_round(run, args.statements))
            print(f"round {number}, {name}: {figures[name][-1][0]:.0f} us CPU per statement", flush=True)
    engine.dispose()
    common.publish_cpu_and_wall(
        "statements",
        figures,
        platform=PLATFORM,
        reference=SQLALCHEMY,
        per="prepared statement",
        title=f"Per statement, medians of {args.rounds} rounds of {args.statements:,}",
    )
    return 0


if __name__ == "__main__":
    common.run_main(main)
