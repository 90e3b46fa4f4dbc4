"""Network token creates per second and their latency, beside the bare Celery round trip on the same broker.

Platform: ``tessera sandbox`` (its visa card 4242 4242 4242 4242 answers at once), ``tessera api`` and
``tessera worker --concurrency W`` (``--worker-concurrency``, default 4) on a fresh database and Redis.
For each level of ``--clients`` (default ``1,32``), that many clients POST ``/network-tokens`` with raw
visa card data in a closed loop for ``--duration`` seconds (after ``--warmup`` seconds unmeasured), in
``--rounds`` (3) rounds alternating with the reference; the figures are the medians of the rounds. Each
create records the network token and its provisioning job in one transaction, the worker calls the
sandbox with the job id as idempotency key and writes the outcome, and the handler, woken by the job's
outcome message (``infra/wait.py``), answers 201 with the active network token. Every answer must be a 201
``active`` network token; anything else counts as an error.

Reference: the bare Celery round trip. :data:`roundtrip_app` (this module) has the same Redis broker
and a Redis result backend; its ``celery worker --concurrency W`` consumes its own queue; the same
number of client threads each call ``apply_async(...).get()`` of a no-op task in a closed loop.

Printed: requests per second, p50 and p99 latency of each, and the ratios platform / Celery (what the
platform adds on top of a Celery round trip: HTTP, authentication, validation, encryption, two
transactions, the provider call, the outcome message; goal with one client, issue 25: p50 ratio at most
3.0; at 32 clients, creates per second beside round trips per second).

The floor (one client, measured in the same run): the hops a create cannot do without, each timed bare,
one after the other, p50 of each: a Celery round trip (the reference above), an HTTP request to a
bare aiohttp handler (``benchmarks/bare_aiohttp.py``), the provider call itself (the platform's
provider client straight to the sandbox, no Celery, no database) and two durable commits (an
``INSERT`` and ``COMMIT`` on the benchmark's database: the recording transaction and the outcome's).
Their sum over the Celery round trip is the ratio a create would have if everything of the platform's
own (authentication, validation, encryption, SQL, events) cost nothing.
Run from the repository root::

    .venv/bin/python benchmarks/network_tokens.py [--clients 1,32] [--duration 15] [--rounds 3] [--worker-concurrency 4]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import asyncio
import base64
import datetime as dt
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from celery import Celery

from benchmarks import common

QUEUE = "bench-nt-roundtrip"
TASK = "bench.nt_noop"
ROUNDTRIP_URL = os.environ.get("BENCH_ROUNDTRIP_URL", "redis://127.0.0.1:6379/12")
DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench_network_tokens"
CARD = {"number": "4242424242424242", "expiration_month": 12, "expiration_year": dt.date.today().year + 3}
PLATFORM, CELERY = "POST /network-tokens", "Celery apply_async().get()"
FLOOR_HTTP, FLOOR_PROVIDER, FLOOR_COMMIT = "bare aiohttp POST", "provider call (bare)", "INSERT + durable COMMIT"


def make_roundtrip_app(url: str) -> Celery:
    """A Celery app on broker ``url`` with a Redis result backend on the same Redis and one no-op task."""
    app = Celery("bench_nt_roundtrip")
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        worker_hijack_root_logger=False,
        result_expires=300,
    )

    @app.task(name=TASK, shared=False)
    def noop() -> None:
        """Nothing."""

    return app


roundtrip_app = make_roundtrip_app(ROUNDTRIP_URL)
"""The reference's app (``celery -A benchmarks.network_tokens:roundtrip_app worker``)."""


@dataclass
class Measured:
    """One measured run: a variant at a client level."""

    variant: str
    clients: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    round: int = 0
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    cores: dict[str, float] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return common.ratio(len(self.latencies), self.seconds)

    def ms(self, q: float) -> float:
        return common.percentile(self.latencies, q) * 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,32", help="comma-separated concurrency levels")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each variant per level, alternating")
    parser.add_argument("--duration", type=float, default=15, help="measured seconds per variant and level")
    parser.add_argument("--warmup", type=float, default=3, help="unmeasured seconds before each measurement")
    parser.add_argument("--worker-concurrency", type=int, default=4, help="processes of each Celery worker")
    common.add_service_options(parser)
    parser.set_defaults(database_url=DEFAULT_DATABASE_URL, redis_url=ROUNDTRIP_URL)
    args = parser.parse_args(argv)
    args.levels = [int(part) for part in args.clients.split(",") if part.strip()]
    return args


