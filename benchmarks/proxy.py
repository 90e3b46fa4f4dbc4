"""Proxy round trip (``POST /proxy/charges``) beside a bare aiohttp call of the same destination.

The destination is a bare aiohttp handler over HTTPS on loopback with a certificate of a test CA
(``tests/proxy/certificates.py``), answering 201 with a small JSON body. Targets, alternating per round:

* ``bare``: the client POSTs the request to the destination itself;
* ``proxy-N`` for each N of ``--tokens`` (default 0, 1, 20): the client POSTs the same request to
  ``tessera api``'s ``/proxy/charges`` with ``<prefix>-PROXY-URL``, its JSON body holding N
  ``{{ <token_id> | json: "$.number" }}`` expressions of N distinct card tokens.

Each target gets ``--requests`` requests from ``--clients`` concurrent clients (one ``ClientSession``);
the tables give p50, p99 (ms), requests per second, and each proxy target's p50 beside the bare p50
(difference and ratio). The destination name resolves to 127.0.0.1 in this process and in the api's
(which this script starts through ``--serve-api`` to do so); everything else is real.

    .venv/bin/python -m benchmarks.proxy --requests 300 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import time

from benchmarks import common

ANSWER = b'{"id":"ch_1","status":"succeeded"}'


# ---- the child processes ------------------------------------------------------------------------


def serve_destination(port: int, cert: str, key: str) -> None:
    """The destination: ``POST /<anything>`` reads the body and answers 201 with :data:`ANSWER`."""
    from aiohttp import web

    async def charge(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=201, body=ANSWER, content_type="application/json")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", charge)
    common.install_uvloop()
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=context, print=None, access_log=None)


def serve_api(port: int) -> None:
    """``tessera api`` (one process) with the destination's name resolving to loopback."""
    from aiohttp import web

    from tests.proxy.certificates import resolve_names

    resolve_names()
    from app.main import init_app

    common.install_uvloop()
    web.run_app(init_app(), host="127.0.0.1", port=port, print=None, access_log=None)


# ---- the load ----------------------------------------------------------------------------------------


