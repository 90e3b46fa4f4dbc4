"""Hosts for the cluster tests: each a Linux network namespace of its own (``ip netns``, a veth pair on a
bridge of the run's own) with a data dir of its own, sharing nothing with the others but what it reaches
over the network. Where namespaces cannot be made (not root, no ``ip``), each host is a set of process
groups on loopback with a data dir of its own (also with ``TESSERA_TEST_HOSTS=loopback``): the state a host
keeps on disk stays apart either way; two api hosts then share one port (``SO_REUSEPORT``).

The services the tests already run on loopback (PostgreSQL, Redis, RabbitMQ, moto's S3, the sandbox,
webhook receivers, the SMTP sink) are reached from the namespaces through :class:`Forwarder`, a TCP relay
listening on the bridge's address that records which host connected to which port. No tests here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

TESSERA = str(Path(sys.executable).with_name("tessera"))
LOOPBACK = "127.0.0.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_available() -> str | None:
    """``None`` when this process can make network namespaces and veth pairs; else why not."""
    if os.environ.get("TESSERA_TEST_HOSTS") == "loopback":
        return "TESSERA_TEST_HOSTS=loopback"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    probe = f"tsprobe{os.getpid() % 10000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as error:
        return f"ip netns add failed: {error}"
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return None


class Forwarder:
    """TCP relays in one thread: :meth:`forward` listens on ``(address, port)`` and pipes each connection to
    ``127.0.0.1:port``. ``peers[port]`` holds the source addresses that connected (which host called what),
    ``open[(port, address)]`` how many of their connections are open now."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.peers: dict[int, set[str]] = defaultdict(set)
        self.open: Counter[tuple[int, str]] = Counter()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def forward(self, address: str, port: int) -> None:
        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")[0]
            self.peers[port].add(peer)
            try:
                target_reader, target_writer = await asyncio.open_connection(LOOPBACK, port)
            except OSError:
                writer.close()
                return
            self.open[(port, peer)] += 1
            try:
                await asyncio.gather(pipe(reader, target_writer), pipe(target_reader, writer))
            finally:
                self.open[(port, peer)] -= 1

        async def listen() -> None:
            self._servers.append(await asyncio.start_server(accepted, address, port, reuse_address=True))

        asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class Host:
    """One host: ``address`` is where others reach it, ``data_dir`` its own ``TESSERA_DATA_DIR``."""

    name: str
    address: str
    data_dir: Path
    netns: str | None
    children: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``tessera <args>`` on this host (its own process group, output in ``<data dir>/<name>.log``)."""
        argv = [TESSERA, *args]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        host_env = {
            **env,
            "TESSERA_DATA_DIR": str(self.data_dir),
            "TESSERA_METRICS_DIR": str(self.data_dir / "metrics"),
        }
        with open(self.data_dir / f"{name}.log", "ab") as log:
            child = subprocess.Popen(
                argv,
                env=host_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=Path(__file__).parents[2],
            )
        self.children[name] = child
        return child

    def pids(self) -> set[int]:
        """Every process of this host: the namespace's, or the process groups it started."""
        found: set[int] = set()
        if self.netns:
            listed = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
            found |= {int(pid) for pid in listed.stdout.split()}
        for child in self.children.values():
            found |= {int(p) for p in _group_members(child.pid)}  # each child leads its own group
        return {pid for pid in found if _alive(pid)}

    def kill(self) -> None:
        """The host vanishes: SIGKILL to every one of its processes, until none is left (a child forked
        meanwhile is killed in the next round)."""
        deadline = time.monotonic() + 20
        while (alive := self.pids()) and time.monotonic() < deadline:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(10)

    def stop(self) -> None:
        """SIGTERM to each process group, SIGKILL to what remains after 15 s."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, deadline - time.monotonic()))
        self.kill()

    def logs(self) -> str:
        return "\n".join(
            f"--- {self.name}/{path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:])
            for path in sorted(self.data_dir.glob("*.log"))
        )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _group_members(group: int) -> list[str]:
    listed = subprocess.run(["ps", "-o", "pid=", "-g", str(group)], capture_output=True, text=True, timeout=30)
    return listed.stdout.split()


class Network:
    """The run's hosts and how they reach the services on this machine's loopback."""

    def __init__(self, count: int) -> None:
        self.why_not_namespaces = namespaces_available()
        self.tag = os.urandom(2).hex()
        self.root = Path(tempfile.mkdtemp(prefix=f"tessera-hosts-{self.tag}-"))
        self.forwarder: Forwarder | None = None
        self.hosts: list[Host] = []
        self._forwarded: set[int] = set()
        if self.why_not_namespaces is None:
            subnet = 200 + int(self.tag, 16) % 50, int(self.tag[:2], 16)
            self.gateway = f"10.{subnet[0]}.{subnet[1]}.1"
            self.bridge = f"tsbr{self.tag}"
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            self.forwarder = Forwarder()
            for number in range(1, count + 1):
                self.hosts.append(self._namespace_host(number, f"10.{subnet[0]}.{subnet[1]}.{10 + number}"))
        else:
            self.gateway = LOOPBACK
            for number in range(1, count + 1):
                self.hosts.append(self._loopback_host(number))

    @property
    def namespaces(self) -> bool:
        return self.why_not_namespaces is None

    def _data_dir(self, number: int) -> Path:
        folder = self.root / f"host-{number}"
        folder.mkdir()
        return folder

    def _namespace_host(self, number: int, address: str) -> Host:
        netns, outside, inside = f"ts{self.tag}h{number}", f"ts{self.tag}o{number}", f"ts{self.tag}i{number}"
        _ip("netns", "add", netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", netns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inside)
        _ip("-n", netns, "link", "set", inside, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return Host(f"host-{number}", address, self._data_dir(number), netns)

    def _loopback_host(self, number: int) -> Host:
        return Host(f"host-{number}", LOOPBACK, self._data_dir(number), None)

    def reach(self, url: str) -> str:
        """``url`` (a service on this machine's loopback) as the hosts reach it: through a relay on the
        bridge's address, same port. Unchanged on loopback hosts."""
        parts = urlsplit(url)
        if not self.namespaces or parts.hostname not in (LOOPBACK, "localhost"):
            return url
        port = parts.port or {"redis": 6379, "amqp": 5672, "postgresql+psycopg2": 5432}[parts.scheme]
        self.relay(port)
        netloc = parts.netloc.rsplit("@", 1)
        host_port = f"{self.gateway}:{port}"
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host_port}" if len(netloc) == 2 else host_port))

    def relay(self, port: int) -> None:
        """Relay the bridge's ``port`` to loopback (once per port)."""
        if self.forwarder is not None and port not in self._forwarded:
            self.forwarder.forward(self.gateway, port)
            self._forwarded.add(port)

    def callers(self, port: int) -> set[str]:
        """The host addresses that connected to the loopback service on ``port`` (namespaces only)."""
        return set(self.forwarder.peers[port]) if self.forwarder else set()

    def in_flight(self, port: int, host: Host) -> int:
        """Connections ``host`` holds open to the loopback service on ``port`` (namespaces only)."""
        return self.forwarder.open[(port, host.address)] if self.forwarder else 0

    def logs(self) -> str:
        return "\n".join(host.logs() for host in self.hosts)

    def close(self) -> None:
        for host in self.hosts:
            host.stop()
        if self.forwarder is not None:
            self.forwarder.stop()
        if self.namespaces:
            for host in self.hosts:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", host.netns or "")
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", self.bridge)


@contextlib.contextmanager
def network(count: int) -> Iterator[Network]:
    """``count`` hosts; their processes stopped and their namespaces removed when the block ends."""
    made = Network(count)
    try:
        yield made
    finally:
        made.close()