# ---- the platform --------------------------------------------------------------------------------


async def _platform_load(base_url: str, api_key: str, clients: int, duration: float, result: Measured) -> None:
    import aiohttp

    from config.settings import get_settings

    headers = {get_settings().header("API-KEY"): api_key, "Content-Type": "application/json"}
    body = {"data": CARD}
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(base_url, connector=connector, headers=headers) as session:
        deadline = time.perf_counter() + duration

        async def client() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.post("/network-tokens", json=body) as answer:
                    payload = await answer.json(content_type=None)
                elapsed = time.perf_counter() - started
                result.statuses[answer.status] = result.statuses.get(answer.status, 0) + 1
                if answer.status == 201 and payload.get("status") == "active":
                    result.latencies.append(elapsed)
                else:
                    result.errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        result.seconds = time.perf_counter() - started


def run_platform(base_url: str, api_key: str, clients: int, duration: float) -> Measured:
    """Closed-loop creates by ``clients`` concurrent clients for ``duration`` seconds."""
    result = Measured(PLATFORM, clients, 0.0)
    asyncio.run(_platform_load(base_url, api_key, clients, duration, result))
    return result


# ---- the reference -------------------------------------------------------------------------------


def run_celery(url: str, clients: int, duration: float) -> Measured:
    """Closed-loop ``apply_async(...).get()`` round trips by ``clients`` threads (one app each: the
    Redis result consumer is not shared between threads) for ``duration`` seconds."""
    result = Measured(CELERY, clients, 0.0)
    lock = threading.Lock()
    apps = [make_roundtrip_app(url) for _ in range(clients)]
    for app in apps:  # connect before the clock starts
        app.tasks[TASK].apply_async().get(timeout=30)
    deadline = time.perf_counter() + duration

    def client(app: Celery) -> None:
        task = app.tasks[TASK]
        mine, errors = [], 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                task.apply_async().get(timeout=30)
                mine.append(time.perf_counter() - started)
            except Exception:
                errors += 1
        with lock:
            result.latencies.extend(mine)
            result.errors += errors

    threads = [threading.Thread(target=client, args=(app,)) for app in apps]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.perf_counter() - started
    for app in apps:
        app.close()
    return result


# ---- the floor -----------------------------------------------------------------------------------


def _timed(variant: str, duration: float, one) -> Measured:
    """``one()`` in a closed loop for ``duration`` seconds, each call timed."""
    result = Measured(variant, 1, 0.0)
    started = deadline = time.perf_counter()
    deadline += duration
    while time.perf_counter() < deadline:
        begun = time.perf_counter()
        one()
        result.latencies.append(time.perf_counter() - begun)
    result.seconds = time.perf_counter() - started
    return result


def run_floor(bare_url: str, database_url: str, duration: float) -> list[Measured]:
    """The bare hops of a create, one client each (see the module text)."""
    import sqlalchemy
    import urllib3

    from providers.card_network import CardToProvision, card_network_for

    http = urllib3.PoolManager(retries=False)
    body = json.dumps({"data": CARD}).encode()

    def post() -> None:
        answer = http.request("POST", bare_url + "/tokenize", body=body, headers={"Content-Type": "application/json"})
        assert answer.status == 201

    network = card_network_for("test")
    card = CardToProvision(CARD["number"], CARD["expiration_month"], CARD["expiration_year"])

    def provide() -> None:
        network.provision(card, idempotency_key=str(uuid.uuid4()))

    engine = sqlalchemy.create_engine(database_url)
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_floor (id uuid PRIMARY KEY, at timestamptz)")
    connection = engine.raw_connection()

    def commit() -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO bench_floor VALUES (%s, now())", (str(uuid.uuid4()),))
        connection.commit()

    try:
        for warm in (post, provide, commit):
            _timed("warm-up", 0.5, warm)
        return [
            _timed(FLOOR_HTTP, duration, post),
            _timed(FLOOR_PROVIDER, duration, provide),
            _timed(FLOOR_COMMIT, duration, commit),
        ]
    finally:
        connection.close()
        engine.dispose()
        http.clear()