async def _load(
    url: str, body: bytes, headers: dict[str, str], *, requests: int, clients: int, context: ssl.SSLContext
) -> tuple[list[float], float, int]:
    """``(latencies in ms, wall seconds, failures)`` of ``requests`` POSTs from ``clients`` workers."""
    import aiohttp

    latencies: list[float] = []
    failures = 0
    left = requests
    connector = aiohttp.TCPConnector(limit=clients, ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal left, failures
            while left > 0:
                left -= 1
                started = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    if answer.status != 201:
                        failures += 1
                latencies.append((time.perf_counter() - started) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return latencies, time.perf_counter() - started, failures


def _tokens(base_url: str, api_key: str, count: int) -> list[str]:
    import urllib.request

    ids = []
    for i in range(count):
        card = {
            "type": "card",
            "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031 + i % 5},
        }
        request = urllib.request.Request(
            f"{base_url}/tokens",
            data=json.dumps(card).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "TS-API-KEY": api_key},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            ids.append(json.loads(answer.read())["id"])
    return ids


def _body(ids: list[str]) -> bytes:
    """The charge request: an amount and one card number per id (an expression, or the number)."""
    cards = [f'{{{{ {token_id} | json: "$.number" }}}}' for token_id in ids]
    return json.dumps({"amount": 1000, "currency": "eur", "cards": cards or ["4242424242424242"]}).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_service_options(parser)
    parser.add_argument("--requests", type=int, default=2000, help="requests per target and round")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", default="0,1,20", help="detokenized tokens per proxied request")
    parser.add_argument("--serve-destination", nargs=3, metavar=("PORT", "CERT", "KEY"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-api", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_destination:
        port, cert, key = args.serve_destination
        serve_destination(int(port), cert, key)
        return 0
    if args.serve_api:
        serve_api(args.serve_api)
        return 0
    counts = [int(n) for n in args.tokens.split(",")]
    from tests.proxy.certificates import DEST, make_certificates, resolve_names

    with common.fresh_platform(args, "tessera-bench-proxy-") as scratch:
        ca, cert, key = make_certificates(scratch)
        common.adopt_env({"TESSERA_PROXY_CA_BUNDLE": str(ca), "TESSERA_ALLOW_PRIVATE_DESTINATIONS": "true"})
        tenant = common.make_tenant("bench-proxy")
        resolve_names()
        context = ssl.create_default_context(cafile=str(ca))
        with common.Children(scratch) as children:
            port, api_port = common.free_port(), common.free_port()
            destination = children.start(
                "destination",
                common.python_module("benchmarks.proxy", "--serve-destination", str(port), str(cert), str(key)),
            )
            api = children.start("api", common.python_module("benchmarks.proxy", "--serve-api", str(api_port)))
            api_url = f"http://127.0.0.1:{api_port}"
            common.wait_http(f"{api_url}/status", api)
            common.wait_until(
                lambda: _reachable(f"https://{DEST}:{port}/", context),
                timeout=30,
                what="destination answering",
                children=[destination],
            )
            ids = _tokens(api_url, tenant.api_key, max(counts))
            base = f"https://{DEST}:{port}"
            targets = {"bare": (f"{base}/v1/charges", _body([]), {"Content-Type": "application/json"})}
            for n in counts:
                targets[f"proxy-{n}"] = (
                    f"{api_url}/proxy/v1/charges",
                    _body(ids[:n]),
                    {"Content-Type": "application/json", "TS-API-KEY": tenant.api_key, "TS-PROXY-URL": base},
                )
            results: dict[str, list[tuple[list[float], float, int]]] = {name: [] for name in targets}
            for round_number in range(1, args.rounds + 1):
                rows = []
                for name, (url, body, headers) in targets.items():
                    asyncio.run(
                        _load(
                            url, body, headers, requests=min(50, args.requests), clients=args.clients, context=context
                        )
                    )  # warm-up: pools, caches
                    latencies, wall, failures = asyncio.run(
                        _load(url, body, headers, requests=args.requests, clients=args.clients, context=context)
                    )
                    results[name].append((latencies, wall, failures))
                    rows.append(
                        [
                            name,
                            common.percentile(latencies, 50),
                            common.percentile(latencies, 99),
                            len(latencies) / wall,
                            failures,
                        ]
                    )
                common.print_table(f"round {round_number}", ["target", "p50 ms", "p99 ms", "req/s", "failed"], rows)
            bare = common.median(common.percentile(r[0], 50) for r in results["bare"])
            rows = []
            for name, runs in results.items():
                p50 = common.median(common.percentile(r[0], 50) for r in runs)
                p99 = common.median(common.percentile(r[0], 99) for r in runs)
                rate = common.median(len(r[0]) / r[1] for r in runs)
                rows.append([name, p50, p99, rate, p50 - bare, common.ratio(p50, bare)])
            common.print_table(
                f"medians over {args.rounds} round(s), {args.clients} clients",
                ["target", "p50 ms", "p99 ms", "req/s", "p50 - bare ms", "p50 / bare"],
                rows,
            )
            failed = sum(r[2] for runs in results.values() for r in runs)
    if failed:
        return 1
    common.publish("proxy", headline(rows, args.clients))
    return 0


GOALS = {0: "≤ reference + 2 ms", 20: "≤ reference + 5 ms"}
"""The p50 goals by number of tokens, with one client: at most this over the bare call's p50."""


def headline(rows: list[list], clients: int) -> list[common.Figure]:
    """The proxy targets' median p50 beside the bare call's, from the medians table's rows
    (``[target, p50, p99, req/s, p50 - bare, p50 / bare]``)."""
    bare = next(row[1] for row in rows if row[0] == "bare")
    figures = []
    for name, p50, *_ in rows:
        if name == "bare":
            continue
        tokens = int(name.removeprefix("proxy-"))
        label = f"p50, {tokens} token{'' if tokens == 1 else 's'}, {clients} client{'' if clients == 1 else 's'}"
        figures.append(
            common.Figure("proxy", label, p50, "ms", "bare call", bare, GOALS.get(tokens) if clients == 1 else None)
        )
    return figures


def _reachable(url: str, context: ssl.SSLContext) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST", data=b"{}"), timeout=2, context=context):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    common.run_main(main)
