"""A Redis Sentinel group of its own on loopback: a master behind a password, one replica and one
sentinel (``redis-server --sentinel`` with the config file written here), each ``redis-server`` on a
free port, without persistence, all stopped at the end. No tests here.

Run as a module it starts a group, runs the command given with the test suite's settings pointing at
it, stops the group and exits with the command's status (``scripts/brokers.sh``)::

    python -m tests.factories.sentinel .venv/bin/pytest -q tests/infra

The command sees ``TESSERA_TEST_REDIS_URL`` (a ``sentinel://`` URL carrying the master's password),
``TESSERA_TEST_REDIS_SENTINEL_MASTER`` and ``TESSERA_TEST_REDIS_SENTINEL_PASSWORD``; the broker of the
run is the same unless ``TESSERA_TEST_BROKER_URL`` names another (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

MASTER_NAME = "tessera"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if predicate():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} within {timeout} s")


class SentinelGroup:
    """Master, replica and sentinel, started by :meth:`start`, stopped by :meth:`stop`.

    ``down_after_ms``: how long the master may not answer before the sentinel holds it down and
    promotes the replica; ``failover_timeout_ms``: the sentinel's failover timeout.
    """

    def __init__(self, *, down_after_ms: int = 5000, failover_timeout_ms: int = 10000):
        self.folder = Path(tempfile.mkdtemp(prefix="tessera-sentinel-"))
        self.password = secrets.token_urlsafe(18)
        self.sentinel_password = secrets.token_urlsafe(18)
        self.master_port, self.replica_port, self.sentinel_port = _free_port(), _free_port(), _free_port()
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.processes: dict[str, subprocess.Popen] = {}

    def url(self, db: int = 0) -> str:
        """The platform's URL of the group: its sentinel, with the master's password and database ``db``."""
        return f"sentinel://:{self.password}@127.0.0.1:{self.sentinel_port}/{db}"

    def settings(self, db: int = 0) -> dict[str, str]:
        """The platform's settings (broker and Redis) for the group."""
        return {
            "TESSERA_BROKER_URL": self.url(db),
            "TESSERA_REDIS_URL": self.url(db),
            "TESSERA_REDIS_SENTINEL_MASTER": MASTER_NAME,
            "TESSERA_REDIS_SENTINEL_PASSWORD": self.sentinel_password,
        }

    def _server(self, name: str, port: int, *args: str) -> None:
        self.processes[name] = subprocess.Popen(
            [
                "redis-server",
                *args,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.folder),
                "--logfile",
                str(self.folder / f"{name}.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def node(self, port: int) -> redis.Redis:
        """A client of the Redis server (master or replica) on ``port``."""
        return redis.Redis(port=port, password=self.password, socket_timeout=2, socket_connect_timeout=2)

    def sentinel(self) -> redis.Redis:
        """A client of the sentinel."""
        return redis.Redis(
            port=self.sentinel_port, password=self.sentinel_password, socket_timeout=2, socket_connect_timeout=2
        )

    def master_address(self) -> tuple[str, int]:
        """Where the sentinel says the master is now."""
        host, port = self.sentinel().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return host.decode(), int(port)

    def start(self) -> SentinelGroup:
        """Start the three servers; returns once the replica is in sync and the sentinel knows it."""
        auth = ("--requirepass", self.password, "--masterauth", self.password)
        self._server("master", self.master_port, *auth)
        _until(lambda: self.node(self.master_port).ping(), 20, "the master did not answer")
        self._server("replica", self.replica_port, *auth, "--replicaof", "127.0.0.1", str(self.master_port))
        _until(
            lambda: self.node(self.replica_port).info("replication").get("master_link_status") == "up",
            20,
            "the replica did not sync",
        )
        config = self.folder / "sentinel.conf"  # the sentinel rewrites it: a file of its own
        config.write_text(
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel auth-pass {MASTER_NAME} {self.password}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}\n"
            f"requirepass {self.sentinel_password}\n"
        )
        self._server("sentinel", self.sentinel_port, str(config), "--sentinel")
        _until(
            lambda: self.sentinel().execute_command("SENTINEL", "REPLICAS", MASTER_NAME),
            30,
            "the sentinel did not find the replica",
        )
        return self

    def kill(self, name: str) -> None:
        """SIGKILL the server ``name`` (``master``, ``replica``, ``sentinel``)."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        """Stop every server and remove the folder."""
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def logs(self) -> str:
        """The tails of the servers' logs."""
        return "\n".join(
            f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
            for path in sorted(self.folder.glob("*.log"))
        )


@contextlib.contextmanager
def sentinel_group(**timings: int) -> Iterator[SentinelGroup]:
    """A started :class:`SentinelGroup` (``timings``: its ``down_after_ms``, ``failover_timeout_ms``),
    stopped when the block ends."""
    group = SentinelGroup(**timings)
    try:
        yield group.start()
    except BaseException:
        print(group.logs(), file=sys.stderr)
        raise
    finally:
        group.stop()


def main(argv: list[str]) -> int:
    """Run ``argv`` with the test suite pointed at a group of its own; its exit status."""
    if not argv:
        print("usage: python -m tests.factories.sentinel COMMAND [ARGS...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the group is stopped on the way out
    with sentinel_group() as group:
        env = {
            **os.environ,
            "TESSERA_TEST_REDIS_URL": group.url(),
            "TESSERA_TEST_REDIS_SENTINEL_MASTER": MASTER_NAME,
            "TESSERA_TEST_REDIS_SENTINEL_PASSWORD": group.sentinel_password,
        }
        print(f"sentinel on 127.0.0.1:{group.sentinel_port}, master {MASTER_NAME} on {group.master_port}", flush=True)
        return subprocess.run(argv, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
