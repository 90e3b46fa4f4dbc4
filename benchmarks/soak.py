"""Soak: a mixed workload at a steady rate for a given time; memory of every process over time, p99
per interval, and lost jobs at the end.

Platform: ``tessera sandbox``, ``tessera api``, ``tessera beat``, ``tessera worker`` and the webhook
receiver (``benchmarks/receiver.py``) as child processes, one test tenant with a webhook for every
event. The load: ``--rate`` requests a second, spread evenly (an open loop: a slow answer does not
slow the sender), of which 60 % ``POST /tokens`` (a card: a token and a ``token.created`` delivery),
25 % ``GET /tokens/{id}`` and 15 % ``POST /network-tokens`` (a provisioning job on the sandbox and
its event). Every ``--interval`` seconds a row: requests, errors, p50 and p99 latency, and the resident
memory (MB) of each process tree. At the end the load stops, the platform gets ``--drain`` seconds to
finish, and the run counts lost work: jobs not final, deliveries not delivered, events whose delivery
never reached the receiver. Exit status 1 on any error or lost work.

    .venv/bin/python benchmarks/soak.py                          # 10 minutes at 20 requests/s
    .venv/bin/python benchmarks/soak.py --duration 60 --rate 10  # a short look
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import base64
import collections
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import urllib3

from benchmarks import common
from benchmarks.receiver import Receiver

CARDS = ("4242424242424242", "5555555555554444", "378282246310005")


def fresh_visa() -> str:
    """A Luhn-valid visa number of its own (a network token per card number)."""
    body = "4" + "".join(random.choice("0123456789") for _ in range(14))
    total = 0
    for position, char in enumerate(reversed(body)):
        digit = int(char) * (2 if position % 2 == 0 else 1)
        total += digit - 9 if digit > 9 else digit
    return body + str((10 - total % 10) % 10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_service_options(parser)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default %(default)s)")
    parser.add_argument("--rate", type=float, default=20.0, help="requests a second (default %(default)s)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds per report row (default %(default)s)")
    parser.add_argument("--drain", type=float, default=120.0, help="seconds to finish the work (default %(default)s)")
    parser.add_argument("--worker-concurrency", type=int, default=2)
    return parser.parse_args(argv)


class Load:
    """The open-loop load generator: latencies and errors of the current interval, token ids made."""

    def __init__(self, base_url: str, api_key: str):
        self.base_url = base_url
        self.http = urllib3.PoolManager(maxsize=64, retries=False, timeout=urllib3.Timeout(30))
        self.headers = {"TS-API-KEY": api_key, "Content-Type": "application/json"}
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.errors = 0
        self.tokens: list[str] = []
        self.sent = 0
        self.statuses: collections.Counter[str] = collections.Counter()

    def one(self) -> None:
        year = time.gmtime().tm_year + 2
        card = {"number": random.choice(CARDS), "expiration_month": 12, "expiration_year": year}
        pick = random.random()
        if pick < 0.25 and self.tokens:
            method, path, body = "GET", f"/tokens/{random.choice(self.tokens)}", None
        elif pick < 0.40:
            method, path, body = "POST", "/network-tokens", {"data": {**card, "number": fresh_visa()}}
        else:
            method, path, body = "POST", "/tokens", {"type": "card", "data": card}
        started = time.perf_counter()
        try:
            answer = self.http.request(
                method,
                self.base_url + path,
                headers=self.headers,
                body=None if body is None else json.dumps(body).encode(),
            )
            ok = answer.status < 300
            if not ok:
                self.statuses[f"{method} {path.split('/')[1]} {answer.status}"] += 1
            made = json.loads(answer.data).get("id") if ok and path == "/tokens" else None
        except Exception:
            ok, made = False, None
        elapsed = time.perf_counter() - started
        with self.lock:
            self.latencies.append(elapsed)
            self.errors += 0 if ok else 1
            if made:
                self.tokens.append(made)

    def take(self) -> tuple[list[float], int]:
        with self.lock:
            taken, errors = self.latencies, self.errors
            self.latencies, self.errors = [], 0
        return taken, errors


def memory_mb(children: dict[str, common.Child]) -> dict[str, float]:
    """Resident memory (MB) of each child's process tree."""
    sizes = {}
    for name, child in children.items():
        total = 0
        for process in common.process_tree(child.pid)():
            try:
                total += process.memory_info().rss
            except psutil.Error:
                continue
        sizes[name] = total / 2**20
    return sizes


