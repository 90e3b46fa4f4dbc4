"""Tokens per second and latency of ``POST /tokenize``, beside a bare aiohttp handler.

Platform: ``tessera api`` in a subprocess (its own database and Redis, rate limits off, WARNING logs, a
temporary data dir) and a tenant made with ``domain.tenancy.tenants.create_tenant``; every request tokenizes one
card. Reference: ``benchmarks/bare_aiohttp.py`` in a subprocess, answering a fixed JSON body. The load
generator is this process: one aiohttp ``ClientSession`` with a connection limit of ``--clients`` (64)
and as many coroutines in a closed loop for ``--duration`` (20) seconds. The targets alternate (bare,
platform, bare, platform for ``--rounds 2``); medians and the platform/bare ratio are printed.

``--workers N`` adds a third target: the same api with a second tenant that has a webhook subscribed to
``token.created`` (so each request also writes an event and a delivery row and sends a Celery task),
while ``tessera worker --concurrency N`` delivers to a local receiver; after each such round the
benchmark waits until the backlog of deliveries has drained so it does not load the next round.

Run from the repository root::

    .venv/bin/python benchmarks/tokenize.py [--duration 20] [--clients 64] [--rounds 2] [--workers 0]
"""

from __future__ import annotations

import os
import sys

# Run as a file, this file's folder comes first on sys.path, where this very file would shadow the
# standard library's ``tokenize`` (which aiohttp imports through ``inspect``). Put the repository root
# there instead; that also makes ``benchmarks.common`` importable.
if __name__ == "__main__" and not __package__:
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field

from benchmarks import common
from benchmarks.receiver import Receiver

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}
BODY = json.dumps(CARD).encode()
BARE, PLATFORM, WEBHOOKED = "bare aiohttp", "platform", "platform + webhook"


@dataclass(frozen=True)
class Target:
    """Where one variant sends its requests."""

    name: str
    url: str
    headers: dict[str, str]
    server: common.Child


@dataclass
class Round:
    """What one closed-loop run against one target measured."""

    target: str
    round: int
    ok: int = 0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    cores: dict[str, float] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        """Answers that were not 2xx, and requests that failed without an answer."""
        return sum(n for status, n in self.statuses.items() if not (isinstance(status, int) and status < 300))

    #: percentile -> seconds, when the load generator reports percentiles rather than latencies (wrk)
    percentiles: dict[float, float] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return common.ratio(self.ok, self.seconds)

    def latency_ms(self, q: float) -> float:
        if q in self.percentiles:
            return self.percentiles[q] * 1000
        return common.percentile(self.latencies, q) * 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20, help="seconds of load per round and target")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (and connection limit)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each target, alternating")
    parser.add_argument("--warmup", type=float, default=2, help="seconds of unmeasured load per target first")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="also measure tokenize with a webhook subscribed, with a worker of this concurrency",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=900,
        help="seconds to wait for the webhook backlog after a round of the webhook target",
    )
    parser.add_argument(
        "--client",
        choices=("auto", "wrk", "aiohttp"),
        default="auto",
        help="load generator: wrk (a C client, not the bottleneck), or this process's aiohttp "
        "client; auto: wrk when it is on PATH",
    )
    parser.add_argument("--client-threads", type=int, default=1, help="wrk threads")
    common.add_service_options(parser)
    return parser.parse_args(argv)


# ---- the load generator --------------------------------------------------------------------------


async def closed_loop(target: Target, clients: int, duration: float, result: Round) -> Round:
    """``clients`` coroutines each sending the next request as soon as the last is answered, for
    ``duration`` seconds, over one session limited to ``clients`` connections."""
    import aiohttp

    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop_at = loop.time() + duration

        async def client() -> None:
            while loop.time() < stop_at:
                sent = time.perf_counter()
                try:
                    async with session.post(target.url, data=BODY, headers=target.headers) as answer:
                        await answer.read()
                        status = answer.status
                except (TimeoutError, aiohttp.ClientError) as exc:
                    status = type(exc).__name__
                result.latencies.append(time.perf_counter() - sent)
                result.statuses[status] += 1
                if isinstance(status, int) and 200 <= status < 300:
                    result.ok += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        result.seconds = time.perf_counter() - started
    return result


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = {body}
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("WRK %d %d %d %d %d %d\\n", summary.requests, e.status,
    e.connect + e.read + e.write + e.timeout, summary.duration, latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_closed_loop(target: Target, args: argparse.Namespace, duration: float, result: Round) -> float:
    """``wrk`` with ``--clients`` connections for ``duration`` seconds (each connection sends its next
    request when the last is answered, like :func:`closed_loop`); fills ``result`` and returns the
    CPU seconds wrk used."""
    import tempfile

    headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in target.headers.items())
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT.format(body=json.dumps(BODY.decode()), headers=headers))
    try:
        argv = [
            "wrk",
            "-t",
            str(args.client_threads),
            "-c",
            str(args.clients),
            "-d",
            f"{max(1, round(duration))}s",
            "--timeout",
            "60s",
            "-s",
            script.name,
            target.url,
        ]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = child.stdout.read()
        _pid, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    finally:
        os.unlink(script.name)
    line = next((x for x in output.splitlines() if x.startswith("WRK ")), None)
    if child.returncode or line is None:
        raise RuntimeError(f"wrk failed ({child.returncode}): {output[-2000:]}")
    requests, non_2xx, socket_errors, micros, p50, p99 = (int(x) for x in line.split()[1:])
    result.ok = requests - non_2xx
    result.seconds = micros / 1e6
    result.statuses.update({"non-2xx": non_2xx, "socket error": socket_errors} if non_2xx or socket_errors else {})
    result.percentiles = {50: p50 / 1e6, 99: p99 / 1e6}
    return usage.ru_utime + usage.ru_stime


