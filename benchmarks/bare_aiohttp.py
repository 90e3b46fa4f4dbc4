"""The reference server of ``benchmarks/tokenize.py``: a bare aiohttp handler answering a fixed JSON body.

It reads the request body (as the platform must) and answers 201 with a token-shaped JSON object, with
no middleware, authentication, validation or database. Run from the repository root::

    .venv/bin/python -m benchmarks.bare_aiohttp --port 8090
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

from benchmarks.common import install_uvloop

BODY = json.dumps(
    {
        "id": "d2cbc1b4-5c3e-40d4-9a5d-8e8f3c1b5a9e",
        "type": "card",
        "tenant_id": "0b3e6a53-1a87-4f53-8e49-4e8a5b0f1c2d",
        "mask": {"number": "{{ data.number | reveal_last: 4 }}"},
        "data": {"number": "XXXXXXXXXXXX4242", "expiration_month": 12, "expiration_year": 2031},
        "fingerprint": None,
        "containers": ["/card/high/"],
    },
    separators=(",", ":"),
).encode()


async def tokenize(request: web.Request) -> web.Response:
    """Read the body, answer the fixed token."""
    await request.read()
    return web.Response(status=201, body=BODY, content_type="application/json")


async def ready(_request: web.Request) -> web.Response:
    """Readiness probe."""
    return web.Response(text="ok")


def build_app() -> web.Application:
    """The application: ``POST /tokenize`` and ``GET /`` (readiness)."""
    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/", ready)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    install_uvloop()
    web.run_app(build_app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