def lost_work(database_url: str) -> dict[str, int]:
    """Work not done after the drain: jobs neither succeeded nor failed for good, deliveries pending."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            jobs = conn.execute(
                text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running') AND kind <> 'webhooks.deliver'")
            ).scalar_one()
            deliveries = conn.execute(
                text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running') AND kind = 'webhooks.deliver'")
            ).scalar_one()
            events = conn.execute(text("SELECT count(*) FROM webhook_deliveries")).scalar_one()
    finally:
        engine.dispose()
    return {"jobs not final": jobs, "deliveries pending": deliveries, "deliveries": events}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sandbox_port, api_port = common.free_port(), common.free_port()
    extra = {
        "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "TESSERA_API_PORT": str(api_port),
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
        "TESSERA_ALLOW_PRIVATE_DESTINATIONS": "true",
        "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "5",
    }
    with common.fresh_platform(args, "tessera-soak-", **extra) as scratch, common.Children(scratch) as children:
        tessera = common.executable("tessera")
        sandbox = children.start("sandbox", [tessera, "sandbox", "--port", str(sandbox_port)])
        common.wait_http(f"http://127.0.0.1:{sandbox_port}/health", sandbox)
        base_url = f"http://127.0.0.1:{api_port}"
        api = children.start("api", [tessera, "api", "--port", str(api_port)])
        common.wait_http(f"{base_url}/status", api)
        beat = children.start("beat", [tessera, "beat"])
        worker = common.start_platform_worker(children, args.worker_concurrency)
        receiver = Receiver(children)
        tenant = common.make_tenant("soak")
        common.subscribe_webhook(tenant.tenant_id, receiver.url, ("token.created", "network-token.created"))
        watched = {"api": api, "worker": worker, "beat": beat, "sandbox": sandbox, "receiver": receiver.child}
        load = Load(base_url, tenant.api_key)
        names = list(watched)
        rows, first_memory = [], None
        pool = ThreadPoolExecutor(max_workers=64)
        started = next_row = time.monotonic()
        next_row += args.interval
        gap = 1.0 / args.rate
        due = started
        print(f"soak: {args.rate:g} requests/s for {args.duration:g} s", flush=True)
        while time.monotonic() - started < args.duration:
            now = time.monotonic()
            if now >= due:
                pool.submit(load.one)
                load.sent += 1
                due += gap
            if now >= next_row:
                latencies, errors = load.take()
                memory = memory_mb(watched)
                first_memory = first_memory or memory
                row = (
                    f"{now - started:.0f}",
                    len(latencies),
                    errors,
                    f"{common.percentile(latencies, 50) * 1000:.0f}" if latencies else "-",
                    f"{common.percentile(latencies, 99) * 1000:.0f}" if latencies else "-",
                    *(f"{memory[n]:.0f}" for n in names),
                )
                rows.append(row)
                print("  ".join(str(c) for c in row), flush=True)
                next_row += args.interval
                for child in watched.values():
                    child.check()
            time.sleep(max(0.0, min(due, next_row) - time.monotonic()))
        pool.shutdown(wait=True)
        latencies, errors = load.take()
        if latencies:
            memory = memory_mb(watched)
            rows.append(
                (
                    f"{time.monotonic() - started:.0f}",
                    len(latencies),
                    errors,
                    f"{common.percentile(latencies, 50) * 1000:.0f}",
                    f"{common.percentile(latencies, 99) * 1000:.0f}",
                    *(f"{memory[n]:.0f}" for n in names),
                )
            )
        print(f"load stopped after {load.sent} requests; draining up to {args.drain:g} s", flush=True)
        deadline = time.monotonic() + args.drain
        lost = lost_work(args.database_url)
        while (lost["jobs not final"] or lost["deliveries pending"]) and time.monotonic() < deadline:
            time.sleep(2)
            lost = lost_work(args.database_url)
        arrived = receiver.count()["distinct"]
        common.print_table(
            "Soak, per interval", ("t (s)", "requests", "errors", "p50 ms", "p99 ms", *(f"{n} MB" for n in names)), rows
        )
        missing = lost["deliveries"] - arrived
        common.print_table(
            "Lost work after the drain",
            ("jobs not final", "deliveries pending", "deliveries made", "arrived", "missing"),
            [(lost["jobs not final"], lost["deliveries pending"], lost["deliveries"], arrived, missing)],
        )
        errors_total = sum(int(r[2]) for r in rows)
        if load.statuses:
            print(f"errors by answer: {dict(load.statuses)}")
        figures = [
            common.Figure(
                "soak", f"errors, {args.rate:g} requests/s for {args.duration:g} s", errors_total, "", goal="0"
            ),
            common.Figure("soak", "jobs not final after the drain", lost["jobs not final"], "", goal="0"),
            common.Figure("soak", "deliveries pending after the drain", lost["deliveries pending"], "", goal="0"),
            common.Figure("soak", "deliveries missing at the receiver", max(0, missing), "", goal="0"),
        ]
        p99s = [int(r[4]) for r in rows if r[4] != "-"]
        if p99s:
            figures.append(common.Figure("soak", "p99 of the worst interval", max(p99s), "ms"))
        if first_memory:
            last = memory_mb(watched)
            common.print_table(
                "Memory, first interval -> end (MB)",
                ("process", "first", "end", "growth"),
                [(n, f"{first_memory[n]:.0f}", f"{last[n]:.0f}", f"{last[n] - first_memory[n]:+.0f}") for n in names],
            )
            figures += [
                common.Figure("soak", f"{n} memory at the end", last[n], "MB", "first interval", first_memory[n])
                for n in ("api", "worker", "beat")
            ]
        common.publish("soak", figures)  # errors and lost work are figures of their own (goal 0)
        return (
            0
            if not errors_total and not lost["jobs not final"] and not lost["deliveries pending"] and missing <= 0
            else 1
        )


if __name__ == "__main__":
    common.run_main(main)
