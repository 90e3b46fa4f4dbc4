"""A fast webhook receiver for the benchmarks: answers every POST with 200 and counts what it got.

``GET /count`` answers ``{"distinct": n, "requests": m, "last_new_at": t}``: how many distinct
``webhook-id`` headers arrived, how many POSTs in all (the difference is duplicates), and the wall-clock
time (``time.time()``) at which the newest distinct id arrived. ``POST /reset`` forgets everything.
Run from the repository root::

    .venv/bin/python -m benchmarks.receiver --port 9000
"""

from __future__ import annotations

import argparse
import time

from aiohttp import web

from benchmarks.common import install_uvloop


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    install_uvloop()
    web.run_app(build_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
