"""Warm synchronous ``POST /reactors/{id}/react`` beside the spine's own floor, a network token create.

Platform: ``tessera sandbox`` (its visa card answers at once), ``tessera api`` and ``tessera worker
--concurrency W`` (``--worker-concurrency``, default 1, so one warm Node.js process serves every call)
on a fresh database and Redis. One client, closed loop, alternating rounds of ``--duration`` seconds:

* ``POST /reactors/{id}/react`` of a trivial reactor (``module.exports = async (req) => ({ raw:
  req.args })``, no dependencies, warm): the run and its job recorded, the worker runs the code in its
  warm sandboxed process, the handler is woken by the job's outcome message and reads the sealed
  answer;
* the floor: ``POST /network-tokens`` (a job of the same protocol with an instant provider call).

Printed: per round calls, calls per second, p50 and p99 latency; then the medians and the p50
difference react - network token (goal: within +2 ms). The warm runtime itself against a bare Node.js
pipe is ``benchmarks/reactors.py``. Run from the repository root::

    .venv/bin/python benchmarks/reactor_invocations.py [--duration 10] [--rounds 3] [--warmup 3]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import base64
import json
import time

import urllib3

from benchmarks import common
from benchmarks.network_tokens import CARD
from benchmarks.reactors import Round

DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench_reactors"
ARGS = {"amount": 1299, "currency": "USD"}
REACT, FLOOR = "POST /reactors/{id}/react", "POST /network-tokens"
FLOOR_NAME = "network token create"


class Client:
    """One keep-alive HTTP connection to the api with the tenant's key."""

    def __init__(self, base_url: str, api_key: str):
        from config.settings import get_settings

        self.pool = urllib3.connection_from_url(base_url, maxsize=1, retries=False, timeout=60)
        self.headers = {get_settings().header("API-KEY"): api_key, "Content-Type": "application/json"}

    def post(self, path: str, body: object) -> tuple[int, object]:
        answer = self.pool.request("POST", path, body=json.dumps(body).encode(), headers=self.headers)
        return answer.status, json.loads(answer.data) if answer.data else None


def closed_loop(call, ok, duration: float, number: int, target: str) -> Round:
    """``call()`` one at a time for ``duration`` seconds; ``ok(answer)`` tells a success."""
    result = Round(number, target)
    started = time.perf_counter()
    while (before := time.perf_counter()) < started + duration:
        answer = call()
        if ok(answer):
            result.latencies.append(time.perf_counter() - before)
        else:
            result.errors += 1
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per round and target")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each target, alternating")
    parser.add_argument("--warmup", type=float, default=3, help="unmeasured seconds per target first")
    parser.add_argument("--worker-concurrency", type=int, default=1, help="processes of the platform's worker")
    common.add_service_options(parser)
    parser.set_defaults(database_url=DEFAULT_DATABASE_URL)
    args = parser.parse_args(argv)
    sandbox_port, api_port = common.free_port(), common.free_port()
    extra = {
        "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "TESSERA_API_PORT": str(api_port),
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
    }
    with common.fresh_platform(args, "tessera-bench-reactor-invocations-", **extra) as scratch:
        advisories = scratch / "advisories.json"
        advisories.write_text("[]")
        common.adopt_env({"TESSERA_REACTOR_ADVISORIES": str(advisories)})
        tenant = common.make_tenant("bench-reactors")
        base_url = f"http://127.0.0.1:{api_port}"
        with common.Children(scratch) as children:
            sandbox, api = common.start_sandbox_and_api(children, sandbox_port, api_port)
            worker = common.start_platform_worker(children, args.worker_concurrency)
            watched = [sandbox, api, worker]
            client = Client(base_url, tenant.api_key)
            status, reactor = client.post(
                "/reactors",
                {
                    "name": "bench",
                    "code": "module.exports = async (req) => ({ raw: req.args });",
                    "runtime": {"image": "node22"},
                },
            )
            if status != 201:
                raise RuntimeError(f"the reactor was not created: {status} {reactor}")

            def active() -> bool:
                answer = client.pool.request("GET", f"/reactors/{reactor['id']}", headers=client.headers)
                return json.loads(answer.data)["state"] == "active"

            common.wait_until(active, timeout=120, what="the reactor's build", interval=0.2, children=watched)
            targets = {
                REACT: (
                    lambda: client.post(f"/reactors/{reactor['id']}/react", {"args": ARGS}),
                    lambda a: a == (200, {"raw": ARGS}),
                ),
                FLOOR: (
                    lambda: client.post("/network-tokens", {"data": CARD}),
                    lambda a: a[0] == 201 and a[1].get("status") == "active",
                ),
            }
            for name, (call, ok) in targets.items():
                closed_loop(call, ok, args.warmup, 0, name)
            rounds = [
                closed_loop(call, ok, args.duration, number, name)
                for number in range(1, args.rounds + 1)
                for name, (call, ok) in targets.items()
            ]
            for child in watched:
                child.check()
    figures = report(rounds)
    if figures is None:
        return 1
    common.publish("reactor_invocations", figures)
    return 0


def report(rounds: list[Round]) -> list[common.Figure] | None:
    """Print the rounds and the medians; the headline figures (react p50 and p99 beside the network
    token create's; goal: p50 within +2 ms), None unless every call succeeded."""
    common.print_table(
        "Rounds (one client, closed loop)",
        ["round", "target", "calls", "calls/s", "p50 ms", "p99 ms", "errors"],
        [[r.number, r.target, len(r.latencies), r.per_second, r.p(50), r.p(99), r.errors] for r in rounds],
    )
    medians = {
        name: (
            common.median(r.per_second for r in rounds if r.target == name),
            common.median(r.p(50) for r in rounds if r.target == name),
            common.median(r.p(99) for r in rounds if r.target == name),
        )
        for name in (REACT, FLOOR)
    }
    common.print_table(
        "Medians over the rounds",
        ["target", "calls/s", "p50 ms", "p99 ms"],
        [[name, *values] for name, values in medians.items()],
    )
    difference = medians[REACT][1] - medians[FLOOR][1]
    print(
        f"\nwarm react p50 - network token create p50: {difference:+.3f} ms "
        f"({'within' if difference <= 2.0 else 'NOT within'} +2 ms)"
    )
    if not all(r.errors == 0 and r.latencies for r in rounds):
        return None
    react, floor = medians[REACT], medians[FLOOR]
    return [
        common.Figure(
            "reactor_invocations", "react p50, 1 client", react[1], "ms", FLOOR_NAME, floor[1], "≤ reference + 2 ms"
        ),
        common.Figure("reactor_invocations", "react p99, 1 client", react[2], "ms", FLOOR_NAME, floor[2]),
    ]


if __name__ == "__main__":
    common.run_main(main)
