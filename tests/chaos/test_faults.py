"""Faults around the workers, each on a platform of its own (real processes, ``tests/chaos/platform.py``):

* Redis restarted (a Redis server of its own on another port, without persistence, so every queued
  message is lost) with webhook deliveries and network-token provisioning queued: the outbox relay
  sends the recorded work again, nothing is lost, nothing is done twice, the api answers within seconds;
* PostgreSQL restarted under load: a PostgreSQL cluster of its own on another port and data directory
  (the shared one is never touched); skipped, with the reason, where none can be started;
* a sandbox that answers slowly (past the client timeout), drops the connection after doing the work,
  or answers 503: each job ends final with one provider side effect.

``TESSERA_CHAOS_ROUNDS`` (default 1) repeats the Redis restart; ``TESSERA_CHAOS_QUEUED`` (default 30)
is the number of deliveries queued across it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.chaos.platform import Fault, Platform, platform
from tests.chaos.test_worker_kill import _provision, _provisioned, _provisioned_once
from tests.conftest import free_port
from tests.helpers import ApiClient, wait_until

ROUNDS = int(os.environ.get("TESSERA_CHAOS_ROUNDS", "1"))
QUEUED = int(os.environ.get("TESSERA_CHAOS_QUEUED", "30"))


class RedisServer:
    """``redis-server`` on a port of its own, without persistence (a restart loses every message)."""

    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tessera-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        wait_until(lambda: _pings(redis.Redis.from_url(self.url)), timeout=20, interval=0.1)

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def queued(self) -> int:
        import redis

        client = redis.Redis.from_url(self.url)
        return sum(client.llen(key) for key in client.scan_iter(count=1000) if client.type(key) == b"list")


def _pings(client) -> bool:
    try:
        return client.ping()
    except Exception:
        return False


@pytest.fixture(scope="module")
def own_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server to run a Redis of our own (the shared one is never restarted)")
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def _subscribe(p: Platform) -> None:
    hook = p.client.post(
        "/webhooks", {"name": "faults", "url": p.receiver.url, "events": ["token.created", "network-token.created"]}
    )
    assert hook.status == 201, hook


def _tokens(p: Platform, count: int) -> list[str]:
    from tests.chaos.test_worker_kill import _card
    from tests.factories.agentic import fresh_visa

    return [_card(p.client, fresh_visa()) for _ in range(count)]


def _delivered_each_once(p: Platform, token_ids: list[str]) -> bool:
    got = {}
    for received in list(p.receiver.received):
        event = received.json["event"]
        got.setdefault(event.get("data", {}).get("token", {}).get("id"), set()).add(received.headers["webhook-id"])
    return all(len(got.get(token_id, ())) == 1 for token_id in token_ids)


def test_a_redis_restart_with_work_queued_loses_nothing(own_redis, redis_flushed, s3_server):
    env = {"TESSERA_BROKER_URL": own_redis.url, "TESSERA_REDIS_URL": own_redis.url}
    with platform("chaos-redis", env) as p:
        _subscribe(p)
        for _ in range(ROUNDS):
            # no worker: the work is recorded in the database and queued in Redis only
            token_ids = _tokens(p, QUEUED)
            network = [_provision(p) for _ in range(3)]
            wait_until(lambda: own_redis.queued() >= QUEUED // 10, timeout=30)
            queued = own_redis.queued()
            own_redis.kill()  # every queued message is lost with it
            own_redis.start()
            took = p.healthy_within(10)
            worker = p.start_worker()
            wait_until(lambda ids=token_ids: _delivered_each_once(p, ids), timeout=120, interval=0.5)
            for subject in network:
                wait_until(lambda s=subject: _provisioned(p, s), timeout=120, interval=0.5)
                _provisioned_once(p, subject)
            p.processes.kill(worker)
            print(
                f"redis restart: {queued} messages lost with it, {len(token_ids)} deliveries and "
                f"{len(network)} provisionings done once each; api back in {took:.1f} s"
            )
        assert not p.unfinished_work()


class PostgresCluster:
    """A PostgreSQL cluster of its own (``initdb`` in a temporary directory, a port of its own, owned by
    the ``postgres`` system user when run as root, as PostgreSQL requires)."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tessera-pg-"))
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=120)

    def _ctl(self, *args: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.dir / "data"),
            "-l",
            str(self.dir / "log"),
            "-o",
            options,
            "-w",
            *args,
        )

    def start(self) -> None:
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres")
        self._ctl("start")

    def restart(self) -> None:
        """Crash and start again: ``pg_ctl restart -m immediate`` (no clean shut-down, recovery on start)."""
        self._ctl("-m", "immediate", "restart")

    def pause(self) -> None:
        """Stop the server (fast shut-down), keeping its data for :meth:`resume`."""
        self._ctl("-m", "fast", "stop")

    def resume(self) -> None:
        """Start the server :meth:`pause` stopped."""
        self._ctl("start")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError):
            self._ctl("-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def own_postgres():
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        pytest.skip("no PostgreSQL binaries to run a cluster of our own (the shared one is never restarted)")
    cluster = PostgresCluster(found[-1].parent)
    try:
        cluster.start()
    except (subprocess.SubprocessError, OSError) as exc:
        cluster.stop()
        pytest.skip(f"a PostgreSQL cluster of our own could not start here: {exc}")
    yield cluster
    cluster.stop()


class Load:
    """Tokens created in a loop from a thread until stopped: every answer's status, the ids of 201s."""

    def __init__(self, client: ApiClient):
        self.client = client
        self.statuses: list[int] = []
        self.created: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tests.factories.agentic import fresh_visa

        while not self.stop.is_set():
            try:
                answer = self.client.post(
                    "/tokens",
                    {
                        "type": "card",
                        "data": {
                            "number": fresh_visa(),
                            "expiration_month": 5,
                            "expiration_year": time.gmtime().tm_year + 2,
                        },
                    },
                )
            except Exception:
                self.statuses.append(0)
                time.sleep(0.05)
                continue
            self.statuses.append(answer.status)
            if answer.status == 201:
                self.created.append(answer.json["id"])


def test_a_postgresql_restart_under_load_loses_nothing(own_postgres, redis_flushed, s3_server):
    with platform("chaos-pg", database_server=own_postgres.url) as p:
        _subscribe(p)
        worker = p.start_worker()
        load = Load(p.client)
        load.thread.start()
        network = [_provision(p) for _ in range(2)]
        wait_until(lambda: len(load.created) >= 20, timeout=60)
        own_postgres.restart()  # under load: requests and jobs in flight meet a dead connection
        restarted = time.monotonic()
        took = p.healthy_within(20)
        after = len(load.statuses)
        wait_until(lambda: len(load.statuses) >= after + 20 and load.statuses[-1] == 201, timeout=60)
        network += [_provision(p) for _ in range(2)]
        load.stop.set()
        load.thread.join(30)
        for token_id in load.created:  # every write the api acknowledged survived the crash
            assert p.client.get(f"/tokens/{token_id}").status == 200, token_id
        wait_until(lambda: _delivered_each_once(p, load.created), timeout=120, interval=0.5)
        for subject in network:
            wait_until(lambda s=subject: _provisioned(p, s), timeout=120, interval=0.5)
            _provisioned_once(p, subject)
        refused = [s for s in load.statuses if s != 201]
        assert all(s in (0, 503) for s in refused), refused  # 503 while it is down (or no answer), never a 500
        assert not p.unfinished_work()
        p.processes.kill(worker)
        print(
            f"postgresql restart: {len(load.created)} tokens acknowledged and kept, {len(refused)} refused "
            f"while it was down; api back in {took:.1f} s; {len(network)} provisionings done once; "
            f"load normal {time.monotonic() - restarted:.1f} s after the crash"
        )


def test_a_worker_started_while_postgresql_is_down_waits_for_it_then_serves(own_postgres, redis_flushed, s3_server):
    """A worker starting while PostgreSQL does not answer (its thread-pool children too: they make the
    same check) waits for it, saying so in one line, instead of refusing to start and leaving its
    queues without a consumer; once the database is back, a provisioning runs."""
    with platform("chaos-wait", database_server=own_postgres.url) as p:
        own_postgres.pause()
        try:
            worker = p.start_worker()
            log = p.processes.log_dir / f"{worker}.log"
            wait_until(lambda: "waiting for the database" in log.read_text(errors="replace"), timeout=30)
            time.sleep(2)
            assert p.processes.children[worker].poll() is None, log.read_text(errors="replace")  # not refused
        finally:
            own_postgres.resume()
        p.healthy_within(30)
        subject = _provision(p)
        wait_until(lambda: _provisioned(p, subject), timeout=120, interval=0.5)
        _provisioned_once(p, subject)
        assert "refusing to start" not in log.read_text(errors="replace")


@pytest.mark.parametrize(
    "fault",
    [
        Fault("slow", lambda m, path: m == "POST" and path == "/card-network/network-tokens", seconds=5.0),
        Fault("drop", lambda m, path: m == "POST" and path == "/card-network/network-tokens"),
        Fault("5xx", lambda m, path: m == "POST" and path == "/card-network/network-tokens", count=2),
    ],
    ids=["slow", "drop", "5xx"],
)
def test_a_faulty_provider_ends_each_job_final_with_one_side_effect(faulty, fault):
    p = faulty
    fault.hit.clear()
    p.proxy.arm(fault)
    subject = _provision(p)
    assert fault.hit.wait(30)
    wait_until(lambda: _provisioned(p, subject), timeout=90, interval=0.5)
    _provisioned_once(p, subject)
    assert fault.hits == fault.count
    assert p.healthy_within(5) < 5
    requests = ApiClient(p.sandbox).get(f"/_admin/requests?endpoint=card-network.provision&pan={subject['number']}")
    print(f"provider {fault.kind}: final after {requests.json['total']} provider calls, one network token")


@pytest.fixture(scope="module")
def faulty(redis_flushed, s3_server):
    """A platform whose provider calls time out after 2 s (so a slow answer is a timeout)."""
    settings = {"TESSERA_PROVIDER_READ_TIMEOUT_SECONDS": "2", "TESSERA_JOB_LEASE_SECONDS": "8"}
    with platform("chaos-faults", settings) as p:
        p.current = p.start_worker()
        yield p
        assert not p.unfinished_work()
