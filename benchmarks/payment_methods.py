"""Payment method creates per second (two rails each), p50/p99, beside the bare Celery round trip.

Platform: ``tessera api``, ``tessera worker --concurrency 2`` and ``tessera sandbox`` as child
processes on a fresh database and Redis (the broker); one test tenant and one visa card token
(4242424242424242: rails ``agentic-token``/``vic`` and ``spt``/``psp``, both enabled by the sandbox).
``--creates`` (400) ``POST /agentic/payment-methods`` are sent by ``--concurrency`` (4) client threads;
each create records the payment method and two enrollment jobs, the worker runs the two jobs (one
provider call each, on the worker's thread pool of the ``providers`` queue) and the handler, woken
by the jobs' outcome messages, answers once both finished. Timed per request; checked: every
answer is 201 with both rails ``enabled``.

Reference: the bare Celery round trip on the same Redis: ``apply_async().get()`` of a no-op task
with a Redis result backend (the app :data:`roundtrip` below, its own ``celery worker --concurrency
2``), sent by the same number of threads. That is the floor of "enqueue a job and wait for its
outcome"; a create does two of them in parallel plus its database work and two provider calls.

The two alternate for ``--rounds`` (2); medians are printed, with the ratio of the p50 latencies
(goal with one client, ``--concurrency 1``: at most 2.5). Run from the repository root::

    .venv/bin/python benchmarks/payment_methods.py [--creates 400] [--concurrency 4] [--rounds 2]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from celery import Celery

from benchmarks import common

ROUNDTRIP_URL = os.environ.get("BENCH_ROUNDTRIP_URL", common.DEFAULT_REDIS_URL)
ROUNDTRIP_QUEUE = "bench-roundtrip"
VISA = "4242424242424242"
WARMUP = 20
PLATFORM, ROUNDTRIP = "payment method creates", "Celery round trips"

#: The reference app: the same broker, a Redis result backend, the platform's reliability settings.
roundtrip = Celery("bench_roundtrip")
roundtrip.conf.update(
    broker_url=ROUNDTRIP_URL,
    result_backend=ROUNDTRIP_URL,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 3600},
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=ROUNDTRIP_QUEUE,
    worker_hijack_root_logger=False,
)


@roundtrip.task(name="bench.roundtrip_noop")
def noop() -> None:
    """Do nothing; the result backend carries the (empty) outcome back."""


@dataclass
class Run:
    """One measured round of one variant: per-item latencies (s) and the wall time."""

    variant: str
    round: int
    latencies: list[float]
    seconds: float
    failures: int = 0
    cores: dict[str, float] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        """Items per second over the round's wall time."""
        return common.ratio(len(self.latencies), self.seconds)

    def ms(self, q: float) -> float:
        """The ``q``-th percentile latency in milliseconds."""
        return common.percentile(self.latencies, q) * 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=400, help="creates (and round trips) per round")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads sending at once")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each variant, alternating")
    parser.add_argument("--worker-concurrency", type=int, default=2, help="processes of each worker")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one round may take")
    common.add_service_options(parser)
    return parser.parse_args(argv)


# ---- the platform --------------------------------------------------------------------------------


class Client:
    """Just enough HTTP for the benchmark (urllib3 pool shared by the threads)."""

    def __init__(self, base_url: str, api_key: str, threads: int):
        import urllib3

        from config.settings import get_settings

        self.base_url = base_url
        self.headers = {get_settings().header("API-KEY"): api_key, "Content-Type": "application/json"}
        self.http = urllib3.PoolManager(maxsize=threads + 2, retries=False, timeout=urllib3.Timeout(60))

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """POST ``body`` as JSON: ``(status, parsed answer)``."""
        answer = self.http.request("POST", self.base_url + path, body=json.dumps(body).encode(), headers=self.headers)
        return answer.status, json.loads(answer.data) if answer.data else None


