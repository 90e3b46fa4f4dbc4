"""A job's lease behind a backlog of queued jobs, beside the same lease with nothing waiting.

A lease (:func:`infra.jobs.lease`, one job; :func:`infra.jobs.lease_together`, a payment method's two
rails) finds its jobs by id, as a prepared statement on a generic plan (the platform's sessions force
one). Its plan is made from the statistics of the last ``ANALYZE``, which on a server is often taken
at a quiet moment, with hardly a job waiting; a burst (webhook deliveries, an account updater's
chunks) then queues thousands of jobs before the next one. A plan that looked the ids up through the
partial index of takeable jobs (``ix_jobs_takeable``) instead of the primary key walked every job of
the backlog due by now, for each lease.

Set-up, on a fresh database: ``--history`` (50,000) settled jobs, ``ANALYZE`` with none waiting, then
the jobs to lease (queued, due). Then, one after the other (the backlog's deleted rows would stay in
the index for the rounds after it, so the two are not alternated):

- reference: ``--rounds`` (3) rounds of ``--leases`` (300) leases of one job and as many of two jobs
  together, with no other job waiting;
- platform: ``--backlog`` (20,000) jobs of another kind queued and due, then the same rounds.

Printed and published: the p50 wall time of a lease of each kind (medians of the rounds) with the
backlog and without, and their ratio (goal: at most 2, a lease's cost not growing with the backlog).
Every lease must take its jobs. Run from the repository root::

    .venv/bin/python benchmarks/lease_backlog.py [--backlog 20000] [--leases 300] [--rounds 3]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import time
import uuid
from collections.abc import Callable, Iterator

from benchmarks import common
from benchmarks.dashboard import Figure

DEFAULT_DATABASE = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench_lease_backlog"
KIND, BACKLOG_KIND = "bench.lease", "bench.backlog"
ONE, TWO = "lease of one job", "lease of two jobs together"
GOAL = 2.0

_INSERT = (
    "INSERT INTO jobs (id, kind, status, attempts, max_attempts, due_at, created_at, updated_at)"
    " SELECT gen_random_uuid(), :kind, :status, 0, 6, now() - interval '1 minute', now(), now()"
    " FROM generate_series(1, :count)"
)


def timed_leases(lease: Callable[[], bool], count: int) -> list[float]:
    """``count`` runs of ``lease``; their wall times in ms. SystemExit when one took nothing."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        if not lease():
            raise SystemExit("a lease took nothing: the benchmark's jobs are not takeable")
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=20_000, help="jobs queued ahead of the leases")
    parser.add_argument("--history", type=int, default=50_000, help="settled jobs in the table at the ANALYZE")
    parser.add_argument("--leases", type=int, default=300, help="leases of each kind per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--database-url", default=os.environ.get("BENCH_LEASE_DATABASE_URL", DEFAULT_DATABASE))
    args = parser.parse_args()
    common.recreate_database(args.database_url)
    common.adopt_env({"TESSERA_DATABASE_URL": args.database_url})

    from sqlalchemy import text

    from infra import jobs
    from storage.db import get_autocommit_engine, session_scope

    def run_sql(sql: str, **params) -> list:
        with session_scope() as session:
            result = session.execute(text(sql), params)
            return list(result) if result.returns_rows else []

    run_sql(_INSERT, kind="bench.history", status="succeeded", count=args.history)
    common.vacuum_analyze(args.database_url, "jobs")  # statistics of a quiet moment: nothing waits
    per_phase = args.rounds * args.leases * 3  # one job, then two, per lease of each kind
    run_sql(_INSERT, kind=KIND, status="queued", count=2 * per_phase)
    ids: Iterator[uuid.UUID] = iter(
        row[0] for row in run_sql("SELECT id FROM jobs WHERE kind = :kind ORDER BY id", kind=KIND)
    )

    def one() -> bool:
        return jobs.lease(next(ids), "bench:owner", lease_seconds=60) is not None

    def two() -> bool:
        pair = [next(ids), next(ids)]
        return len(jobs.lease_together(pair, "bench:owner", lease_seconds=60)) == 2

    p50s: dict[tuple[str, bool], list[float]] = {}
    for backlog in (False, True):
        if backlog:
            run_sql(_INSERT, kind=BACKLOG_KIND, status="queued", count=args.backlog)
        for number in range(1, args.rounds + 1):
            for name, lease in ((ONE, one), (TWO, two)):
                p50 = common.median(timed_leases(lease, args.leases))
                p50s.setdefault((name, backlog), []).append(p50)
                where = f"behind {args.backlog:,} queued jobs" if backlog else "nothing waiting"
                print(f"round {number}, {name}, {where}: p50 {p50:.3f} ms", flush=True)
    engine = get_autocommit_engine()
    if engine is not None:
        engine.dispose()
    medians = {key: common.median(values) for key, values in p50s.items()}
    common.print_table(
        f"Lease p50, medians of {args.rounds} rounds of {args.leases}"
        f" (load average {os.getloadavg()[0]:.2f} at the end)",
        ["lease", "nothing waiting ms", f"behind {args.backlog:,} ms", "ratio"],
        [
            (
                name,
                round(medians[name, False], 3),
                round(medians[name, True], 3),
                round(common.ratio(medians[name, True], medians[name, False]), 2),
            )
            for name in (ONE, TWO)
        ],
    )
    common.publish(
        "lease_backlog",
        [
            Figure(
                "lease_backlog",
                f"{name} p50 behind {args.backlog:,} queued jobs",
                medians[name, True],
                "ms",
                "nothing waiting",
                medians[name, False],
                f"ratio ≤ {GOAL:g}",
            )
            for name in (ONE, TWO)
        ],
    )
    return 0


if __name__ == "__main__":
    common.run_main(main)