def measure(target: Target, args: argparse.Namespace, round_no: int, meter: common.CpuMeter | None) -> Round:
    """One closed-loop run (``round_no`` 0 is the warm-up: ``--warmup`` seconds, not metered)."""
    result = Round(target.name, round_no)
    if meter is not None:
        meter.start()
    duration = args.duration if round_no else args.warmup
    if args.client == "wrk":
        started = time.monotonic()
        client_cpu = wrk_closed_loop(target, args, duration, result)
        wall = time.monotonic() - started
    else:
        asyncio.run(closed_loop(target, args.clients, duration, result))
    if meter is not None:
        result.cores = meter.stop()
        if args.client == "wrk":
            result.cores["client"] = client_cpu / wall
    target.server.check()
    return result


# ---- set-up --------------------------------------------------------------------------------------


def start_server(children: common.Children, name: str, argv: list[str]) -> tuple[common.Child, str]:
    """Start a server on a free port (``argv`` gets ``--port P``); returns it and its base URL."""
    port = common.free_port()
    child = children.start(name, [*argv, "--port", str(port)])
    base_url = f"http://127.0.0.1:{port}"
    common.wait_http(f"{base_url}/", child)
    return child, base_url


def tokenize_is_served(target: Target) -> bool:
    """False while ``POST /tokenize`` answers 404 or 405 (the route is not there yet)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(target.url, data=BODY, headers=target.headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status = answer.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    return status not in (404, 405)


def meter_for(target: Target, worker: common.Child | None) -> common.CpuMeter:
    """Cores used by the target's server, this process (the client), PostgreSQL, Redis, the worker."""
    groups = {
        "server": common.process_tree(target.server.pid),
        "client": common.this_process(),
        "postgres": common.processes_named("postgres"),
        "redis": common.processes_named("redis-server"),
    }
    if worker is not None:
        groups["worker"] = common.process_tree(worker.pid)
    return common.CpuMeter(groups)


# ---- report --------------------------------------------------------------------------------------


def report(rounds: list[Round], names: list[str], workers: int, clients: int) -> list[common.Figure]:
    """Print the rounds, the medians and the ratios to the bare handler; the headline figures (each
    target's median requests/s, p50, p99 and server CPU per request beside the bare handler's; goals
    of issue 25: at least 0.20 of the bare requests/s, p99 at most 25 ms on a quiet machine and 50 ms
    with other work running). CPU per request: the server's cores (CPU seconds per second) divided
    by its answers per second, per round."""
    columns = ["server", "client", "postgres", "redis", *(["worker"] if workers else [])]
    common.print_table(
        "Rounds (cores = CPU seconds per second; postgres and redis count every client of theirs)",
        ["round", "target", "2xx/s", "p50 ms", "p99 ms", "errors", *(f"{c} cores" for c in columns)],
        [
            [
                r.round,
                r.target,
                r.per_second,
                r.latency_ms(50),
                r.latency_ms(99),
                r.errors,
                *(r.cores.get(c, float("nan")) for c in columns),
            ]
            for r in rounds
        ],
    )
    medians = {}
    cpu = {}
    for name in names:
        mine = [r for r in rounds if r.target == name]
        medians[name] = (
            common.median(r.per_second for r in mine),
            common.median(r.latency_ms(50) for r in mine),
            common.median(r.latency_ms(99) for r in mine),
            sum(r.errors for r in mine),
        )
        cpu[name] = common.median(common.ratio(r.cores.get("server", 0.0), r.per_second) * 1000 for r in mine)
    bare = medians[BARE]
    common.print_table(
        "Medians over the rounds (ratios: target / bare aiohttp; CPU: server CPU ms per request)",
        ["target", "requests/s", "p50 ms", "p99 ms", "errors", "requests/s ratio", "p50 ratio", "CPU ms/request"],
        [
            [name, rate, p50, p99, errors, common.ratio(rate, bare[0]), common.ratio(p50, bare[1]), cpu[name]]
            for name, (rate, p50, p99, errors) in medians.items()
        ],
    )
    failures = Counter()
    for r in rounds:
        failures.update({s: n for s, n in r.statuses.items() if not (isinstance(s, int) and s < 300)})
    if failures:
        print(f"\nerrors by status or exception: {dict(failures)}")
    drains = [r.notes["drain_s"] for r in rounds if "drain_s" in r.notes]
    if drains:
        print(f"webhook backlog drained in {', '.join(f'{s:.1f}' for s in drains)} s after the webhook rounds")
    figures = []
    for name, (rate, p50, p99, _errors) in medians.items():
        if name == BARE:
            continue
        plain = name == PLATFORM  # the goals are those of the plain tokenize, no webhook subscribed
        label = "POST /tokenize" if plain else "POST /tokenize, webhook subscribed"
        figures += [
            common.Figure(
                "tokenize",
                f"{label} requests/s, {clients} clients",
                rate,
                "/s",
                BARE,
                bare[0],
                "ratio ≥ 0.20" if plain else None,
            ),
            common.Figure("tokenize", f"{label} p50", p50, "ms", BARE, bare[1]),
            common.Figure(
                "tokenize", f"{label} p99", p99, "ms", BARE, bare[2], "≤ 25 ms quiet, ≤ 50 ms loaded" if plain else None
            ),
            common.Figure("tokenize", f"{label} api CPU per request", cpu[name], "ms", BARE, cpu[BARE]),
        ]
    return figures