def run_platform(
    args, client: Client, token_id: str, round_no: int, count: int | None = None, meter: common.CpuMeter | None = None
) -> Run:
    """``count`` creates sent by ``--concurrency`` threads; each answer checked."""
    count = count or args.creates
    body = {"source": {"type": "svc_card_token", "token_id": token_id}, "consumer": {"email": "bench@example.com"}}

    def one(_):
        started = time.perf_counter()
        status, answer = client.post("/agentic/payment-methods", body)
        elapsed = time.perf_counter() - started
        ok = status == 201 and [r["status"] for r in answer["rails"]] == ["enabled", "enabled"]
        return elapsed, ok

    if meter:
        meter.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, range(count)))
    seconds = time.perf_counter() - started
    return Run(
        PLATFORM,
        round_no,
        [r[0] for r in results],
        seconds,
        failures=sum(1 for r in results if not r[1]),
        cores=meter.stop() if meter else {},
    )


def run_roundtrip(args, round_no: int, count: int | None = None, meter: common.CpuMeter | None = None) -> Run:
    """``count`` ``apply_async().get()`` round trips sent by ``--concurrency`` threads."""
    count = count or args.creates

    def one(_):
        started = time.perf_counter()
        noop.apply_async().get(timeout=60)
        return time.perf_counter() - started

    if meter:
        meter.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        latencies = list(pool.map(one, range(count)))
    seconds = time.perf_counter() - started
    return Run(ROUNDTRIP, round_no, latencies, seconds, cores=meter.stop() if meter else {})


# ---- the run -------------------------------------------------------------------------------------


CORE_GROUPS = ("api", "worker", "sandbox", "producer", "postgres", "redis")


def meter_for(children: dict[str, common.Child]) -> common.CpuMeter:
    """Cores used by each child process tree, this process (the clients), PostgreSQL and Redis."""
    groups = {name: common.process_tree(child.pid) for name, child in children.items()}
    groups["producer"] = common.this_process()
    groups["postgres"] = common.processes_named("postgres")
    groups["redis"] = common.processes_named("redis-server")
    return common.CpuMeter(groups)


