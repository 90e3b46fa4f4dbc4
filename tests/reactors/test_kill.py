"""A worker SIGKILLed while reactor code runs: the invocation stays pending while the job's lease
holds, then ends ``failed`` (500) and its code never runs a second time (it may have charged a card).

The stack runs as real processes on a Redis key prefix of its own (the in-process test worker of the
other tests never takes these tasks): ``tessera api``, ``tessera beat`` (its stale-lease sweep and
outbox relay recover the killed job) and two ``tessera worker`` processes. The reactor's code tells
a counter on loopback each time it starts, then waits. Worker A is killed with its whole process
group (its Node.js processes with it) while the code waits; the test then ends the job's lease
(its 120 s run out, without waiting them) and worker B takes the job back from the relay.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from sqlmodel import select

from storage.db import session_scope
from storage.models import Event, Job
from storage.models_reactors import ReactorRun
from storage.types import utcnow
from tests.conftest import free_port
from tests.factories.kill_stack import TESSERA, _log_tail, broker_env, isolated_prefix, processes  # noqa: F401
from tests.helpers import ApiClient, wait_until

pytestmark = pytest.mark.kill


class Counter:
    """Counts the GET requests it receives (the starts of the reactor's code)."""

    def __init__(self) -> None:
        self.hits = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                counter.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _node_children(worker: psutil.Process) -> list[psutil.Process]:
    return [p for p in worker.children(recursive=True) if "node" in p.name()]


def test_a_worker_killed_mid_run_leaves_the_run_failed_and_never_runs_the_code_twice(
    database,
    isolated_prefix,  # noqa: F811 - the fixture imported above
):
    from domain.tenancy.tenants import create_tenant

    counter = Counter()
    api_port = free_port()
    common = {
        "TESSERA_REDIS_KEY_PREFIX": isolated_prefix,
        **broker_env(isolated_prefix),
        "TESSERA_API_PORT": str(api_port),
        "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "1",
        "TESSERA_LOG_LEVEL": "WARNING",
        # customer code reaches a local destination only when it is named (the sandbox's egress allowlist)
        "TESSERA_REACTOR_EGRESS_ALLOW": f"127.0.0.1:{counter.port}",
    }
    advisories = Path(tempfile.mkdtemp(prefix="tessera-advisories-")) / "advisories.json"
    advisories.write_text("[]")
    common["TESSERA_REACTOR_ADVISORIES"] = str(advisories)
    with session_scope() as session:
        tenant = create_tenant(session, name="kill", owner_email=f"kill-{os.urandom(4).hex()}@example.com")
    log_dir = Path(tempfile.mkdtemp(prefix="tessera-kill-"))
    code = (
        f"module.exports = async () => {{ await fetch('http://127.0.0.1:{counter.port}/started');"
        "await new Promise((r) => setTimeout(r, 25000)); return { raw: 'done' }; };"
    )
    try:
        with processes(log_dir) as start:
            start("api", [TESSERA, "api"], common)
            start("beat", [TESSERA, "beat"], common)
            worker_a = start("worker-a", [TESSERA, "worker", "--concurrency", "1", "-n", "a@%h"], common)
            client = ApiClient(f"http://127.0.0.1:{api_port}", tenant.api_key)
            wait_until(lambda: _answers(client), timeout=60)
            created = client.post(
                "/reactors", {"name": "slow", "code": code, "runtime": {"image": "node22", "timeout": 30}}
            )
            assert created.status == 201, created
            reactor_id = created.json["id"]
            wait_until(lambda: client.get(f"/reactors/{reactor_id}").json["state"] == "active", timeout=120)

            started = client.post(f"/reactors/{reactor_id}/react-async", {"args": {}})
            assert started.status == 202, started
            request_id = started.json["async_reactor_request_id"]
            wait_until(lambda: counter.hits == 1, timeout=60)
            nodes = _node_children(psutil.Process(worker_a.pid))
            assert nodes
            os.killpg(worker_a.pid, signal.SIGKILL)
            worker_a.wait(10)
            psutil.wait_procs(nodes, timeout=10)
            assert not [p for p in nodes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

            assert client.get(f"/reactors/{reactor_id}/results/{request_id}").status == 404
            with session_scope() as session:
                run = session.get(ReactorRun, uuid.UUID(request_id))
                assert run.status == "pending"
                job = session.get(Job, run.job_id)
                assert (job.status, job.attempts) == ("running", 1)
                job.lease_expires_at = utcnow() - dt.timedelta(seconds=1)  # its lease ran out

            start("worker-b", [TESSERA, "worker", "--concurrency", "1", "-n", "b@%h"], common)
            result = wait_until(
                lambda: (r := client.get(f"/reactors/{reactor_id}/results/{request_id}")).status != 404 and r,
                timeout=120,
            )

            assert result.status == 500, result
            assert "interrupted" in result.json["detail"]
            assert counter.hits == 1
            with session_scope() as session:
                run = session.get(ReactorRun, uuid.UUID(request_id))
                job = session.get(Job, run.job_id)
                assert (run.status, job.status, job.attempts) == ("failed", "succeeded", 2)
                types = [
                    e.type
                    for e in session.exec(select(Event).where(Event.tenant_id == tenant.tenant_id))
                    if e.data.get("request_id") == request_id
                ]
            assert types == ["reactor.invocation.failed"]
            again = client.post(f"/reactors/{reactor_id}/react-async", {"args": {}})
            wait_until(lambda: counter.hits == 2, timeout=60)  # worker B runs new invocations
            assert again.status == 202
    except BaseException:
        print(_log_tail(log_dir), file=sys.stderr)
        raise
    finally:
        counter.server.shutdown()


def _answers(client: ApiClient) -> bool:
    try:
        return client.get("/reactors").status == 200
    except Exception:
        return False
