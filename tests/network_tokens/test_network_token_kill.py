"""A worker killed (SIGKILL) while it waits on the card network: the job is retried by another worker
and the network issues exactly one network token (the job id is the idempotency key). And a worker that
dies after the network answered, before its commit: the retry gets the same network token.

Everything runs as real processes, isolated from the rest of the test session: a database of its own,
a Redis key prefix of its own, ``tessera api``, ``tessera beat`` and two ``tessera worker`` processes
(worker A gets the job and is killed; worker B starts afterwards), and a sandbox of its own on loopback
whose slow card answers after :data:`SLOW_SECONDS`. Nothing is simulated: the stale lease is released
and the job re-sent by beat's own sweeps.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import REDIS_PREFIX, TEST_DATABASE_URL, _drop_database, _recreate_database, free_port
from tests.conftest import serve_in_thread as serve
from tests.factories.kill_stack import broker_env
from tests.helpers import ApiClient, wait_until

pytestmark = pytest.mark.kill

SLOW = "4000000000002032"
SLOW_SECONDS = 6.0
LEASE_SECONDS = 10  # longer than the slow answer, as the lease must be
BIN = Path(sys.executable).parent


class Processes:
    """Child processes, each the leader of its own process group, logging to files; all stopped at the end.
    ``cwd``: their working directory (a ``python -m`` child a role starts imports from there first)."""

    def __init__(self, log_dir: Path, env: dict[str, str], cwd: Path | None = None):
        self.log_dir = log_dir
        self.env = env
        self.cwd = cwd
        self.children: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            child = subprocess.Popen(
                [str(BIN / "tessera"), *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.cwd,
            )
        self.children[name] = child
        return child

    def run(self, *args: str) -> str:
        return subprocess.run(
            [str(BIN / "tessera"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd=self.cwd,
        ).stdout

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        child = self.children[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        child.wait(10)

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n" + path.read_text(errors="replace")[-3000:]
            for path in sorted(self.log_dir.glob("*.log"))
        )

    def stop_all(self) -> None:
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        for child in self.children.values():
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait(5)


def own_platform(
    name: str,
    sandbox_url: str,
    api_port: int,
    settings: dict[str, str],
    *,
    database_server: str = TEST_DATABASE_URL,
    revision: str = "head",
) -> tuple[str, Path, dict]:
    """``(database URL, work dir, environment)`` for the processes of a platform of its own: a database
    ``<the run's>_<name>`` (on ``database_server``'s server) migrated to ``revision``, a Redis key prefix
    and a master key of its own, ``settings`` on top."""
    from storage import migrate

    base = make_url(database_server)
    database_url = str(base.set(database=f"{base.database}_{name}"))
    _recreate_database(database_url)
    migrate.upgrade(database_url, revision)
    work_dir = Path(tempfile.mkdtemp(prefix=f"tessera-{name}-"))
    env = {
        **os.environ,
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_REDIS_KEY_PREFIX": f"{REDIS_PREFIX}{name}:",
        **broker_env(f"{REDIS_PREFIX}{name}:"),
        "TESSERA_DATA_DIR": str(work_dir),
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
        "TESSERA_SANDBOX_URL": sandbox_url,
        "TESSERA_API_PORT": str(api_port),
        **settings,
    }
    return database_url, work_dir, env


@pytest.fixture
def isolated(redis_flushed):
    """``(processes, api base URL, sandbox base URL, database URL)`` of a platform of its own."""
    from sandbox.app import make_app

    sandbox_port, api_port = free_port(), free_port()
    stop_sandbox = serve(lambda: make_app(slow_seconds=SLOW_SECONDS), sandbox_port)
    database_url, work_dir, env = own_platform(
        "kill",
        f"http://127.0.0.1:{sandbox_port}",
        api_port,
        {
            "TESSERA_JOB_LEASE_SECONDS": str(LEASE_SECONDS),
            "TESSERA_NETWORK_TOKEN_WAIT_SECONDS": "1",
            "TESSERA_OUTBOX_RELAY_AFTER_SECONDS": "2",
            "TESSERA_LOG_LEVEL": "WARNING",
        },
    )
    processes = Processes(work_dir, env)
    try:
        yield processes, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{sandbox_port}", database_url
    finally:
        processes.stop_all()
        stop_sandbox()
        _drop_database(database_url)


def _job(database_url: str, token_id: str) -> dict:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            row = (
                conn.execute(
                    text(
                        "SELECT status, attempts, lease_owner FROM jobs WHERE kind = 'network_tokens.provision' "
                        "AND subject_id = :id"
                    ),
                    {"id": token_id},
                )
                .mappings()
                .one()
            )
            created = conn.execute(
                text("SELECT count(*) FROM events WHERE type = 'network-token.created'")
            ).scalar_one()
        return {**row, "created_events": created}
    finally:
        engine.dispose()


def _provision_requests(sandbox: str) -> int:
    answer = ApiClient(sandbox).get(f"/_admin/requests?endpoint=card-network.provision&pan={SLOW}")
    return answer.json["total"]


def test_a_killed_worker_does_not_provision_a_second_network_token(isolated, receiver):
    processes, api_url, sandbox, database_url = isolated
    try:
        api = processes.start("api", "api")
        processes.start("beat", "beat")
        worker_a = processes.start("worker-a", "worker", "--concurrency", "1", "--hostname", "a@%h")
        tenant = json.loads(
            processes.run("tenants", "create", "--name", "kill", "--owner-email", "kill@example.com", "--json")
        )
        client = ApiClient(api_url, tenant["api_key"])
        wait_until(lambda: api.poll() is None and _answers(api_url), timeout=30)
        # subscribed, so the outcome writes its event (in the outcome's transaction): exactly one, below
        hook = client.post("/webhooks", {"name": "kill", "url": receiver.url, "events": ["network-token.created"]})
        assert hook.status == 201, hook

        answer = client.post(
            "/network-tokens",
            {"data": {"number": SLOW, "expiration_month": 12, "expiration_year": time.gmtime().tm_year + 2}},
        )
        assert answer.status == 202, answer
        token_id = answer.json["id"]
        # worker A has called the network and waits for its answer: kill it, pool and all
        wait_until(lambda: _provision_requests(sandbox) == 1, timeout=30)
        running = _job(database_url, token_id)
        assert running["status"] == "running" and running["attempts"] == 1
        assert running["lease_owner"].split(":")[1] != str(worker_a.pid)  # a pool process of worker A
        processes.kill("worker-a")
        assert worker_a.poll() is not None

        processes.start("worker-b", "worker", "--concurrency", "1", "--hostname", "b@%h")
        # beat releases the stale lease (after LEASE_SECONDS) and relays the job to worker B
        active = wait_until(
            lambda: (body := client.get(f"/network-tokens/{token_id}").json)["status"] == "active" and body,
            timeout=90,
            interval=0.5,
        )
    except BaseException:
        print(processes.logs())
        raise

    job = _job(database_url, token_id)
    assert job["status"] == "succeeded"
    assert job["attempts"] == 2  # worker A's attempt, then worker B's
    assert _provision_requests(sandbox) == 2  # the network was asked twice with the same key ...
    at_network = ApiClient(sandbox).get(f"/_admin/network-tokens?pan={SLOW}").json
    assert at_network["count"] == 1  # ... and issued one network token
    (issued,) = at_network["network_tokens"]
    assert issued["id"] == active["_extras"]["network_reference"]
    assert issued["number"] == active["data"]["number"]
    assert job["created_events"] == 1


def _answers(base_url: str) -> bool:
    try:
        return ApiClient(base_url).get("/status").status < 500
    except Exception:
        return False


def _unique_visa() -> str:
    """A Luhn-valid visa number no other test uses (the sandbox issues it a token at once)."""
    from domain.tokens.cards import luhn_valid

    body = "4" + "".join(str(secrets.randbelow(10)) for _ in range(14))
    return next(body + digit for digit in "0123456789" if luhn_valid(body + digit))


def test_a_worker_dying_after_the_network_answered_gets_the_same_token_on_retry(api, tenant, sandbox):
    from domain.network_tokens import provisioning as network_tokens
    from domain.tenancy.auth import authenticate
    from infra import jobs as jobs_
    from infra import outbox
    from storage.db import session_scope
    from storage.models import Job
    from storage.models_network_tokens import NetworkToken
    from tasks.network_tokens import Provision

    number = _unique_visa()
    card = {"number": number, "expiration_month": 12, "expiration_year": dt.datetime.now(dt.UTC).year + 2}
    with session_scope() as session:  # as POST /network-tokens records it; a doomed worker takes the lease at once
        caller = authenticate(session, tenant.api_key)
        started = network_tokens.create_network_token(session, caller, {"data": card})
        session.flush()
        # with what the lease statement reads for the provider call
        doomed, read = jobs_.lease(
            started.job_id, "doomed-worker", lease_seconds=2, reads=Provision().lease_reads(), session=session
        )
        session.expunge(doomed)
    # the doomed worker calls the network with the job id as idempotency key; the network answers ...
    first = Provision().perform(doomed, read)
    at_network = ApiClient(sandbox).get(f"/_admin/network-tokens?pan={number}").json
    assert at_network["count"] == 1 and at_network["network_tokens"][0]["id"] == first.reference
    # ... and the worker dies before its commit: the job stays running under a lease that expires
    time.sleep(2.1)
    with session_scope() as session:
        assert session.get(Job, started.job_id).status == "running"
        assert outbox.release_stale_leases(session) >= 1  # beat's sweeps
    with session_scope() as session:
        assert outbox.relay(session, grace_seconds=0) >= 1

    def done() -> Job | None:
        with session_scope() as session:
            job = session.get(Job, started.job_id)
            return job if job.status == "succeeded" else None

    job = wait_until(done, timeout=20)
    assert job.attempts == 2
    with session_scope() as session:
        token = session.get(NetworkToken, started.network_token_id)
        assert token.status == "active" and token.network_reference == first.reference
    at_network = ApiClient(sandbox).get(f"/_admin/network-tokens?pan={number}").json
    assert at_network["count"] == 1  # the retry was answered with the same network token
    requests = ApiClient(sandbox).get(f"/_admin/requests?endpoint=card-network.provision&pan={number}").json
    assert requests["total"] == 2
