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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either end closes."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Forwarder:
    """TCP relays in one thread: :meth:`forward` listens on ``(address, port)`` and pipes each connection to
    ``127.0.0.1:port``. ``peers[port]`` holds the source addresses that connected (which host called what),
    ``open[(port, address)]`` how many of their connections are open now."""

    def __init__(self, peers_file: Path | None = None) -> None:
        self.peers_file = peers_file  # where a relay process writes each new caller's address
        self.loop = asyncio.new_event_loop()
        self.peers: dict[int, set[str]] = defaultdict(set)
        self.open: Counter[tuple[int, str]] = Counter()
        self._servers: list[asyncio.AbstractServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def forward(self, address: str, port: int) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")[0]
            if peer not in self.peers[port] and self.peers_file is not None:
                with self.peers_file.open("a") as peers:
                    peers.write(f"{peer}\n")
            self.peers[port].add(peer)
            try:
                target_reader, target_writer = await asyncio.open_connection(LOOPBACK, port)
            except OSError:
                writer.close()
                return
            self.open[(port, peer)] += 1
            try:
                await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))
            finally:
                self.open[(port, peer)] -= 1

        async def listen() -> None:
            self._servers.append(await asyncio.start_server(accepted, address, port, reuse_address=True))

        asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)

    def balance(self, backends: list[tuple[str, int]], listen_port: int = 0) -> int:
        """A TCP load balancer on loopback's ``listen_port`` (0: a free one; returned): each connection
        goes to the next of ``backends`` in turn, or, when that one refuses it (its process stopped
        listening), to the one after, as a load balancer's passive health check does."""
        turn = 0

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal turn
            turn += 1
            first = turn  # this connection's own start: ``turn`` moves on while it waits
            for attempt in range(len(backends) * 2):
                address, port = backends[(first + attempt) % len(backends)]
                try:
                    target_reader, target_writer = await asyncio.open_connection(address, port)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            else:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))

        async def listen() -> int:
            server = await asyncio.start_server(accepted, LOOPBACK, listen_port)
            self._servers.append(server)
            return server.sockets[0].getsockname()[1]

        return asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)

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

    def restart(self, name: str, args: list[str], env: dict[str, str], grace: float = 60.0) -> float:
        """SIGTERM to ``name``'s process (as ``docker stop`` and Kubernetes send it: to the main process, whose
        children it stops in turn), then ``tessera <args>`` again once its whole process group is gone;
        the seconds it took to stop. AssertionError when it did not stop within ``grace`` seconds (it is
        then killed)."""
        child = self.children[name]
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        try:
            while _group_members(child.pid) and time.monotonic() - started < grace:
                child.poll()
                time.sleep(0.1)
            child.wait(max(0.1, grace - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - started
        if [pid for pid in _group_members(child.pid) if _alive(int(pid))]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            raise AssertionError(f"{self.name}: {name} did not stop within {grace} s of SIGTERM")
        self.start(name, args, env)
        return took

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
        self._relays: list[subprocess.Popen] = []
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

    def reach(self, url: str, *, watch: bool = False) -> str:
        """``url`` (a service on this machine's loopback) as the hosts reach it: through a relay on the
        bridge's address, same port (unchanged on loopback hosts). The relay runs in a process of its
        own (the services' traffic never waits on this process's interpreter lock); ``watch``: in this
        process instead, so that :meth:`in_flight` sees its open connections."""
        parts = urlsplit(url)
        if not self.namespaces or parts.hostname not in (LOOPBACK, "localhost"):
            return url
        port = parts.port or {"redis": 6379, "amqp": 5672, "postgresql+psycopg2": 5432}[parts.scheme]
        if port not in self._forwarded:
            self._forwarded.add(port)
            if watch and self.forwarder is not None:
                self.forwarder.forward(self.gateway, port)
            else:
                self._relay_process("forward", self.gateway, str(port), str(self._peers_file(port)))
                _wait_for_port(self.gateway, port)
        netloc = parts.netloc.rsplit("@", 1)
        host_port = f"{self.gateway}:{port}"
        return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host_port}" if len(netloc) == 2 else host_port))

    def _peers_file(self, port: int) -> Path:
        return self.root / f"relay-{port}.peers"

    def _relay_process(self, *args: str) -> None:
        self._relays.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.factories.hosts", *args],
                cwd=Path(__file__).parents[2],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def callers(self, port: int) -> set[str]:
        """The host addresses that connected to the loopback service on ``port`` (namespaces only)."""
        found = set(self.forwarder.peers[port]) if self.forwarder else set()
        if self._peers_file(port).exists():
            found |= set(self._peers_file(port).read_text().split())
        return found - {self.gateway}  # this machine's own readiness probes

    def balancer(self, port: int, hosts: list[Host]) -> str:
        """The base URL of a load balancer (a process of its own) in front of ``hosts``' ``port``."""
        from tests.conftest import free_port

        listen = free_port()
        self._relay_process("balance", str(listen), *(f"{host.address}:{port}" for host in hosts))
        _wait_for_port(LOOPBACK, listen)
        return f"http://{LOOPBACK}:{listen}"

    def in_flight(self, port: int, host: Host) -> int:
        """Connections ``host`` holds open to the loopback service on ``port`` (namespaces only)."""
        return self.forwarder.open[(port, host.address)] if self.forwarder else 0

    def logs(self) -> str:
        return "\n".join(host.logs() for host in self.hosts)

    def close(self) -> None:
        for host in self.hosts:
            host.stop()
        for relay in self._relays:
            relay.kill()
            relay.wait(10)
        if self.forwarder is not None:
            self.forwarder.stop()
        if self.namespaces:
            for host in self.hosts:
                with contextlib.suppress(subprocess.CalledProcessError):
                    _ip("netns", "del", host.netns or "")
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", self.bridge)


def _wait_for_port(address: str, port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def network(count: int) -> Iterator[Network]:
    """``count`` hosts; their processes stopped and their namespaces removed when the block ends."""
    made = Network(count)
    try:
        yield made
    finally:
        made.close()


if __name__ == "__main__":  # a relay process: ``forward ADDRESS PORT PEERS_FILE`` or ``balance PORT HOST:PORT...``
    relay = Forwarder(Path(sys.argv[4]) if sys.argv[1] == "forward" else None)
    if sys.argv[1] == "forward":
        relay.forward(sys.argv[2], int(sys.argv[3]))
    else:
        backends = [(spec.rsplit(":", 1)[0], int(spec.rsplit(":", 1)[1])) for spec in sys.argv[3:]]
        relay.balance(backends, int(sys.argv[2]))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
