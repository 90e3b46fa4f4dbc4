"""Webhook deliveries per second, beside bare no-op Celery tasks on the same broker.

Platform: a tenant with one webhook subscribed to ``token.created`` that points at a local receiver
(``benchmarks/receiver.py``), a real ``tessera worker --concurrency 2``; ``--events`` (10,000)
``token.created`` events are emitted with ``domain.webhooks.events.emit``, ``--batch`` (500) per
transaction (the delivery tasks go out when each transaction commits), on default settings: the lone
tenant's fairness slots (``TESSERA_WEBHOOK_TENANT_SLOTS``) never hold it back while no other tenant
waits (``--tenant-slots N`` sets them). Goal: at least the rate of the bare no-op tasks (ratio >= 1.0;
a burst of 3,000 events: ``--events 3000``). Measured: from the first commit to the arrival of the
last distinct ``webhook-id`` at the receiver. Checked: the receiver saw exactly ``--events`` distinct
message ids and every delivery ended ``succeeded``.

Reference: ``benchmarks/noop_app.py`` (same broker, same reliability settings) with its own
``celery worker --concurrency 2``; ``--events`` ``apply_async`` calls, timed from the first call until
the tasks' Redis counter reaches the count.

The two alternate (no-op, platform, no-op, platform for ``--rounds 2``); the medians and their ratio
are printed.

Fairness, a newcomer during a flood: after the rounds, one more burst of ``--events`` by the same
tenant A, emitted in one transaction (its batch messages all queued at once when it commits: the
worst case for a FIFO), and just after its commit one event of a second tenant B whose webhook points
at a receiver of its own: B's delivery latency (from its commit to its arrival) is measured while A's
burst is queued ahead of it in the broker, on default settings. Goal: at most 2 s
(``infra/fairness.py``: B's delivery is taken in place of A's by the first batch message a worker
takes). Checked: A's burst still arrives whole. Run from the repository root::

    .venv/bin/python benchmarks/webhooks.py [--events 10000] [--batch 500] [--rounds 2]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import time
import uuid
from dataclasses import dataclass, field

from benchmarks import common
from benchmarks.receiver import Receiver

WARMUP = 20  # items each worker handles before the measurements (its pool processes are then warm)
PLATFORM, NOOP = "platform webhooks", "no-op Celery tasks"


@dataclass
class Run:
    """One measured round of one variant."""

    variant: str
    round: int
    items: int
    seconds: float
    publish_seconds: float
    cores: dict[str, float]
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return common.ratio(self.items, self.seconds)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000, help="events (and no-op tasks) per round")
    parser.add_argument("--batch", type=int, default=500, help="events emitted per transaction")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each variant, alternating")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes of each worker")
    parser.add_argument(
        "--tenant-slots", type=int, default=None, help="TESSERA_WEBHOOK_TENANT_SLOTS (default: the platform's)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds one round may take")
    common.add_service_options(parser)
    return parser.parse_args(argv)


# ---- the platform --------------------------------------------------------------------------------


def emit_events(tenant_id: uuid.UUID, count: int, batch: int) -> tuple[float, float]:
    """Emit ``count`` ``token.created`` events, ``batch`` per transaction; returns the wall-clock times
    just before the first commit and just after the last one."""
    from domain.webhooks.events import emit
    from storage.db import session_scope

    first_commit = None
    for start in range(0, count, batch):
        with session_scope() as session:
            for _ in range(min(batch, count - start)):
                data = {"token": {"id": str(uuid.uuid4()), "type": "card"}}
                emit(session, tenant_id=tenant_id, type="token.created", data=data, trace_id=None)
            if first_commit is None:
                first_commit = time.time()
        # leaving the block committed the transaction and sent its delivery tasks
    return first_commit, time.time()


def delivery_statuses() -> dict[str, int]:
    """How many deliveries are in each public status (derived from their jobs' statuses)."""
    from sqlalchemy import func
    from sqlmodel import select

    from storage.db import session_scope
    from storage.models import DELIVERY_STATUS, Job, WebhookDelivery

    with session_scope() as session:
        rows = session.exec(
            select(Job.status, func.count()).join(WebhookDelivery, WebhookDelivery.id == Job.id).group_by(Job.status)
        ).all()
    statuses: dict[str, int] = {}
    for job_status, count in rows:
        statuses[DELIVERY_STATUS[job_status]] = statuses.get(DELIVERY_STATUS[job_status], 0) + count
    return statuses


def settled(expected: int, timeout: float = 60) -> dict[str, int]:
    """The delivery statuses once ``expected`` rows exist and none is pending (or after ``timeout``:
    the last delivery's outcome is recorded just after the receiver answers it)."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = delivery_statuses()
        done = sum(statuses.values()) >= expected and not statuses.get("pending")
        if done or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


def run_platform(
    args, tenant_id, receiver: Receiver, meter: common.CpuMeter, round_no: int, watched: list[common.Child]
) -> Run:
    """One round of deliveries, checked afterwards."""
    receiver.reset()
    meter.start()
    first_commit, last_commit = emit_events(tenant_id, args.events, args.batch)
    try:
        seen = receiver.wait_for(args.events, timeout=args.timeout, children=watched)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; delivery rows by status: {delivery_statuses()}") from None
    cores = meter.stop()
    return Run(
        PLATFORM,
        round_no,
        args.events,
        seen["last_new_at"] - first_commit,
        last_commit - first_commit,
        cores,
        {"distinct": seen["distinct"], "duplicates": seen["requests"] - seen["distinct"]},
    )


def run_newcomer(args, flooder, newcomer, receivers: tuple[Receiver, Receiver], watched: list[common.Child]) -> float:
    """Tenant ``flooder``'s burst of ``--events`` in one transaction, then one event of tenant
    ``newcomer`` (its webhook at the second receiver) as soon as the burst is committed; returns the
    newcomer's delivery latency (seconds from its commit to its arrival) once the whole burst arrived."""
    flood, alone = receivers
    flood.reset()
    alone.reset()
    emit_events(flooder, args.events, args.events)
    _first, committed = emit_events(newcomer, 1, 1)
    seen = alone.wait_for(1, timeout=args.timeout, children=watched)
    latency = seen["last_new_at"] - committed
    print(f"newcomer: delivered {latency:.2f} s after its commit, behind a burst of {args.events:,}", flush=True)
    flood.wait_for(args.events, timeout=args.timeout, children=watched)
    return latency


# ---- the reference -------------------------------------------------------------------------------


def run_noop(args, meter: common.CpuMeter, round_no: int, watched: list[common.Child], count: int | None = None) -> Run:
    """``count`` (default ``--events``) no-op tasks sent one by one and drained by the no-op worker."""
    import redis

    from benchmarks import noop_app

    count = count or args.events
    client = redis.Redis.from_url(args.redis_url)
    try:
        client.set(noop_app.DONE_KEY, 0)
        meter.start()
        started = time.time()
        for _ in range(count):
            noop_app.noop.apply_async()
        published = time.time()
        common.wait_until(
            lambda: int(client.get(noop_app.DONE_KEY) or 0) >= count,
            timeout=args.timeout,
            what=f"{count} no-op tasks",
            interval=0.01,
            children=watched,
        )
        finished = time.time()
        cores = meter.stop()
    finally:
        client.close()
    return Run(NOOP, round_no, count, finished - started, published - started, cores)


# ---- the run -------------------------------------------------------------------------------------


def meter_for(worker: common.Child, receiver: Receiver | None = None) -> common.CpuMeter:
    """Cores used by the worker, this process (the producer), the receiver, PostgreSQL and Redis."""
    groups = {"worker": common.process_tree(worker.pid), "producer": common.this_process()}
    if receiver is not None:
        groups["receiver"] = common.process_tree(receiver.child.pid)
    groups["postgres"] = common.processes_named("postgres")
    groups["redis"] = common.processes_named("redis-server")
    return common.CpuMeter(groups)


def report(
    runs: list[Run],
    statuses: dict[str, int],
    expected_rows: int,
    *,
    events: int,
    default_slots: bool,
    newcomer_seconds: float,
) -> list[common.Figure] | None:
    """Print the tables; the headline figure (median deliveries/s beside the no-op tasks/s), None when
    a check failed."""
    columns = ("worker", "producer", "receiver", "postgres", "redis")
    common.print_table(
        "Rounds (cores = CPU seconds per second; postgres and redis count every client of theirs)",
        ("round", "variant", "items", "seconds", "items/s", "publish s", *(f"{c} cores" for c in columns)),
        [
            (
                r.round,
                r.variant,
                r.items,
                r.seconds,
                r.per_second,
                r.publish_seconds,
                *(r.cores.get(c, float("nan")) for c in columns),
            )
            for r in runs
        ],
    )
    platform = common.median(r.per_second for r in runs if r.variant == PLATFORM)
    noop = common.median(r.per_second for r in runs if r.variant == NOOP)
    common.print_table(
        "Medians",
        ("figure", "per second"),
        [
            ("webhook deliveries/s", platform),
            ("no-op tasks/s", noop),
            ("ratio deliveries / no-op tasks", common.ratio(platform, noop)),
            (f"newcomer's delivery latency during a burst of {events:,}, seconds (goal ≤ 2)", newcomer_seconds),
        ],
    )
    checks = [
        (f"receiver saw exactly {r.items:,} distinct message ids in round {r.round}", r.notes["distinct"] == r.items)
        for r in runs
        if r.variant == PLATFORM
    ]
    duplicates = sum(r.notes["duplicates"] for r in runs if r.variant == PLATFORM)
    checks.append(
        (
            f"every delivery row succeeded ({statuses.get('succeeded', 0):,} of {expected_rows:,}: {statuses})",
            statuses == {"succeeded": expected_rows},
        )
    )
    common.print_table(
        "Checks",
        ("check", "result"),
        [
            *((text, "ok" if ok else "FAILED") for text, ok in checks),
            ("duplicate deliveries (same message id twice; allowed, counted)", duplicates),
        ],
    )
    if not all(ok for _text, ok in checks):
        return None
    settings = ", default settings" if default_slots else ""
    name = f"webhook deliveries/s, a burst of {events:,} events{settings}"
    newcomer = f"another tenant's delivery during a burst of {events:,} events{settings}"
    return [
        common.Figure("webhooks", name, platform, "/s", NOOP, noop, goal="ratio ≥ 1.0"),
        common.Figure("webhooks", newcomer, newcomer_seconds * 1000, "ms", goal="≤ 2,000 ms"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # One tenant floods on purpose, alone: fairness takes nothing from it (no beat runs, so a postponed
    # delivery would only arrive through the timeout and fail the run).
    slots = {} if args.tenant_slots is None else {"TESSERA_WEBHOOK_TENANT_SLOTS": str(args.tenant_slots)}
    with common.fresh_platform(
        args,
        "tessera-bench-webhooks-",
        TESSERA_ALLOW_PRIVATE_DESTINATIONS="true",
        BENCH_NOOP_BROKER_URL=args.redis_url,
        **slots,
    ) as scratch:
        from benchmarks import noop_app  # reads BENCH_NOOP_BROKER_URL when imported

        tenant = common.make_tenant("bench-webhooks")
        with common.Children(scratch) as children:
            receiver = Receiver(children)
            common.subscribe_webhook(tenant.tenant_id, receiver.url)
            newcomer, newcomer_receiver = common.make_tenant("bench-webhooks-newcomer"), Receiver(children)
            common.subscribe_webhook(newcomer.tenant_id, newcomer_receiver.url)
            worker = common.start_platform_worker(children, args.concurrency)
            noop_worker = children.start(
                "noop-worker",
                [
                    common.executable("celery"),
                    "-A",
                    "benchmarks.noop_app",
                    "worker",
                    "--concurrency",
                    str(args.concurrency),
                    "-Q",
                    noop_app.QUEUE,
                    "--loglevel",
                    "WARNING",
                ],
            )
            watched = [worker, noop_worker]
            print("warming up the workers", flush=True)
            emit_events(tenant.tenant_id, WARMUP, WARMUP)
            receiver.wait_for(WARMUP, timeout=120, children=watched)
            run_noop(args, meter_for(noop_worker), 0, watched, count=WARMUP)
            runs = []
            for round_no in range(1, args.rounds + 1):
                runs.append(run_noop(args, meter_for(noop_worker), round_no, watched))
                print(f"round {round_no}: {runs[-1].per_second:,.0f} no-op tasks/s", flush=True)
                runs.append(
                    run_platform(args, tenant.tenant_id, receiver, meter_for(worker, receiver), round_no, watched)
                )
                print(f"round {round_no}: {runs[-1].per_second:,.0f} deliveries/s", flush=True)
                common.warn_if_shared(args.redis_url)
            newcomer_seconds = run_newcomer(
                args, tenant.tenant_id, newcomer.tenant_id, (receiver, newcomer_receiver), watched
            )
            expected_rows = WARMUP + (args.rounds + 1) * args.events + 1
            statuses = settled(expected_rows)
    figures = report(
        runs,
        statuses,
        expected_rows,
        events=args.events,
        default_slots=args.tenant_slots is None,
        newcomer_seconds=newcomer_seconds,
    )
    if figures is None:
        return 1
    common.publish("webhooks", figures)
    return 0


if __name__ == "__main__":
    common.run_main(main)