def report(runs: list[Run], concurrency: int) -> list[common.Figure] | None:
    """Print the tables; the headline figures (median create p50 and creates/s beside the Celery round
    trip's; goal with one client: p50 ratio at most 2.5), None unless every create answered 201 with
    both rails enabled."""
    common.print_table(
        "Rounds (p50/p99 per request; cores = CPU seconds per second; 'worker' is the platform worker for "
        "creates and the no-op worker for round trips)",
        (
            "round",
            "variant",
            "items",
            "seconds",
            "items/s",
            "p50 ms",
            "p99 ms",
            "failures",
            *(f"{g} cores" for g in CORE_GROUPS),
        ),
        [
            (
                r.round,
                r.variant,
                len(r.latencies),
                r.seconds,
                r.per_second,
                r.ms(50),
                r.ms(99),
                r.failures,
                *(r.cores.get(g, float("nan")) for g in CORE_GROUPS),
            )
            for r in runs
        ],
    )
    platform = [r for r in runs if r.variant == PLATFORM]
    reference = [r for r in runs if r.variant == ROUNDTRIP]
    creates = common.median(r.per_second for r in platform)
    trips = common.median(r.per_second for r in reference)
    create_p50 = common.median(r.ms(50) for r in platform)
    trip_p50 = common.median(r.ms(50) for r in reference)
    common.print_table(
        "Medians",
        ("figure", "value"),
        [
            ("payment method creates/s (2 rails each)", creates),
            ("create p50 ms", create_p50),
            ("create p99 ms", common.median(r.ms(99) for r in platform)),
            ("Celery round trips/s", trips),
            ("round trip p50 ms", trip_p50),
            ("round trip p99 ms", common.median(r.ms(99) for r in reference)),
            ("ratio creates / round trips", common.ratio(creates, trips)),
            ("p50 ratio create / round trip (goal <= 2.5)", common.ratio(create_p50, trip_p50)),
        ],
    )
    failures = sum(r.failures for r in platform)
    common.print_table(
        "Checks",
        ("check", "result"),
        [("every create answered 201 with both rails enabled", "ok" if not failures else f"FAILED ({failures})")],
    )
    if failures:
        return None
    clients = f"{concurrency} client{'s' if concurrency > 1 else ''}"
    return [
        common.Figure(
            "payment_methods",
            f"create p50 (2 rails), {clients}",
            create_p50,
            "ms",
            "Celery round trip",
            trip_p50,
            "ratio ≤ 2.5" if concurrency == 1 else None,
        ),
        common.Figure("payment_methods", f"creates/s (2 rails), {clients}", creates, "/s", "Celery round trips", trips),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every check passed."""
    args = parse_args(argv)
    with common.scratch_dir("tessera-bench-pm-") as scratch:
        sandbox_port, api_port = common.free_port(), common.free_port()
        common.adopt_env(
            {
                **common.platform_env(
                    args.database_url,
                    args.redis_url,
                    scratch / "data",
                    TESSERA_SANDBOX_URL=f"http://127.0.0.1:{sandbox_port}",
                    TESSERA_API_PORT=str(api_port),
                ),
                "BENCH_ROUNDTRIP_URL": args.redis_url,
            }
        )
        roundtrip.conf.update(broker_url=args.redis_url, result_backend=args.redis_url)
        print(f"database {args.database_url} (recreated), redis {args.redis_url} (flushed)", flush=True)
        common.recreate_database(args.database_url)
        common.flush_redis(args.redis_url)
        tenant = common.make_tenant("bench-payment-methods")
        runs: list[Run] = []
        try:
            with common.Children(scratch) as children:
                sandbox = children.start(
                    "sandbox", [common.executable("tessera"), "sandbox", "--port", str(sandbox_port)]
                )
                api = children.start("api", [common.executable("tessera"), "api"])
                worker = common.start_platform_worker(children, args.worker_concurrency)
                reference_worker = children.start(
                    "roundtrip-worker",
                    [
                        common.executable("celery"),
                        "-A",
                        "benchmarks.payment_methods:roundtrip",
                        "worker",
                        "--concurrency",
                        str(args.worker_concurrency),
                        "-Q",
                        ROUNDTRIP_QUEUE,
                        "--loglevel",
                        "WARNING",
                    ],
                )
                common.wait_http(f"http://127.0.0.1:{sandbox_port}/health", sandbox)
                common.wait_http(f"http://127.0.0.1:{api_port}/openapi.json", api)
                client = Client(f"http://127.0.0.1:{api_port}", tenant.api_key, args.concurrency)
                status, token = client.post(
                    "/tokens",
                    {
                        "type": "card",
                        "data": {"number": VISA, "expiration_month": 12, "expiration_year": time.gmtime().tm_year + 3},
                    },
                )
                assert status == 201, token
                print("warming up", flush=True)
                for child in (worker, reference_worker):
                    child.check()
                run_platform(args, client, token["id"], 0, count=WARMUP)
                run_roundtrip(args, 0, count=WARMUP)
                platform_meter = meter_for({"api": api, "worker": worker, "sandbox": sandbox})
                reference_meter = meter_for({"worker": reference_worker})
                for round_no in range(1, args.rounds + 1):
                    runs.append(run_roundtrip(args, round_no, meter=reference_meter))
                    print(f"round {round_no}: {runs[-1].per_second:,.0f} round trips/s", flush=True)
                    runs.append(run_platform(args, client, token["id"], round_no, meter=platform_meter))
                    print(f"round {round_no}: {runs[-1].per_second:,.1f} creates/s", flush=True)
        except KeyboardInterrupt:
            print("interrupted; children stopped", file=sys.stderr)
            return 130
    figures = report(runs, args.concurrency)
    if figures is None:
        return 1
    common.publish("payment_methods", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
