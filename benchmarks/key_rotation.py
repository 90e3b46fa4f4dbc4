"""A tenant's data key rotation: values re-encrypted per second and the worker's memory, and
``POST /tokenize`` latency during the rotation beside the same load without it, in one run.

Services: PostgreSQL (``--database-url``, recreated), Redis (``--redis-url``, under a key prefix of this
run), ``tessera api`` and ``tessera worker --concurrency 2`` as child processes. Setup (not timed): a
test tenant with ``--tokens`` card tokens (1,000,000), bulk inserted and sealed under its data key
version 1 as the platform seals them.

Measured, in this order: a rotation (``keys.rotate`` jobs, from its start until it is ``completed``)
with no request load; ``--clients`` threads posting ``/tokenize`` for ``--seconds`` without a
rotation (the reference); then a second rotation while the same load runs. The worker's RSS is
sampled every 0.2 s during each rotation (psutil, every process of the worker). Printed for each
rotation: values re-encrypted, seconds, values/s (goal ≥ 20,000 with nothing else running; under the
load the rotation yields, taking a quarter of the time while the requests' statements run, so it has
no goal there), the worker's peak RSS and the load average; and tokenize p50/p99 without and during
the rotation with their ratio (goal: p99 within 2 times).
Run from the repository root::

    .venv/bin/python benchmarks/key_rotation.py [--tokens 1000000] [--clients 8] [--seconds 20]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import contextlib
import json
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass

import psutil

from benchmarks import common
from benchmarks.account_updater import insert_tokens

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


def tokenize_load(base: str, api_key: str, clients: int, stop: threading.Event) -> list[float]:
    """Post ``/tokenize`` from ``clients`` threads until ``stop``; the latencies in seconds."""
    latencies: list[float] = []
    lock = threading.Lock()
    body = json.dumps(CARD).encode()

    def client() -> None:
        while not stop.is_set():
            request = urllib.request.Request(
                base + "/tokenize",
                data=body,
                method="POST",
                headers={"TS-API-KEY": api_key, "content-type": "application/json"},
            )
            began = time.perf_counter()
            with urllib.request.urlopen(request, timeout=30) as answer:
                answer.read()
            took = time.perf_counter() - began
            with lock:
                latencies.append(took)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(30)
    return latencies


def timed_load(base: str, api_key: str, clients: int, seconds: float) -> list[float]:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    return tokenize_load(base, api_key, clients, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_service_options(parser)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="card tokens of the tenant")
    parser.add_argument("--clients", type=int, default=8, help="threads posting /tokenize")
    parser.add_argument("--seconds", type=float, default=20, help="seconds of the reference load")
    parser.add_argument("--concurrency", type=int, default=2, help="the worker's prefork processes")
    args = parser.parse_args(argv)
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    with common.scratch_dir("tessera-bench-keys-") as scratch:
        api_port = common.free_port()
        prefix = f"bench-keys-{os.getpid()}:"
        common.adopt_env(
            {
                **common.platform_env(
                    args.database_url, args.redis_url, scratch / "data", TESSERA_REDIS_KEY_PREFIX=prefix
                ),
                "TESSERA_API_PORT": str(api_port),
            }
        )
        common.recreate_database(args.database_url)
        tenant = common.make_tenant("bench-keys")
        started = time.monotonic()
        numbers: list[str | None] = [f"4{index:015d}" for index in range(args.tokens)]
        insert_tokens(tenant.tenant_id, numbers, 2031)
        print(f"setup: {args.tokens:,} tokens in {time.monotonic() - started:.1f} s", flush=True)
        from domain.keys import service
        from storage.db import session_scope

        with common.Children(scratch) as children:
            api = children.start(
                "api", [common.executable("tessera"), "api", "--port", str(api_port), "--workers", "1"]
            )
            base = f"http://127.0.0.1:{api_port}"
            common.wait_http(base + "/status", api)
            worker = common.start_platform_worker(children, args.concurrency)
            timed_load(base, tenant.api_key, args.clients, 3)  # warm-up
            tree = common.process_tree(worker.pid)
            alone = _rotate(service, session_scope, tenant.tenant_id, tree)  # the machine's own load only
            reference = timed_load(base, tenant.api_key, args.clients, args.seconds)
            stop = threading.Event()
            during: list[float] = []
            loader = threading.Thread(
                target=lambda: during.extend(tokenize_load(base, tenant.api_key, args.clients, stop))
            )
            loader.start()
            try:
                loaded = _rotate(service, session_scope, tenant.tenant_id, tree)
            finally:
                stop.set()
                loader.join(60)
    common.print_table(
        "Rotation",
        ["load", "values", "seconds", "values/s", "goal", "worker peak RSS MiB", "load average (1 min)"],
        [
            [name, r.values, r.seconds, r.rate, goal, r.peak_rss / 2**20, r.load_average]
            for name, r, goal in (("alone", alone, "20,000"), (f"{args.clients} clients tokenizing", loaded, "yields"))
        ],
    )
    rows = []
    for name, values in (("without rotation", reference), ("during rotation", during)):
        rows.append([name, len(values), common.percentile(values, 50) * 1000, common.percentile(values, 99) * 1000])
    common.print_table("POST /tokenize", ["load", "requests", "p50 ms", "p99 ms"], rows)
    p99_during, p99_without = common.percentile(during, 99) * 1000, common.percentile(reference, 99) * 1000
    ratio = common.ratio(p99_during, p99_without)
    print(
        f"\nrotation {alone.rate:,.0f} values/s alone, {loaded.rate:,.0f} values/s under the tokenize load "
        f"(goal 20,000 alone); tokenize p99 during / without: {ratio:.2f} (goal ≤ 2); load average {os.getloadavg()}"
    )
    common.publish(
        "key_rotation",
        [
            common.Figure(
                "key_rotation",
                f"values re-encrypted/s during the tokenize load ({args.tokens:,} tokens)",
                loaded.rate,
                "/s",
                goal="yields to requests",
            ),
            common.Figure(
                "key_rotation",
                f"values re-encrypted/s without request load ({args.tokens:,} tokens)",
                alone.rate,
                "/s",
                goal="≥ 20,000/s",
            ),
            common.Figure(
                "key_rotation",
                f"tokenize p99 during rotation ({args.clients} clients)",
                p99_during,
                "ms",
                "without rotation",
                p99_without,
                "ratio ≤ 2",
            ),
        ],
    )
    return 0


@dataclass(frozen=True)
class Rotated:
    """One rotation measured: values re-encrypted, seconds from its start to ``completed``, the
    worker's peak RSS (bytes, every process of it) and the 1-minute load average at the end."""

    values: int
    seconds: float
    peak_rss: int
    load_average: float

    @property
    def rate(self) -> float:
        return self.values / self.seconds


def _rotate(service, session_scope, tenant_id, tree) -> Rotated:
    """Rotate the tenant's data key once and wait for it to complete, sampling the worker's RSS every
    0.2 s."""
    stop, peak = threading.Event(), [0]

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(psutil.Error):  # a process ended between listing and reading
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree()))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.monotonic()
    with session_scope() as session:
        total = service.start_rotation(session, uuid.UUID(str(tenant_id))).total
    common.wait_until(
        lambda: _completed(service, session_scope, tenant_id),
        timeout=3600,
        what="the rotation to complete",
        interval=0.5,
    )
    elapsed = time.monotonic() - began
    stop.set()
    sampler.join(5)
    return Rotated(total, elapsed, peak[0], os.getloadavg()[0])


def _completed(service, session_scope, tenant_id) -> bool:
    with session_scope() as session:
        rotation = service.rotation_progress(session, uuid.UUID(str(tenant_id)))
    return rotation is not None and rotation["status"] == "completed"


if __name__ == "__main__":
    common.run_main(main)
