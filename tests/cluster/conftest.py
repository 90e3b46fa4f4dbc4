"""The cluster of the cluster tests: three hosts (``tests/factories/hosts.py``) sharing only PostgreSQL, the
broker, Redis and S3, and reaching a sandbox, a webhook receiver and an SMTP server of the test's own over
the network.

- host 1: ``tessera api`` and ``tessera beat``;
- host 2: ``tessera api`` and ``tessera worker``;
- host 3: ``tessera worker``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import requests
from sqlalchemy import create_engine, text

from tests.chaos.platform import CHAOS_ENV
from tests.conftest import _drop_database, free_port
from tests.conftest import serve_in_thread as serve
from tests.factories.hosts import TESSERA, Host, Network, network
from tests.helpers import ApiClient, WebhookReceiver, wait_until
from tests.network_tokens.test_network_token_kill import own_platform
from tests.tenancy.conftest import SmtpSink

YEAR = time.gmtime().tm_year + 3
VISA = "4242424242424242"
#: The settings naming a service on this machine's loopback, which the hosts reach over the bridge.
SERVICE_URLS = (
    "TESSERA_DATABASE_URL",
    "TESSERA_REDIS_URL",
    "TESSERA_BROKER_URL",
    "TESSERA_S3_ENDPOINT_URL",
    "TESSERA_SANDBOX_URL",
    "TESSERA_SMTP_URL",
)


def card(number: str = VISA) -> dict:
    """A ``POST /tokenize`` body of a card token."""
    return {"type": "card", "data": {"number": number, "expiration_month": 12, "expiration_year": YEAR}}


@dataclass
class Cluster:
    """The running hosts, the services they share and the test's tenant key."""

    net: Network
    env: dict[str, str]
    api_port: int
    database_url: str
    sandbox: str
    receiver: WebhookReceiver
    smtp: SmtpSink
    key: str | None = None
    turn: int = field(default=0)

    @property
    def api_hosts(self) -> list[Host]:
        return self.net.hosts[:2]

    def api_url(self, host: Host) -> str:
        return f"http://{host.address}:{self.api_port}"

    def client(self) -> ApiClient:
        """An api client of the next api host (the two in turn)."""
        host = self.api_hosts[self.turn % 2]
        self.turn += 1
        return ApiClient(self.api_url(host), self.key)

    @staticmethod
    def command(host: Host, role: str) -> list[str]:
        """The ``tessera`` arguments of ``role`` (``api``, ``beat`` or ``worker``) on ``host``."""
        return {
            "api": ["api", "--host", host.address],
            "beat": ["beat"],
            "worker": ["worker", "--concurrency", "2", "-n", f"{host.name}@%h"],
        }[role]

    def start(self, host: Host, role: str) -> None:
        """``role`` on ``host``, as the cluster runs it."""
        host.start(role, self.command(host, role), self.env)

    def restart(self, host: Host, role: str) -> float:
        """``role`` on ``host`` stopped with SIGTERM and started again (:meth:`Host.restart`); the
        seconds it took to stop."""
        return host.restart(role, self.command(host, role), self.env)

    def serving(self, host: Host) -> bool:
        """Whether ``host``'s api answers ``GET /status`` with 200."""
        try:
            return ApiClient(self.api_url(host)).get("/status").status == 200
        except Exception:
            return False

    def cli(self, host: Host, *args: str) -> str:
        """``tessera <args>`` on ``host``; its standard output."""
        argv = [TESSERA, *args]
        if host.netns:
            argv = ["ip", "netns", "exec", host.netns, *argv]
        env = {**self.env, "TESSERA_DATA_DIR": str(host.data_dir)}
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=120).stdout

    def settle(self, timeout: float) -> None:
        """Wait until no job is queued or running (AssertionError naming the most attempted ones if some
        still are after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while (left := self.unfinished()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"{len(left)} jobs unfinished after {timeout} s, e.g. {left[:5]}"

    def held(self, what: str) -> int:
        """How many ``what`` (``network-tokens``, ``enrollments``) the sandbox providers hold."""
        return requests.get(f"{self.sandbox}/_admin/{what}", timeout=10).json()["count"]

    def sql(self, query: str) -> list[dict]:
        """The rows of ``query`` on the cluster's database."""
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [dict(row) for row in conn.execute(text(query)).mappings()]
        finally:
            engine.dispose()

    def unfinished(self) -> list[dict]:
        """Jobs (a webhook delivery's work is a job too) still queued or running, most attempted first."""
        return self.sql(
            "SELECT kind, status, attempts, last_error FROM jobs WHERE status IN ('queued', 'running') "
            "ORDER BY attempts DESC"
        )


@pytest.fixture
def cluster(redis_flushed, s3_server) -> Iterator[Cluster]:
    """The three hosts running, a tenant of the test's own (``Cluster.key``); all stopped and the
    database dropped afterwards; the hosts' log tails printed when the test fails."""
    from sandbox.app import make_app

    sandbox_port, api_port = free_port(), free_port()
    stop_sandbox = serve(lambda: make_app(), sandbox_port)
    receiver = WebhookReceiver().start()
    smtp = SmtpSink(free_port()).start()
    with network(3) as net:
        database_url, _work_dir, env = own_platform(
            f"hosts{net.tag}",
            f"http://127.0.0.1:{sandbox_port}",
            api_port,
            {**CHAOS_ENV, "TESSERA_SMTP_URL": f"smtp://127.0.0.1:{smtp.port}"},
        )
        for name in SERVICE_URLS:
            env[name] = net.reach(env[name])
        env["TESSERA_PUBLIC_BASE_URL"] = f"http://{net.hosts[0].address}:{api_port}"
        running = Cluster(net, env, api_port, database_url, f"http://127.0.0.1:{sandbox_port}", receiver, smtp)
        one, two, three = net.hosts
        try:
            for host, role in ((one, "api"), (two, "api"), (one, "beat"), (two, "worker"), (three, "worker")):
                running.start(host, role)
            for host in (one, two):
                wait_until(lambda h=host: running.serving(h), timeout=90, interval=0.5)
            tenant = json.loads(
                running.cli(one, "tenants", "create", "--name", "hosts", "--owner-email", "owner@example.com", "--json")
            )
            running.key = tenant["api_key"]
            yield running
        except BaseException:
            print(net.logs())
            raise
        finally:
            for host in net.hosts:
                host.stop()
            _drop_database(database_url)
    smtp.stop()
    receiver.stop()
    stop_sandbox()