def run_rounds(args, targets: list[Target], worker: common.Child | None, receiver: Receiver | None):
    """Warm every target up, then measure them in turn ``--rounds`` times; after each run of the webhook
    target, wait until the receiver has every delivery of the tokens it made."""
    hooked_tokens = 0
    rounds = []
    for round_no in range(args.rounds + 1):
        common.warn_if_shared(args.redis_url)
        for target in targets:
            result = measure(target, args, round_no, meter_for(target, worker) if round_no else None)
            if target.name == WEBHOOKED:
                hooked_tokens += result.ok
                drain_started = time.monotonic()
                receiver.wait_for(hooked_tokens, timeout=args.drain_timeout, children=[worker])
                result.notes["drain_s"] = time.monotonic() - drain_started
            if round_no:
                rounds.append(result)
                print(
                    f"round {round_no}: {target.name}: {result.per_second:,.0f} 2xx/s, "
                    f"p50 {result.latency_ms(50):.1f} ms, p99 {result.latency_ms(99):.1f} ms, "
                    f"{result.errors} errors",
                    flush=True,
                )
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client == "auto":
        args.client = "wrk" if shutil.which("wrk") else "aiohttp"
    elif args.client == "wrk" and not shutil.which("wrk"):
        print("wrk is not on PATH (apt-get install wrk)", file=sys.stderr)
        return 2
    print(f"load generator: {args.client}", flush=True)
    common.install_uvloop()
    extra = {"TESSERA_ALLOW_PRIVATE_DESTINATIONS": "true"} if args.workers else {}
    with common.fresh_platform(args, "tessera-bench-tokenize-", **extra) as scratch:
        tenant = common.make_tenant("bench-tokenize")
        json_header = {"content-type": "application/json"}
        with common.Children(scratch) as children:
            bare, bare_url = start_server(children, "bare", common.python_module("benchmarks.bare_aiohttp"))
            api, api_url = start_server(children, "api", [common.executable("tessera"), "api"])
            targets = [
                Target(BARE, f"{bare_url}/tokenize", json_header, bare),
                Target(PLATFORM, f"{api_url}/tokenize", {**json_header, "TS-API-KEY": tenant.api_key}, api),
            ]
            if not tokenize_is_served(targets[1]):
                print("POST /tokenize answers 404/405: the endpoint is not there yet", file=sys.stderr)
                return 2
            worker = receiver = None
            if args.workers:
                receiver = Receiver(children)
                hooked = common.make_tenant("bench-tokenize-webhook")
                common.subscribe_webhook(hooked.tenant_id, receiver.url)
                worker = common.start_platform_worker(children, args.workers)
                hooked_headers = {**json_header, "TS-API-KEY": hooked.api_key}
                targets.append(Target(WEBHOOKED, targets[1].url, hooked_headers, api))
            rounds = run_rounds(args, targets, worker, receiver)
    figures = report(rounds, [t.name for t in targets], args.workers, args.clients)
    if not any(r.errors for r in rounds):
        common.publish("tokenize", figures)
    return 0


if __name__ == "__main__":
    common.run_main(main)
