"""Warm reactor invocations per second and their latency, and cold starts, beside a bare Node.js
process fed over a pipe.

Platform: ``domain.reactors.runtime.ReactorRuntime.invoke`` of a trivial reactor
(``module.exports = async (req) => ({ raw: req.args })``) on a ``node22`` runtime with no
dependencies: the warm process in its sandbox (bubblewrap: user, PID, network, IPC and mount
namespaces, the seccomp filter; Node.js 22 from the wheel with ``--permission``; a clean
environment; limits; thawed with SIGCONT before and frozen with SIGSTOP after each call), the
request object ``{args, configuration}``, the newline-delimited JSON protocol with deadlines, the
result checks. Its one process is started and warmed before the first round.

Reference: the same function in a bare ``node`` process (same binary, no sandbox flags, no limits)
that reads one JSON line per call on stdin and writes one JSON line on stdout; this process writes
the same request object and reads the answer with a blocking ``readline``.

Each round runs the reference, then the platform, for ``--duration`` seconds each, one call at a
time in a closed loop (after ``--warmup`` seconds unmeasured before the first round), then
``--cold`` cold starts of each: a bare ``node`` started and answering its first call, and a reactor
version never seen before (a new sandbox, the code loaded, the first call answered). Printed: per
round the calls, calls per second, p50 and p99 latency (nearest rank) and the cores used by this
process and by the Node.js process; the medians, the ratio platform / bare of calls per second and
the difference of the p50 latencies (goal: within +2 ms); the cold starts' medians beside bare.
No database or Redis is used. Run from the repository root::

    .venv/bin/python benchmarks/reactors.py [--duration 10] [--rounds 3] [--warmup 2] [--cold 10]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks import common

FUNCTION = "async (req) => ({ raw: req.args })"
REQUEST_ARGS = {"amount": 1299, "currency": "USD", "card": {"token": "d2cbc1b4-5c3a-45b3-9e19-5b2f2e5d6a4f"}}
CONFIGURATION = {"PSP_URL": "https://psp.example.com", "MERCHANT": "m-42"}

BARE_PROGRAM = (
    "'use strict';\nconst handler = "
    + FUNCTION
    + """;
