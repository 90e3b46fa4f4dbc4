"""Payment method creates per second (two rails each), p50/p99, beside a network-token create and the
bare Celery round trip, at each level of clients.

Platform: ``tessera api``, ``tessera worker --concurrency 2`` and ``tessera sandbox`` as child
processes on a fresh database and Redis (the broker); one test tenant and one visa card token
(4242424242424242: rails ``agentic-token``/``vic`` and ``spt``/``psp``, both enabled by the sandbox).
For each level of ``--clients`` (default ``1,32``), ``--creates`` (400) ``POST /agentic/payment-methods``
are sent by that many client threads; each create records the payment method and two enrollment jobs
in one statement, both jobs go out in one message after the commit, one task run of the worker runs
the two jobs side by side (one provider call each, on a thread each), each outcome one statement, and
the handler, woken once both outcomes are in, answers. Timed per request; checked: every answer is 201
with both rails ``enabled``.

References, measured in the same run by the same number of threads, the three alternating for
``--rounds`` (3) rounds per level:

* the bare Celery round trip on the same Redis: ``apply_async().get()`` of a no-op task with a Redis
  result backend (the app :data:`roundtrip` below, its own ``celery worker --concurrency 2``): the floor
  of "enqueue a job and wait for its outcome";
* a network-token create (``POST /network-tokens`` with the same card's data: one job, one provider
  call, its answer once the job settles): a payment method should cost no more than its slowest rail,
  that is about one network token.

With one client each round also times ``--creates`` / 4 rail retries (at least 20): payment methods
of the card 4000000000003022 (SANDBOX.md: ``vic`` fails at every create, a retry enables it) are made
first, untimed, then ``POST /agentic/payment-methods/{id}/rails/retry`` of ``vic`` is timed for each,
one job and one provider call like a network token; every answer must be 200 with both rails enabled.

Medians over the rounds are printed with the ratios of the p50 latencies (goals with one client,
issue 25: payment method / round trip at most 3.5, payment method / network token at most 1.3,
network token / round trip and rail retry / round trip at most 3.0) and creates per second beside
round trips per second (the capacity at 32 clients). Run from the repository root::

    .venv/bin/python benchmarks/payment_methods.py [--clients 1,32] [--creates 400] [--rounds 3]
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
#: SANDBOX.md: ``vic`` fails with PROVIDER_ENROLLMENT_FAILED at every create, and a retry enables it.
FAILS_ON_CREATE = "4000000000003022"
WARMUP = 20
#: Creates of each kind made before the first measurement, then the database analyzed: the tables a
#: measurement reads hold this much history, so the planner's statistics are those of a database in use
#: (on tables of a few rows it rightly prefers sequential scans, which the plans cached for the prepared
#: statements keep as the tables grow).
HISTORY = 1000
PLATFORM, NETWORK_TOKEN, ROUNDTRIP = "payment method creates", "network-token creates", "Celery round trips"
RETRY = "rail retries"
#: The goals of issue 25 (one client): p50 ratios (a rail retry's is the network token's).
GOAL_PM_TRIP, GOAL_PM_NT, GOAL_NT_TRIP = 3.5, 1.3, 3.0

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
    clients: int
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
    parser.add_argument("--creates", type=int, default=400, help="creates (and round trips) per round and variant")
    parser.add_argument(
        "--clients",
        "--concurrency",
        dest="clients",
        default="1,32",
        help="comma-separated levels of client threads sending at once",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each variant per level, alternating")
    parser.add_argument("--worker-concurrency", type=int, default=2, help="processes of each worker")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one round may take")
    common.add_service_options(parser)
    args = parser.parse_args(argv)
    args.levels = [int(part) for part in str(args.clients).split(",") if part.strip()]
    return args


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


def card_token(client: Client, number: str) -> str:
    """``POST /tokens`` of a card ``number`` (expiring in three years); its id (asserting 201)."""
    data = {"number": number, "expiration_month": 12, "expiration_year": time.gmtime().tm_year + 3}
    status, token = client.post("/tokens", {"type": "card", "data": data})
    assert status == 201, token
    return token["id"]


def create_body(token_id: str) -> dict:
    """The body of ``POST /agentic/payment-methods`` for the card token ``token_id``."""
    return {"source": {"type": "svc_card_token", "token_id": token_id}, "consumer": {"email": "bench@example.com"}}


def rail_statuses(answer: dict) -> list[str]:
    """The status of each rail of a payment method answer, in order."""
    return [rail["status"] for rail in answer["rails"]]


def _timed_calls(variant: str, clients: int, round_no: int, count: int, one, meter: common.CpuMeter | None) -> Run:
    """``count`` calls of ``one()`` (-> ``(seconds, ok)``) by ``clients`` threads, each timed."""
    if meter:
        meter.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: one(), range(count)))
    seconds = time.perf_counter() - started
    return Run(
        variant,
        round_no,
        clients,
        [r[0] for r in results],
        seconds,
        failures=sum(1 for r in results if not r[1]),
        cores=meter.stop() if meter else {},
    )


def run_platform(
    args, client: Client, token_id: str, clients: int, round_no: int, count: int | None = None, meter=None
) -> Run:
    """``count`` payment method creates sent by ``clients`` threads; each answer checked."""
    body = create_body(token_id)

    def one():
        started = time.perf_counter()
        status, answer = client.post("/agentic/payment-methods", body)
        elapsed = time.perf_counter() - started
        return elapsed, status == 201 and rail_statuses(answer) == ["enabled", "enabled"]

    return _timed_calls(PLATFORM, clients, round_no, count or args.creates, one, meter)


def run_network_tokens(args, client: Client, clients: int, round_no: int, count: int | None = None, meter=None) -> Run:
    """``count`` network-token creates (the same visa card's data) sent by ``clients`` threads; each
    answer checked (201, ``active``)."""
    body = {"data": {"number": VISA, "expiration_month": 12, "expiration_year": time.gmtime().tm_year + 3}}

    def one():
        started = time.perf_counter()
        status, answer = client.post("/network-tokens", body)
        elapsed = time.perf_counter() - started
        return elapsed, status == 201 and answer.get("status") == "active"

    return _timed_calls(NETWORK_TOKEN, clients, round_no, count or args.creates, one, meter)


def run_retries(args, client: Client, token_id: str, round_no: int, count: int | None = None, meter=None) -> Run:
    """``count`` rail retries by one client, each of its own payment method: the payment methods are
    made first, untimed (the card token ``token_id`` of :data:`FAILS_ON_CREATE`, so ``vic`` is in
    error), then each ``POST .../rails/retry`` of ``vic`` is timed; each answer checked (200, both
    rails enabled)."""
    count = count or max(WARMUP, args.creates // 4)
    body = create_body(token_id)

    def make() -> str | None:
        status, answer = client.post("/agentic/payment-methods", body)
        failed = status == 201 and rail_statuses(answer) == ["error", "enabled"]
        return answer["id"] if failed else None

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: make(), range(count)))
    ids = iter(made)
    retry = {"rail": "agentic-token", "provider": "vic"}

    def one():
        pm_id = next(ids)
        if pm_id is None:
            return 0.0, False
        started = time.perf_counter()
        status, answer = client.post(f"/agentic/payment-methods/{pm_id}/rails/retry", retry)
        elapsed = time.perf_counter() - started
        return elapsed, status == 200 and rail_statuses(answer) == ["enabled", "enabled"]

    return _timed_calls(RETRY, 1, round_no, count, one, meter)


def run_roundtrip(args, clients: int, round_no: int, count: int | None = None, meter=None) -> Run:
    """``count`` ``apply_async().get()`` round trips sent by ``clients`` threads."""

    def one():
        started = time.perf_counter()
        noop.apply_async().get(timeout=60)
        return time.perf_counter() - started, True

    return _timed_calls(ROUNDTRIP, clients, round_no, count or args.creates, one, meter)


# ---- the run -------------------------------------------------------------------------------------


CORE_GROUPS = ("api", "worker", "sandbox", "producer", "postgres", "redis")


def meter_for(children: dict[str, common.Child]) -> common.CpuMeter:
    """Cores used by each child process tree, this process (the clients), PostgreSQL and Redis."""
    groups = {name: common.process_tree(child.pid) for name, child in children.items()}
    groups["producer"] = common.this_process()
    groups["postgres"] = common.processes_named("postgres")
    groups["redis"] = common.processes_named("redis-server")
    return common.CpuMeter(groups)


def report(runs: list[Run]) -> list[common.Figure] | None:
    """Print the tables; the headline figures of each level (median payment method create p50 beside
    the round trip's and the network token's, creates/s beside round trips/s), None unless every
    create answered 201 with both rails enabled and every network token 201 ``active``."""
    common.print_table(
        "Rounds (p50/p99 per request; cores = CPU seconds per second; 'worker' is the platform worker for "
        "creates and the no-op worker for round trips)",
        (
            "clients",
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
                r.clients,
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
    figures: list[common.Figure] = []
    for level in sorted({r.clients for r in runs}):
        medians = {}
        for variant in (PLATFORM, NETWORK_TOKEN, ROUNDTRIP):
            of = [r for r in runs if r.variant == variant and r.clients == level]
            medians[variant] = (
                common.median(r.per_second for r in of),
                common.median(r.ms(50) for r in of),
                common.median(r.ms(99) for r in of),
            )
        (pm_rate, pm_p50, pm_p99), (nt_rate, nt_p50, nt_p99), (trip_rate, trip_p50, trip_p99) = (
            medians[PLATFORM],
            medians[NETWORK_TOKEN],
            medians[ROUNDTRIP],
        )
        one = level == 1
        retries = [r for r in runs if r.variant == RETRY and r.clients == level]
        retry_rows = []
        if retries:
            retry_p50 = common.median(r.ms(50) for r in retries)
            retry_p99 = common.median(r.ms(99) for r in retries)
            retry_rows = [
                ("rail retry p50 / p99 ms (1 client)", f"{retry_p50:.2f} / {retry_p99:.2f}"),
                (f"p50 ratio rail retry / round trip (goal <= {GOAL_NT_TRIP})", common.ratio(retry_p50, trip_p50)),
            ]
            figures.append(
                common.Figure(
                    "payment_methods",
                    "rail retry p50 (one rail), 1 client",
                    retry_p50,
                    "ms",
                    "Celery round trip",
                    trip_p50,
                    f"ratio ≤ {GOAL_NT_TRIP}",
                )
            )
        common.print_table(
            f"Medians over {args_rounds(runs, level)} rounds, {level} client{'s' if level > 1 else ''}",
            ("figure", "value"),
            [
                ("payment method creates/s (2 rails each)", pm_rate),
                ("payment method create p50 / p99 ms", f"{pm_p50:.2f} / {pm_p99:.2f}"),
                ("network-token creates/s", nt_rate),
                ("network-token create p50 / p99 ms", f"{nt_p50:.2f} / {nt_p99:.2f}"),
                ("Celery round trips/s", trip_rate),
                ("round trip p50 / p99 ms", f"{trip_p50:.2f} / {trip_p99:.2f}"),
                ("creates/s ratio payment method / round trips", common.ratio(pm_rate, trip_rate)),
                ("creates/s ratio network token / round trips", common.ratio(nt_rate, trip_rate)),
                (
                    f"p50 ratio payment method / round trip{f' (goal <= {GOAL_PM_TRIP})' if one else ''}",
                    common.ratio(pm_p50, trip_p50),
                ),
                (
                    f"p50 ratio payment method / network token{f' (goal <= {GOAL_PM_NT})' if one else ''}",
                    common.ratio(pm_p50, nt_p50),
                ),
                (
                    f"p50 ratio network token / round trip{f' (goal <= {GOAL_NT_TRIP})' if one else ''}",
                    common.ratio(nt_p50, trip_p50),
                ),
                *retry_rows,
            ],
        )
        clients = f"{level} client{'s' if level > 1 else ''}"
        figures += [
            common.Figure(
                "payment_methods",
                f"create p50 (2 rails), {clients}",
                pm_p50,
                "ms",
                "Celery round trip",
                trip_p50,
                f"ratio ≤ {GOAL_PM_TRIP}" if one else None,
            ),
            common.Figure(
                "payment_methods",
                f"create p50 (2 rails) vs a network token, {clients}",
                pm_p50,
                "ms",
                "network-token create",
                nt_p50,
                f"ratio ≤ {GOAL_PM_NT}" if one else None,
            ),
            common.Figure(
                "payment_methods", f"creates/s (2 rails), {clients}", pm_rate, "/s", "Celery round trips", trip_rate
            ),
        ]
    failures = {
        variant: sum(r.failures for r in runs if r.variant == variant) for variant in (PLATFORM, NETWORK_TOKEN, RETRY)
    }
    common.print_table(
        "Checks",
        ("check", "result"),
        [
            (
                "every payment method create answered 201 with both rails enabled",
                "ok" if not failures[PLATFORM] else f"FAILED ({failures[PLATFORM]})",
            ),
            (
                "every network-token create answered 201 active",
                "ok" if not failures[NETWORK_TOKEN] else f"FAILED ({failures[NETWORK_TOKEN]})",
            ),
            (
                "every rail retry answered 200 with both rails enabled",
                "ok" if not failures[RETRY] else f"FAILED ({failures[RETRY]})",
            ),
        ],
    )
    return None if any(failures.values()) else figures


def args_rounds(runs: list[Run], level: int) -> int:
    """How many rounds of the payment method variant ran at ``level``."""
    return sum(1 for r in runs if r.variant == PLATFORM and r.clients == level)


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
                client = Client(f"http://127.0.0.1:{api_port}", tenant.api_key, max(args.levels))
                token_id, failing_id = card_token(client, VISA), card_token(client, FAILS_ON_CREATE)
                platform_meter = meter_for({"api": api, "worker": worker, "sandbox": sandbox})
                reference_meter = meter_for({"worker": reference_worker})
                print(f"history: {HISTORY} payment methods and network tokens", flush=True)
                run_platform(args, client, token_id, 8, 0, count=HISTORY)
                run_network_tokens(args, client, 8, 0, count=HISTORY)
                for level in args.levels:
                    print(f"{level} clients: warming up", flush=True)
                    for child in (worker, reference_worker):
                        child.check()
                    run_platform(args, client, token_id, level, 0, count=max(WARMUP, level * 2))
                    run_network_tokens(args, client, level, 0, count=max(WARMUP, level * 2))
                    run_roundtrip(args, level, 0, count=max(WARMUP, level * 2))
                    for round_no in range(1, args.rounds + 1):
                        common.vacuum_analyze(args.database_url)
                        runs.append(run_roundtrip(args, level, round_no, meter=reference_meter))
                        print(
                            f"{level} clients, round {round_no}: {runs[-1].per_second:,.0f} round trips/s", flush=True
                        )
                        runs.append(run_network_tokens(args, client, level, round_no, meter=platform_meter))
                        print(
                            f"{level} clients, round {round_no}: {runs[-1].per_second:,.1f} network tokens/s",
                            flush=True,
                        )
                        runs.append(run_platform(args, client, token_id, level, round_no, meter=platform_meter))
                        print(
                            f"{level} clients, round {round_no}: {runs[-1].per_second:,.1f} payment methods/s",
                            flush=True,
                        )
                        if level == 1:  # the goal is one client's; each retry needs a payment method of its own
                            runs.append(run_retries(args, client, failing_id, round_no, meter=platform_meter))
                            print(f"1 client, round {round_no}: {runs[-1].per_second:,.1f} rail retries/s", flush=True)
        except KeyboardInterrupt:
            print("interrupted; children stopped", file=sys.stderr)
            return 130
    figures = report(runs)
    if figures is None:
        return 1
    common.publish("payment_methods", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
