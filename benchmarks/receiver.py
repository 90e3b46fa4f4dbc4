"""A fast webhook receiver for the benchmarks: answers every POST with 200 and counts what it got;
:class:`Receiver` starts it as a child process of a benchmark and reads its counters.

``GET /count`` answers ``{"distinct": n, "requests": m, "last_new_at": t}``: how many distinct
``webhook-id`` headers arrived, how many POSTs in all (the difference is duplicates), and the wall-clock
time (``time.time()``) at which the newest distinct id arrived. ``POST /reset`` forgets everything.
Run from the repository root::

    .venv/bin/python -m benchmarks.receiver --port 9000
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections.abc import Iterable

from aiohttp import web

from benchmarks import common


class Tally:
    """What the receiver has seen."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ids: set[str] = set()
        self.requests = 0
        self.last_new_at: float | None = None

    def see(self, message_id: str | None) -> None:
        self.requests += 1
        if message_id and message_id not in self.ids:
            self.ids.add(message_id)
            self.last_new_at = time.time()


def build_app() -> web.Application:
    """``POST /<anything>`` (a delivery), ``GET /count``, ``POST /reset``."""
    tally = Tally()

    async def count(_request: web.Request) -> web.Response:
        return web.json_response(
            {"distinct": len(tally.ids), "requests": tally.requests, "last_new_at": tally.last_new_at}
        )

    async def reset(_request: web.Request) -> web.Response:
        tally.reset()
        return web.json_response({"distinct": 0})

    async def deliver(request: web.Request) -> web.Response:
        await request.read()
        tally.see(request.headers.get("webhook-id"))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/count", count)
    app.router.add_post("/reset", reset)
    app.router.add_post("/{path:.*}", deliver)
    return app


class Receiver:
    """The webhook receiver subprocess (``benchmarks/receiver.py``) and its counters."""

    def __init__(self, children: common.Children):
        port = common.free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.child = children.start("receiver", common.python_module("benchmarks.receiver", "--port", str(port)))
        common.wait_http(f"{self.base_url}/count", self.child)

    @property
    def url(self) -> str:
        """The URL to subscribe a webhook to."""
        return f"{self.base_url}/hook"

    def count(self) -> dict:
        """``{"distinct", "requests", "last_new_at"}`` (see ``benchmarks/receiver.py``)."""
        return json.loads(common.http_get(f"{self.base_url}/count")[1])

    def reset(self) -> None:
        """Forget every message id seen so far."""
        with urllib.request.urlopen(urllib.request.Request(f"{self.base_url}/reset", method="POST"), timeout=5):
            pass

    def wait_for(
        self, distinct: int, *, timeout: float, stall: float = 60.0, children: Iterable[common.Child] = ()
    ) -> dict:
        """Wait until ``distinct`` message ids have arrived and return the counters; TimeoutError after
        ``timeout`` seconds, or sooner when no new one has arrived for ``stall`` seconds."""
        watched = [self.child, *children]
        started = last_progress = time.monotonic()
        last = -1
        while True:
            state = self.count()
            if state["distinct"] >= distinct:
                return state
            now = time.monotonic()
            if state["distinct"] != last:
                last, last_progress = state["distinct"], now
            for child in watched:
                child.check()
            if now - started > timeout or now - last_progress > stall:
                raise TimeoutError(
                    f"{last:,} of {distinct:,} webhook deliveries arrived; none for {now - last_progress:.0f} s"
                )
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    common.install_uvloop()
    web.run_app(build_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
