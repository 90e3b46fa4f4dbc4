"""The sandbox card network's account-updates endpoint: CPU seconds per 300,000 rows.

Runs ``tessera sandbox`` in a child process, sends 100 calls of 3,000 rows (the batch size the platform
sends) and prints the child's CPU time (user + system) beside the wall time. The reference is the
platform's account updater itself: a 300,000-row file should not wait on its sandbox.

    python -m benchmarks.sandbox_account_updates [--calls 100] [--rows 3000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil
import urllib3

from benchmarks.common import Figure, free_port, publish, run_main, wait_until

UPDATES = "/card-network/account-updates"
PANS = (
    "4242424242424242",
    "4000000000001018",
    "4000000000001034",
    "4000000000001059",
    "4000000000001010",
    "5555555555554444",
    "4012888888881881",
    "4000056655665556",
)


def main() -> int:
    """Run the measurement; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rows", type=int, default=3000)
    args = parser.parse_args()
    year = time.gmtime().tm_year + 2
    items = [
        {
            "ref": f"token-{i:08d}",
            "pan": PANS[i % len(PANS)],
            "expiration_month": i % 12 + 1,
            "expiration_year": year,
            "merchant_id": None,
        }
        for i in range(args.rows)
    ]
    body = json.dumps({"merchant_id": "SANDBOX", "tenant_type": "test", "items": items}).encode()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", f"from sandbox.app import run; run('127.0.0.1', {port})"]
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as child:
        try:
            wait_until(lambda: _healthy(base_url), timeout=20, what="the sandbox")
            process = psutil.Process(child.pid)
            before, started = process.cpu_times(), time.monotonic()
            for _ in range(args.calls):
                answer = urllib3.request(
                    "POST",
                    base_url + UPDATES,
                    body=body,
                    retries=False,
                    timeout=60,
                    headers={"Content-Type": "application/json"},
                )
                if answer.status != 200:
                    print(f"unexpected answer {answer.status}", file=sys.stderr)
                    return 1
            after, wall = process.cpu_times(), time.monotonic() - started
        finally:
            child.terminate()
            child.wait(10)
    cpu = (after.user - before.user) + (after.system - before.system)
    rows = args.calls * args.rows
    print(
        f"{rows} rows in {args.calls} calls: sandbox CPU {cpu:.2f} s ({cpu / rows * 1e6:.1f} us/row), wall {wall:.2f} s"
    )
    publish(
        "sandbox_account_updates",
        [Figure("sandbox_account_updates", "sandbox CPU per account-update row", cpu / rows * 1e6, "us")],
    )
    return 0


def _healthy(base_url: str) -> bool:
    try:
        return urllib3.request("GET", base_url + "/health", retries=False, timeout=1).status == 200
    except urllib3.exceptions.HTTPError:
        return False


if __name__ == "__main__":
    run_main(main)
