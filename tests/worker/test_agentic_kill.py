"""A worker killed mid-enrollment: the rails end enabled, never stuck pending, and each provider saw one
enrollment (its idempotency key made the second call a replay).

The stack runs as real processes on a Redis key prefix of its own, so the in-process test worker of
the other tests never takes these tasks: ``tessera api``, ``tessera beat`` (its stale-lease sweep
and outbox relay recover the killed jobs) and two ``tessera worker`` processes. Worker A reaches the
sandbox through a proxy that forwards each enrollment at once (the provider enrolls the card) but
holds the answer; while both rails' calls are held, worker A is SIGKILLed with its pool. Worker B,
started afterwards, gets the jobs back from the relay once their lease runs out and asks the
provider again with the same idempotency key.
"""

from __future__ import annotations

import asyncio
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
from sqlmodel import select

from storage.db import session_scope
from storage.models import Job
from storage.models_agentic import OperationLease
from tests.api.test_agentic_support import (
    BASE,
    card_token,
    fresh_visa,
    outcome,
    provider_enrollments,
    provider_requests,
    rail_events,
    rail_rows,
)
from tests.conftest import REDIS_PREFIX, free_port, serve_in_thread
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


def test_a_worker_killed_mid_enrollment_leaves_no_rail_pending_and_enrolls_once(database, sandbox, isolated_prefix):
    proxy = HoldingProxy(sandbox)
    proxy_port = free_port()
    stop_proxy = serve_in_thread(proxy.app, proxy_port)
    try:
        with stack(isolated_prefix, proxy_port, log_prefix="tessera-kill-") as (
            start,
            worker_a,
            client,
            tenant,
            common,
        ):
            number = fresh_visa()

            created = client.post(
                BASE,
                {
                    "source": {"type": "svc_card_token", "token_id": card_token(client, number)},
                    "consumer": {"email": "ada@example.com"},
                },
            )

            assert created.status == 201, created
            pm = created.json
            assert outcome(pm) == {"vic": "pending", "psp": "pending"}
            wait_until(lambda: len(proxy.held) == 2, timeout=60)
            assert sorted(provider for provider, _ in proxy.held) == ["psp", "vic"]
            assert proxy.answered == []  # both calls in flight at once: the rails enroll in parallel
            os.killpg(worker_a.pid, signal.SIGKILL)
            worker_a.wait(10)
            assert worker_a.returncode == -signal.SIGKILL

            start("worker-b", [TESSERA, "worker", "--concurrency", "2", "-n", "b@%h"], common)

            def settled():
                now = client.get(f"{BASE}/{pm['id']}").json
                return "pending" not in outcome(now).values() and now

            final = wait_until(settled, timeout=150)

            assert outcome(final) == {"vic": "enabled", "psp": "enabled"}
            for provider in ("vic", "psp"):
                enrollments = provider_enrollments(sandbox, provider, number)
                assert len(enrollments) == 1, enrollments
                assert provider_requests(sandbox, f"agentic.{provider}.enrollments.create", number) == 2
                rail = next(r for r in rail_rows(pm["id"]) if r.provider == provider)
                assert rail.enrollment_id == enrollments[0]["id"]
            jobs = _enroll_jobs(pm["id"])
            assert [(job.status, job.attempts) for job in jobs] == [("succeeded", 2), ("succeeded", 2)]
            assert sorted(e["rail"]["provider"] for e in rail_events(tenant.tenant_id, pm["id"])) == ["psp", "vic"]
            with session_scope() as session:
                assert session.get(OperationLease, pm["id"]) is None
            assert client.delete(f"{BASE}/{pm['id']}").status == 204
    finally:
        proxy.released.set()
        time.sleep(0.2)
        stop_proxy()


def _answers(client: ApiClient) -> bool:
    try:
        return client.get(BASE).status == 200
    except Exception:
        return False


def _enroll_jobs(pm_id: str) -> list[Job]:
    subjects = {str(r.id) for r in rail_rows(pm_id)}
    with session_scope() as session:
        rows = session.exec(select(Job).where(Job.kind == "agentic.enroll_rail")).all()
    return [job for job in rows if job.subject_id in subjects]