# ---- the run -------------------------------------------------------------------------------------


METERED = ("client", "api", "worker", "sandbox", "postgres", "redis")


def meter(children: dict[str, common.Child]) -> common.CpuMeter:
    """Cores used by this process (the clients), the children and the shared PostgreSQL and Redis."""
    groups = {"client": common.this_process()}
    groups.update({name: common.process_tree(child.pid) for name, child in children.items()})
    groups["postgres"] = common.processes_named("postgres")
    groups["redis"] = common.processes_named("redis-server")
    return common.CpuMeter(groups)


def measured(run, cpu: common.CpuMeter, *args) -> Measured:
    """``run(*args)`` with the cores each group used meanwhile."""
    cpu.start()
    result = run(*args)
    result.cores = cpu.stop()
    return result


def report(runs: list[Measured]) -> list[common.Figure] | None:
    """Print the tables; the headline figures (per level of clients the platform's p50 and calls/s
    beside the Celery round trip's, medians of the rounds; goal with one client: p50 ratio at most
    3.0), None when a request failed."""
    common.print_table(
        "Runs (closed loop; latency of successful calls)",
        ("variant", "clients", "round", "calls", "calls/s", "p50 ms", "p99 ms", "errors", "statuses"),
        [
            (
                r.variant,
                r.clients,
                r.round or "-",
                len(r.latencies),
                r.per_second,
                r.ms(50),
                r.ms(99),
                r.errors,
                " ".join(f"{k}:{v}" for k, v in sorted(r.statuses.items())) or "-",
            )
            for r in runs
        ],
    )
    common.print_table(
        "Cores used (CPU seconds per second; postgres and redis count every client of theirs, this machine's "
        "other load included; the platform's worker is 'worker', the reference's 'worker' is its Celery worker)",
        ("variant", "clients", "round", *METERED),
        [
            (r.variant, r.clients, r.round or "-", *(r.cores.get(name, float("nan")) for name in METERED))
            for r in runs
            if r.cores
        ],
    )
    rows, figures = [], []
    medians: dict[tuple[str, int], tuple[float, float, float]] = {}
    for level in sorted({r.clients for r in runs}):
        for variant in (PLATFORM, CELERY):
            of = [r for r in runs if r.variant == variant and r.clients == level]
            medians[variant, level] = (
                common.median(r.per_second for r in of),
                common.median(r.ms(50) for r in of),
                common.median(r.ms(99) for r in of),
            )
        (platform_rate, platform_p50, platform_p99) = medians[PLATFORM, level]
        (celery_rate, celery_p50, celery_p99) = medians[CELERY, level]
        rows.append(
            (
                level,
                platform_rate,
                celery_rate,
                f"{platform_p50:.2f} / {platform_p99:.2f}",
                f"{celery_p50:.2f} / {celery_p99:.2f}",
                common.ratio(platform_rate, celery_rate),
                common.ratio(platform_p50, celery_p50),
                common.ratio(platform_p99, celery_p99),
            )
        )
        clients = f"{level} client{'s' if level > 1 else ''}"
        figures += [
            common.Figure(
                "network_tokens",
                f"create p50, {clients}",
                platform_p50,
                "ms",
                "Celery round trip",
                celery_p50,
                "ratio ≤ 3.0" if level == 1 else None,
            ),
            common.Figure(
                "network_tokens",
                f"creates/s, {clients}",
                platform_rate,
                "/s",
                "Celery round trips",
                celery_rate,
            ),
        ]
    common.print_table(
        "Platform / bare Celery round trip (medians of the rounds)",
        (
            "clients",
            "creates/s",
            "round trips/s",
            "create p50 / p99 ms",
            "round trip p50 / p99 ms",
            "throughput ratio",
            "p50 ratio",
            "p99 ratio",
        ),
        rows,
    )
    floor = {r.variant: r for r in runs if r.variant in (FLOOR_HTTP, FLOOR_PROVIDER, FLOOR_COMMIT)}
    celery_1, platform_1 = medians.get((CELERY, 1)), medians.get((PLATFORM, 1))
    if len(floor) == 3 and celery_1 is not None and platform_1 is not None:
        celery_p50, platform_p50 = celery_1[1], platform_1[1]
        hops = [
            (CELERY, 1, celery_p50),
            (FLOOR_HTTP, 1, floor[FLOOR_HTTP].ms(50)),
            (FLOOR_PROVIDER, 1, floor[FLOOR_PROVIDER].ms(50)),
            (FLOOR_COMMIT, 2, floor[FLOOR_COMMIT].ms(50)),
        ]
        total = sum(times * ms for _, times, ms in hops)
        common.print_table(
            "The floor of one create (one client: the hops it cannot do without, each timed bare, p50)",
            ("hop", "times", "p50 ms", "ms"),
            [
                *((name, times, ms, times * ms) for name, times, ms in hops),
                ("floor (sum)", "", "", total),
                ("floor / Celery round trip", "", "", common.ratio(total, celery_p50)),
                ("platform p50 / floor", "", "", common.ratio(platform_p50, total)),
            ],
        )
    return figures if all(r.errors == 0 and r.latencies for r in runs) else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sandbox_port, api_port = common.free_port(), common.free_port()
    extra = {
        "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "TESSERA_API_PORT": str(api_port),
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
    }
    with common.fresh_platform(args, "tessera-bench-network-tokens-", **extra) as scratch:
        tenant = common.make_tenant("bench-network-tokens")
        base_url = f"http://127.0.0.1:{api_port}"
        with common.Children(scratch) as children:
            sandbox, api = common.start_sandbox_and_api(children, sandbox_port, api_port)
            worker = common.start_platform_worker(children, args.worker_concurrency)
            reference = children.start(
                "roundtrip-worker",
                [
                    common.executable("celery"),
                    "-A",
                    "benchmarks.network_tokens:roundtrip_app",
                    "worker",
                    "--concurrency",
                    str(args.worker_concurrency),
                    "-Q",
                    QUEUE,
                    "--loglevel",
                    "WARNING",
                ],
                env={"BENCH_ROUNDTRIP_URL": args.redis_url},
            )
            bare_port = common.free_port()
            bare = children.start(
                "bare-aiohttp", common.python_module("benchmarks.bare_aiohttp", "--port", str(bare_port))
            )
            common.wait_http(f"http://127.0.0.1:{bare_port}/", bare)
            watched = [sandbox, api, worker, reference, bare]
            platform_cpu = meter({"api": api, "worker": worker, "sandbox": sandbox})
            celery_cpu = meter({"worker": reference})
            print("warming up", flush=True)
            common.wait_until(
                lambda: run_platform(base_url, tenant.api_key, 1, 0.5).latencies,
                timeout=60,
                what="a first network token",
                interval=0.5,
                children=watched,
            )
            print("history: network tokens for 10 s at 8 clients", flush=True)  # the planner's statistics
            run_platform(base_url, tenant.api_key, 8, 10)  # of a database in use (common.vacuum_analyze)
            runs = []
            for level in args.levels:
                run_celery(args.redis_url, level, args.warmup)
                run_platform(base_url, tenant.api_key, level, args.warmup)
                for round_no in range(1, args.rounds + 1):
                    common.vacuum_analyze(args.database_url)
                    runs.append(measured(run_celery, celery_cpu, args.redis_url, level, args.duration))
                    runs[-1].round = round_no
                    print(f"{level} clients, round {round_no}: {runs[-1].per_second:,.0f} Celery round trips/s")
                    runs.append(measured(run_platform, platform_cpu, base_url, tenant.api_key, level, args.duration))
                    runs[-1].round = round_no
                    print(f"{level} clients, round {round_no}: {runs[-1].per_second:,.0f} network tokens/s", flush=True)
                    for child in watched:
                        child.check()
                if level == 1:  # before a higher level fills the platform's connection pools
                    runs.extend(run_floor(f"http://127.0.0.1:{bare_port}", args.database_url, args.duration / 3))
    figures = report(runs)
    if figures is None:
        return 1
    common.publish("network_tokens", figures)
    return 0


if __name__ == "__main__":
    common.run_main(main)
