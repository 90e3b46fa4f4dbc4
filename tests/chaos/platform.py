"""A platform of its own for fault injection: real ``tessera api``, ``tessera beat`` and ``tessera
worker`` processes on a database and a Redis key prefix of their own, a sandbox of its own reached
through a :class:`FaultyProxy`, and a :class:`tests.helpers.WebhookReceiver` (``hold_next``) for webhooks.

The proxy forwards every call to the sandbox at once (so the provider does its work), and can be told
to hold the *answer* of the next matching call (the worker is then mid-call when it is killed), to
answer slowly, to drop the connection, or to answer 5xx. Nothing is simulated inside the platform.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from sqlalchemy import create_engine, text

from tests.conftest import TEST_DATABASE_URL, _drop_database, free_port
from tests.conftest import serve_in_thread as serve
from tests.helpers import ApiClient, WebhookReceiver, wait_until
from tests.network_tokens.test_network_token_kill import Processes, own_platform
from tests.security.leaks import observe, scan_database

#: Short timings so a killed job comes back within a minute: the lease a dead worker held runs out, the
#: relay re-sends. Each lease stays longer than the provider call it covers, as it must; provider calls
#: may wait 20 s (every kind is caught before the worker is killed, so the first caught call waits).
CHAOS_ENV = {
    "TESSERA_JOB_LEASE_SECONDS": "25",
    "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "1",
    "TESSERA_NETWORK_TOKEN_WAIT_SECONDS": "1",
    "TESSERA_AGENTIC_WAIT_SECONDS": "1",
    "TESSERA_AGENTIC_PROVIDER_TIMEOUT_SECONDS": "20",
    "TESSERA_PROVIDER_CONNECT_TIMEOUT_SECONDS": "1",
    "TESSERA_PROVIDER_READ_TIMEOUT_SECONDS": "20",
    "TESSERA_WEBHOOK_TIMEOUT_SECONDS": "3",
    "TESSERA_LOG_LEVEL": "WARNING",
}


@dataclass
class Fault:
    """What the proxy does to the next ``count`` calls that ``matches(method, path)``: ``hold`` the
    answer until released, ``slow`` (answer after ``seconds``), ``drop`` the connection after the
    provider did its work, or answer ``5xx`` without forwarding."""

    kind: str
    matches: Callable[[str, str], bool]
    count: int = 1
    seconds: float = 0.0
    hit: threading.Event = field(default_factory=threading.Event)
    hits: int = 0


class FaultyProxy:
    """Forwards everything to the sandbox; applies armed :class:`Fault` s to matching calls."""

    def __init__(self, sandbox: str):
        self.sandbox = sandbox
        self.faults: list[Fault] = []
        self.release = threading.Event()
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.hits < fault.count and fault.matches(method, path):
                    fault.hits += 1
                    fault.hit.set()
                    return fault
        return None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fault = self._take(request.method, request.path)
        if fault is not None and fault.kind == "5xx":
            return web.Response(status=503, text='{"error": "unavailable"}', content_type="application/json")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.sandbox + request.path_qs, data=body or None, headers=headers) as answer,
        ):
            payload, status = await answer.read(), answer.status
        if fault is not None and fault.kind == "hold":
            while not self.release.is_set():  # the worker is killed meanwhile
                await asyncio.sleep(0.05)
        if fault is not None and fault.kind == "slow":
            await asyncio.sleep(fault.seconds)
        if fault is not None and fault.kind == "drop":
            request.transport.close()
            raise asyncio.CancelledError
        return web.Response(status=status, body=payload, content_type="application/json")


@dataclass
class Platform:
    """The running platform: its processes, clients and the faults one can inject."""

    processes: Processes
    api_url: str
    sandbox: str
    proxy: FaultyProxy
    receiver: WebhookReceiver
    database_url: str
    client: ApiClient
    worker_number: int = 0

    def start_worker(self, concurrency: int = 2) -> str:
        """A new ``tessera worker``; its name."""
        self.worker_number += 1
        name = f"worker-{self.worker_number}"
        self.processes.start(name, "worker", "--concurrency", str(concurrency), "--hostname", f"{name}@%h")
        return name

    def sql(self, query: str, **params) -> list[dict]:
        """Rows of ``query`` on the platform's database."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [dict(row) for row in conn.execute(text(query), params).mappings()]
        finally:
            engine.dispose()

    def healthy_within(self, seconds: float = 10.0) -> float:
        """Wait until ``GET /status`` answers 200; how long it took (fails after ``seconds``)."""
        started = time.monotonic()
        wait_until(lambda: _answers(self.api_url), timeout=seconds, interval=0.1)
        return time.monotonic() - started

    def unfinished_work(self) -> list[dict]:
        """Jobs (a webhook delivery's work is a job too) neither final nor clearly pending: running
        under a lease that ran out long ago, or queued and due for long without being taken (work the
        platform lost)."""
        return self.sql(
            "SELECT CASE WHEN kind = 'webhooks.deliver' THEN 'delivery' ELSE 'job' END AS what, kind, status, "
            "id::text FROM jobs WHERE "
            "(status = 'running' AND lease_expires_at < now() - interval '60 seconds') OR "
            "(status = 'queued' AND due_at < now() - interval '60 seconds')"
        )


def _answers(base_url: str) -> bool:
    try:
        return ApiClient(base_url).get("/status").status == 200
    except Exception:
        return False


@contextlib.contextmanager
def platform(
    tenant_name: str = "chaos", extra_env: dict[str, str] | None = None, *, database_server: str = TEST_DATABASE_URL
):
    """Start :class:`Platform` (api and beat; workers with :meth:`Platform.start_worker`) on a database
    of its own on ``database_server``'s server; everything is stopped and dropped afterwards."""
    import json

    from sandbox.app import make_app

    sandbox_port, proxy_port, api_port = free_port(), free_port(), free_port()
    stop_sandbox = serve(lambda: make_app(), sandbox_port)
    sandbox = f"http://127.0.0.1:{sandbox_port}"
    proxy = FaultyProxy(sandbox)
    stop_proxy = serve(proxy.app, proxy_port)
    receiver = WebhookReceiver().start()
    database_url, work_dir, env = own_platform(
        f"chaos{os.urandom(2).hex()}",
        f"http://127.0.0.1:{proxy_port}",
        api_port,
        {**CHAOS_ENV, **(extra_env or {})},
        database_server=database_server,
    )
    processes = Processes(work_dir, env)
    api_url = f"http://127.0.0.1:{api_port}"
    try:
        processes.start("api", "api")
        processes.start("beat", "beat")
        tenant = json.loads(
            processes.run(
                "tenants", "create", "--name", tenant_name, "--owner-email", f"{tenant_name}@example.com", "--json"
            )
        )
        running = Platform(
            processes, api_url, sandbox, proxy, receiver, database_url, ApiClient(api_url, tenant["api_key"])
        )
        running.healthy_within(60)
        yield running
    except BaseException:
        print(processes.logs())
        raise
    finally:
        proxy.release.set()
        receiver.release.set()
        processes.stop_all()
        for log in sorted(work_dir.glob("*.log")):  # the processes' own logs go to the secrets scan
            observe("logs of tessera processes", log.read_bytes())
        with contextlib.suppress(Exception):  # the database may be gone with a crashed server
            scan_database(database_url)
        receiver.stop()
        stop_proxy()
        stop_sandbox()
        _drop_database(database_url)
