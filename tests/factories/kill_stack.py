"""The kill-test stack shared by the kill tests of several packages (agentic, key rotation, reactors):
``tessera api``, ``tessera beat`` and workers as real processes on a Redis key prefix of their own
(so the in-process test worker of the other tests never takes their tasks), and a proxy in front of
the sandbox that holds chosen calls or their answers while a worker is killed. No tests here."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from storage.db import session_scope
from tests.conftest import REDIS_PREFIX, TEST_BROKER_URL, free_port
from tests.factories.agentic import BASE
from tests.helpers import ApiClient, wait_until

TESSERA = str(Path(sys.executable).with_name("tessera"))
HOLD_SECONDS = 90.0


def enrollment_creates(method: str, parts: list[str]) -> bool:
    """The calls :class:`HoldingProxy` holds by default: enrollment creates."""
    return method == "POST" and parts[0] == "agentic" and parts[-1] == "enrollments"


class HoldingProxy:
    """Forwards everything to the sandbox; the answers of the calls ``holds`` picks (enrollment
    creates by default) are held back, or, with ``before`` true, the calls themselves (never
    forwarded: released, they answer 503)."""

    def __init__(self, sandbox: str, holds=enrollment_creates, *, before: bool = False):
        self.sandbox = sandbox
        self.holds = holds
        self.before = before
        self.held: list[tuple[str, float]] = []  # (provider, arrival time) of each held call
        self.answered: list[str] = []
        self.released = threading.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        parts = request.path.strip("/").split("/")
        held = self.holds(request.method, parts)
        if held and self.before:  # the call never reaches the provider
            await self._hold(parts)
            return web.Response(status=503, body=b"{}", content_type="application/json")
        async with (
            aiohttp.ClientSession() as http,
            http.request(request.method, self.sandbox + request.path_qs, data=body or None, headers=headers) as answer,
        ):
            payload, status = await answer.read(), answer.status
        if held and not self.before:
            await self._hold(parts)
        self.answered.append(request.path)
        return web.Response(status=status, body=payload, content_type="application/json")

    async def _hold(self, parts: list[str]) -> None:
        self.held.append((parts[1], time.monotonic()))
        deadline = time.monotonic() + HOLD_SECONDS
        while not self.released.is_set() and time.monotonic() < deadline:  # the worker is killed meanwhile
            await asyncio.sleep(0.05)


@contextlib.contextmanager
def processes(log_dir: Path):
    """Start children in their own process groups; every one is stopped when the block ends."""
    started: list[subprocess.Popen] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(log_dir / f"{name}.log", "wb")  # closed with the process below
        child = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=Path(__file__).parents[2],
        )
        child.log = log
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        for child in reversed(started):
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait(5)
            child.log.close()


def _log_tail(log_dir: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        for path in sorted(log_dir.glob("*.log"))
    )


def broker_env(prefix: str) -> dict[str, str]:
    """The broker settings of a stack isolated under ``prefix``: nothing on Redis (the key prefix keeps
    its queues apart); on RabbitMQ a virtual host of its own, made now and deleted when the run ends,
    so a message a killed worker held is never handed to another test's worker (RabbitMQ redelivers it
    at once, where Redis hides it for the visibility timeout)."""
    if not TEST_BROKER_URL.startswith("amqp"):
        return {}
    vhost = prefix.rstrip(":")
    for command in (["add_vhost", vhost], ["set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"]):
        subprocess.run(["rabbitmqctl", "-q", *command], check=True, capture_output=True, timeout=60)
    atexit.register(subprocess.run, ["rabbitmqctl", "-q", "delete_vhost", vhost], capture_output=True, timeout=60)
    server = TEST_BROKER_URL.split("//", 1)[1].split("/", 1)[0]
    return {"TESSERA_BROKER_URL": f"{TEST_BROKER_URL.split('//', 1)[0]}//{server}/{vhost}"}


@pytest.fixture
def isolated_prefix(redis_flushed):
    prefix = f"{REDIS_PREFIX}kill{os.urandom(3).hex()}:"
    yield prefix
    for key in redis_flushed.scan_iter(match=f"{prefix}*", count=1000):
        redis_flushed.delete(key)


@contextlib.contextmanager
def stack(prefix: str, proxy_port: int, *, log_prefix: str, **settings: str):
    """``tessera api`` and ``tessera beat`` on Redis prefix ``prefix`` and worker A, which reaches the
    sandbox through the proxy on ``proxy_port``, for a new tenant (``settings``: more environment);
    yields ``(start, worker_a, client, tenant, env)``. The processes' log tails are printed when the
    block fails."""
    from domain.tenancy.tenants import create_tenant

    api_port = free_port()
    env = {
        "TESSERA_REDIS_KEY_PREFIX": prefix,
        **broker_env(prefix),
        "TESSERA_API_PORT": str(api_port),
        "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "1",
        "TESSERA_AGENTIC_PROVIDER_TIMEOUT_SECONDS": "3",  # a job's lease: 1 + 3 + 10 s
        "TESSERA_PROVIDER_CONNECT_TIMEOUT_SECONDS": "1",
        "TESSERA_AGENTIC_WAIT_SECONDS": "2",
        "TESSERA_LOG_LEVEL": "WARNING",
        **settings,
    }
    with session_scope() as session:
        tenant = create_tenant(session, name="kill", owner_email=f"kill-{os.urandom(4).hex()}@example.com")
    log_dir = Path(tempfile.mkdtemp(prefix=log_prefix))
    try:
        with processes(log_dir) as start:
            start("api", [TESSERA, "api"], env)
            start("beat", [TESSERA, "beat"], env)
            worker_a = start(
                "worker-a",
                [TESSERA, "worker", "--concurrency", "2", "-n", "a@%h"],
                {**env, "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{proxy_port}"},
            )
            client = ApiClient(f"http://127.0.0.1:{api_port}", tenant.api_key)
            wait_until(lambda: _answers(client), timeout=60)
            yield start, worker_a, client, tenant, env
    except BaseException:
        print(_log_tail(log_dir), file=sys.stderr)
        raise


def _answers(client: ApiClient) -> bool:
    try:
        return client.get(BASE).status == 200
    except Exception:
        return False