let buffered = '';
process.stdin.setEncoding('utf8');
process.stdin.on('data', async (chunk) => {
  buffered += chunk;
  let end;
  while ((end = buffered.indexOf('\\n')) >= 0) {
    const line = buffered.slice(0, end);
    buffered = buffered.slice(end + 1);
    const value = await handler(JSON.parse(line));
    process.stdout.write(JSON.stringify(value) + '\\n');
  }
});
"""
)

BARE, PLATFORM = "bare node over a pipe", "platform ReactorRuntime.invoke"


@dataclass
class Round:
    number: int
    target: str
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cores: dict[str, float] = field(default_factory=dict)
    errors: int = 0

    @property
    def per_second(self) -> float:
        return common.ratio(len(self.latencies), self.seconds)

    def p(self, q: float) -> float:
        return common.percentile(self.latencies, q) * 1000


class BareNode:
    """The reference: a bare ``node`` process running :data:`BARE_PROGRAM`."""

    def __init__(self, node: Path, scratch: Path):
        script = scratch / "bare.js"
        script.write_text(BARE_PROGRAM)
        self.process = subprocess.Popen([str(node), str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def call(self, payload: dict) -> object:
        self.process.stdin.write(json.dumps(payload, separators=(",", ":")).encode() + b"\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def closed_loop(call: Callable[[], object], duration: float) -> tuple[list[float], float]:
    """Call ``call`` one at a time for ``duration`` seconds: (latencies in s, wall seconds)."""
    latencies = []
    started = time.perf_counter()
    end = started + duration
    while True:
        before = time.perf_counter()
        if before >= end:
            break
        call()
        latencies.append(time.perf_counter() - before)
    return latencies, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds of calls per round and target")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each target, alternating")
    parser.add_argument("--warmup", type=float, default=2, help="seconds of unmeasured calls per target first")
    parser.add_argument("--cold", type=int, default=10, help="cold starts per round and target")
    args = parser.parse_args(argv)
    colds: dict[str, list[float]] = {BARE: [], PLATFORM: []}

    with common.scratch_dir("tessera-bench-reactors-") as scratch:
        common.adopt_env({"TESSERA_DATA_DIR": str(scratch / "data"), "TESSERA_LOG_LEVEL": "WARNING"})
        from domain.reactors.runtime import Reactor, ReactorRuntime, Runtime

        runtime = ReactorRuntime(scratch / "reactors")
        reactor = Reactor("bench", f"module.exports = {FUNCTION};", Runtime(image="node22"), tenant_id="bench")
        bare = BareNode(runtime.pool.node.node, scratch)
        payload = {"args": REQUEST_ARGS, "configuration": CONFIGURATION}
        try:
            expected = {"raw": REQUEST_ARGS}
            if bare.call(payload) != expected:
                raise RuntimeError("the bare process answered something else")
            if runtime.invoke(reactor, args=REQUEST_ARGS, configuration=CONFIGURATION).raw != REQUEST_ARGS:
                raise RuntimeError("the reactor answered something else")
            (platform_pid,) = runtime.pool.node_pids(reactor.key)
            targets = {
                BARE: (lambda: bare.call(payload), bare.process.pid),
                PLATFORM: (
                    lambda: runtime.invoke(reactor, args=REQUEST_ARGS, configuration=CONFIGURATION),
                    platform_pid,
                ),
            }
            print(
                f"Node.js {runtime.pool.node.version} ({runtime.pool.node.node}); "
                f"{args.rounds} rounds of {args.duration:g} s per target",
                flush=True,
            )
            for call, _ in targets.values():
                closed_loop(call, args.warmup)
            rounds = []
            for number in range(1, args.rounds + 1):
                for name, (call, pid) in targets.items():
                    meter = common.CpuMeter(
                        {"this process": common.this_process(), "node": lambda pid=pid: [psutil.Process(pid)]}
                    )
                    meter.start()
                    latencies, seconds = closed_loop(call, args.duration)
                    rounds.append(Round(number, name, latencies, seconds, meter.stop()))
                for cold in range(args.cold):
                    colds[BARE].append(cold_bare(runtime.pool.node.node, scratch, payload))
                    colds[PLATFORM].append(cold_platform(runtime, f"cold-{number}-{cold}"))
            if runtime.loads(reactor) != 1:
                raise RuntimeError(f"the reactor was loaded {runtime.loads(reactor)} times, not once")
        finally:
            bare.close()
            runtime.close()
    common.publish("reactors", report(rounds, colds))
    return 0


def cold_bare(node: Path, scratch: Path, payload: dict) -> float:
    """Seconds from starting a bare ``node`` to its first answer."""
    began = time.perf_counter()
    bare = BareNode(node, scratch)
    try:
        bare.call(payload)
        return time.perf_counter() - began
    finally:
        bare.close()


def cold_platform(runtime, name: str) -> float:
    """Seconds from the first call of a version never seen (a new sandboxed process) to its answer."""
    from domain.reactors.runtime import Reactor, Runtime

    reactor = Reactor(name, f"module.exports = {FUNCTION};", Runtime(image="node22"), tenant_id="bench")
    began = time.perf_counter()
    runtime.invoke(reactor, args=REQUEST_ARGS, configuration=CONFIGURATION)
    took = time.perf_counter() - began
    runtime.retire(reactor)
    return took


def report(rounds: list[Round], colds: dict[str, list[float]]) -> list[common.Figure]:
    """Print the rounds, the medians, the ratio of calls per second and the p50 difference, and
    the cold starts; the headline figures (warm calls/s and p50, cold start p50, each beside bare)."""
    common.print_table(
        "Rounds",
        ["round", "target", "calls", "calls/s", "p50 ms", "p99 ms", "this process cores", "node cores"],
        [
            [
                r.number,
                r.target,
                len(r.latencies),
                r.per_second,
                r.p(50),
                r.p(99),
                r.cores["this process"],
                r.cores["node"],
            ]
            for r in rounds
        ],
    )
    medians = {}
    for name in (BARE, PLATFORM):
        mine = [r for r in rounds if r.target == name]
        medians[name] = (
            common.median(r.per_second for r in mine),
            common.median(r.p(50) for r in mine),
            common.median(r.p(99) for r in mine),
        )
    bare, platform = medians[BARE], medians[PLATFORM]
    common.print_table(
        "Medians over the rounds",
        ["target", "calls/s", "p50 ms", "p99 ms", "calls/s ratio to bare", "p50 - bare p50 ms"],
        [[name, *values, common.ratio(values[0], bare[0]), values[1] - bare[1]] for name, values in medians.items()],
    )
    verdict = "within" if platform[1] - bare[1] <= 2.0 else "NOT within"
    print(f"\nwarm p50 {platform[1]:.3f} ms vs bare pipe {bare[1]:.3f} ms: {verdict} +2 ms")
    figures = [
        common.Figure("reactors", "warm calls/s, one at a time", platform[0], "/s", BARE, bare[0]),
        common.Figure("reactors", "warm p50", platform[1], "ms", BARE, bare[1], "≤ reference + 2 ms"),
    ]
    if colds[BARE]:
        cold_bare_ms = common.median(colds[BARE]) * 1000
        cold_platform_ms = common.median(colds[PLATFORM]) * 1000
        common.print_table(
            "Cold starts (median)",
            ["target", "starts", "p50 ms", "p99 ms"],
            [
                [name, len(values), common.median(values) * 1000, common.percentile(values, 99) * 1000]
                for name, values in colds.items()
            ],
        )
        print(
            f"\ncold start in the sandbox {cold_platform_ms:.1f} ms vs bare node {cold_bare_ms:.1f} ms "
            f"(+{cold_platform_ms - cold_bare_ms:.1f} ms)"
        )
        figures.append(common.Figure("reactors", "cold start p50", cold_platform_ms, "ms", "bare node", cold_bare_ms))
    return figures


if __name__ == "__main__":
    common.run_main(main)
