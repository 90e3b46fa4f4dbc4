"""The sandbox of customer code against hostile code, on real bubblewrap, Node.js 22 and the host's
own PostgreSQL and Redis: no connection to the platform's services (TCP on IPv4 and IPv6, their unix
sockets), egress only through the SSRF-guarded proxy, no signal to any other process, no child
process, no file of the host, never root, bounded resources, one tenant per process, and 503 where
the sandbox cannot be made."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy.engine import make_url

from config.settings import get_settings, reload_settings
from domain.reactors.runtime import Reactor, ReactorRuntime, Runtime
from infra.addresses import DestinationRefused, vetted_addresses
from infra.errors import Problem
from infra.node_runtime import sandbox
from infra.node_runtime.egress import parse_connect
from infra.node_runtime.pool import NodePool
from tessera.worker import sandbox_line
from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL
from tests.helpers import wait_until

from .conftest import reactor

PROBE = """
const net = require('net');
const attempt = (f) => {
  try { const v = f(); return v === undefined ? 'allowed' : v; } catch (e) { return e.code || e.name; }
};
const connect = (options) => new Promise((resolve) => {
  const s = net.connect(options);
  const t = setTimeout(() => { s.destroy(); resolve('TIMEOUT'); }, 3000);
  s.on('connect', () => { clearTimeout(t); s.destroy(); resolve('CONNECTED'); });
  s.on('error', (e) => { clearTimeout(t); resolve(e.code || e.message); });
});
const egress = (target) => new Promise((resolve) => {
  const s = net.connect(process.argv[3]);
  let answer = '';
  s.on('connect', () => s.write(`CONNECT ${target} HTTP/1.1\\r\\nHost: ${target}\\r\\n\\r\\n`));
  s.on('data', (c) => {
    answer += c;
    if (answer.includes('\\r\\n\\r\\n')) { s.destroy(); resolve(answer.split('\\r\\n')[0]); }
  });
  s.on('error', (e) => resolve(e.code));
});
module.exports = async (req) => {
  const out = {};
  for (const [name, options] of Object.entries(req.args.tcp || {})) out[name] = await connect(options);
  for (const [name, target] of Object.entries(req.args.egress || {})) out[name] = await egress(target);
  for (const [name, url] of Object.entries(req.args.fetch || {})) {
    try { out[name] = (await fetch(url)).status; } catch (e) {
      out[name] = String((e.cause && e.cause.message) || e.message);
    }
  }
  for (const [name, pid] of Object.entries(req.args.signal || {})) out[name] = attempt(() => process.kill(pid, 0));
  for (const [name, pid] of Object.entries(req.args.stop || {})) {
    out[name] = attempt(() => process.kill(pid, 'SIGSTOP'));
  }
  return { raw: out };
};
"""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """A runtime whose pool allows no private destination (the default)."""
    rt = ReactorRuntime(tmp_path_factory.mktemp("sandboxed"), pool=NodePool())
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def local_http():
    """An HTTP server on loopback standing for the api (any service of the host)."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def tenant_reactor(tenant: str, code: str, **runtime) -> Reactor:
    return Reactor(reactor(code).id, code, Runtime(image="node22", **runtime), tenant_id=tenant)


def probe(runtime, **args) -> dict:
    return runtime.invoke(tenant_reactor("tenant-a", PROBE), args=args).raw


def _postgres() -> tuple[str, int]:
    url = make_url(TEST_DATABASE_URL)
    return url.host or "127.0.0.1", url.port or 5432


def _redis() -> tuple[str, int]:
    url = make_url(TEST_REDIS_URL)
    return url.host or "127.0.0.1", url.port or 6379


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


# ---- network -------------------------------------------------------------------------------------


def test_the_platforms_services_are_unreachable_though_the_host_reaches_them(runtime, local_http, monkeypatch):
    monkeypatch.setenv("TESSERA_ALLOW_PRIVATE_DESTINATIONS", "true")  # serves deliveries, never customer code
    reload_settings()
    pg_host, pg_port = _postgres()
    redis_host, redis_port = _redis()
    assert _reachable(pg_host, pg_port) and _reachable(redis_host, redis_port) and _reachable("127.0.0.1", local_http)
    refused_before = runtime.pool.egress.refused
    out = probe(
        runtime,
        tcp={
            "postgres": {"host": pg_host, "port": pg_port},
            "postgres_v6": {"host": "::1", "port": pg_port},
            "redis": {"host": redis_host, "port": redis_port},
            "redis_v6": {"host": "::1", "port": redis_port},
            "api": {"host": "127.0.0.1", "port": local_http},
            "postgres_socket": {"path": f"/var/run/postgresql/.s.PGSQL.{pg_port}"},
            "metadata": {"host": "169.254.169.254", "port": 80},
        },
        egress={
            "egress_postgres": f"127.0.0.1:{pg_port}",
            "egress_redis": f"localhost:{redis_port}",
            "egress_redis_v6": f"[::1]:{redis_port}",
            "egress_metadata": "169.254.169.254:80",
            "egress_private": "10.0.0.1:443",
        },
        fetch={
            "fetch_api": f"http://127.0.0.1:{local_http}/",
            "fetch_redis": f"http://localhost:{redis_port}/",
        },
    )
    reload_settings()
    for name in ("postgres", "postgres_v6", "redis", "redis_v6", "api", "postgres_socket", "metadata"):
        assert out[name] != "CONNECTED", (name, out)
        assert out[name] in ("ECONNREFUSED", "ENETUNREACH", "EHOSTUNREACH", "ENOENT", "EADDRNOTAVAIL"), (name, out)
    for name in ("egress_postgres", "egress_redis", "egress_redis_v6", "egress_metadata", "egress_private"):
        assert out[name].startswith("HTTP/1.1 403"), (name, out)
    assert "refused by the sandbox" in out["fetch_api"] and "403" in out["fetch_api"], out
    assert "refused by the sandbox" in out["fetch_redis"], out
    assert runtime.pool.egress.refused - refused_before == 7


def test_the_egress_proxy_vets_the_resolved_address_and_allows_public_ones():
    assert parse_connect(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n") == ("api.example.com", 443)
    assert parse_connect(b"CONNECT [::1]:6379 HTTP/1.1\r\n\r\n") == ("::1", 6379)
    for head in (
        b"GET http://x/ HTTP/1.1\r\n\r\n",
        b"CONNECT x HTTP/1.1\r\n\r\n",
        b"CONNECT a@b:1 HTTP/1.1\r\n\r\n",
        b"CONNECT x:0 HTTP/1.1\r\n\r\n",
        b"CONNECT x:99999 HTTP/1.1\r\n\r\n",
    ):
        with pytest.raises(ValueError):
            parse_connect(head)
    # A public address passes the guard (no connection is made here: this machine reaches no internet).
    assert vetted_addresses("93.184.216.34", 443, allow_private=False, timeout_s=1) == ["93.184.216.34"]
    for private in ("127.0.0.1", "::1", "10.1.2.3", "169.254.169.254", "::ffff:127.0.0.1", "100.64.0.1"):
        with pytest.raises(DestinationRefused):
            vetted_addresses(private, 443, allow_private=False, timeout_s=1)
    with pytest.raises(DestinationRefused):
        vetted_addresses("localhost", 443, allow_private=False, timeout_s=2)


def test_an_allowlisted_pair_is_reachable_and_nothing_else(tmp_path, local_http):
    allowed = ReactorRuntime(tmp_path, pool=NodePool(egress_allow=frozenset({f"127.0.0.1:{local_http}"})))
    try:
        out = allowed.invoke(
            tenant_reactor("tenant-a", PROBE),
            args={
                "fetch": {
                    "allowed": f"http://127.0.0.1:{local_http}/",
                    "other_port": f"http://127.0.0.1:{_redis()[1]}/",
                    "other_name": f"http://localhost:{local_http}/",
                }
            },
        ).raw
    finally:
        allowed.close()
    assert out["allowed"] == 204
    assert "refused by the sandbox" in out["other_port"]
    assert "refused by the sandbox" in out["other_name"]  # pairs are exact: the name is another pair


# ---- processes -----------------------------------------------------------------------------------


def test_no_signal_reaches_the_worker_pid_1_or_another_tenants_process(runtime):
    other = tenant_reactor("tenant-b", "module.exports = async () => ({ raw: 'still here' });")
    assert runtime.invoke(other, args={}).raw == "still here"
    (other_pid,) = runtime.pool.node_pids(other.key)
    out = probe(
        runtime,
        signal={"worker": os.getpid(), "pid1": 1, "group": 0, "other": other_pid},
        stop={"stop_other": other_pid, "stop_worker": os.getpid()},
    )
    assert out == {
        "worker": "EPERM",
        "pid1": "EPERM",
        "group": "EPERM",
        "other": "EPERM",
        "stop_other": "EPERM",
        "stop_worker": "EPERM",
    }
    assert runtime.invoke(other, args={}).raw == "still here"  # not stopped: it answers


def test_no_child_process_no_thread_and_only_its_own_processes_in_view(runtime):
    r = tenant_reactor(
        "tenant-a",
        """
        const fs = require('fs');
        const attempt = (f) => { try { f(); return 'allowed'; } catch (e) { return e.code || e.name; } };
        module.exports = async () => ({ raw: {
          spawn: attempt(() => require('child_process').spawnSync('/sandbox/node', ['-e', '1'])),
          worker: attempt(() => new (require('worker_threads').Worker)('1', { eval: true })),
          pid: process.pid,
        } });
    """,
    )
    raw = runtime.invoke(r, args={}).raw
    assert raw == {"spawn": "ERR_ACCESS_DENIED", "worker": "ERR_ACCESS_DENIED", "pid": 1}
    (node_pid,) = runtime.pool.node_pids(r.key)
    assert psutil.Process(node_pid).num_threads() <= 16


# ---- files, identity and limits ------------------------------------------------------------------


def test_sqlite_and_the_hosts_files_are_out_of_reach_and_tmp_is_private(runtime, tmp_path):
    secret = tmp_path / "tessera.db"
    secret.write_text("every tenant's rows")
    r = tenant_reactor(
        "tenant-a",
        """
        const fs = require('fs');
        const attempt = (f) => {
          try { const v = f(); return v === undefined ? 'allowed' : v; } catch (e) { return e.code || e.name; }
        };
        module.exports = async (req) => ({ raw: {
          sqlite: attempt(() => require('node:sqlite')),
          read_db: attempt(() => fs.readFileSync(req.args.db, 'utf8')),
          write_outside: attempt(() => fs.writeFileSync('/sandbox/code/x', '1')),
          tmp_before: fs.readdirSync('/tmp'),
          write_tmp: attempt(() => fs.writeFileSync('/tmp/mine', 'x')),
          big_tmp: attempt(() => fs.writeFileSync('/tmp/big', Buffer.alloc(32 << 20))),
        } });
    """,
    )
    raw = runtime.invoke(r, args={"db": str(secret)}).raw
    assert raw["sqlite"] == "ERR_UNKNOWN_BUILTIN_MODULE"
    assert raw["read_db"] in ("ENOENT", "ERR_ACCESS_DENIED")  # not in its file system at all
    assert raw["write_outside"] == "ERR_ACCESS_DENIED"
    assert raw["tmp_before"] == []
    assert raw["write_tmp"] == "allowed"
    assert raw["big_tmp"] in ("EFBIG", "ENOSPC", "ERR_FS_FILE_TOO_LARGE"), raw
    # What the process sees of the host's file system (read from outside, through its mount namespace).
    (node_pid,) = runtime.pool.node_pids(r.key)
    visible = set(os.listdir(f"/proc/{node_pid}/root"))
    assert visible <= {"sandbox", "proc", "dev", "tmp", "lib", "lib64", "usr"}, visible
    assert not (Path(f"/proc/{node_pid}/root") / str(tmp_path).lstrip("/")).exists()
    assert not (Path(f"/proc/{node_pid}/root") / str(get_settings().data_dir).lstrip("/")).exists()
    runtime.retire(r)
    again = runtime.invoke(r, args={"db": str(secret)}).raw
    assert again["tmp_before"] == []  # the previous process's /tmp vanished with it


def test_never_root_no_capability_seccomp_on_and_limits_set(runtime):
    r = tenant_reactor("tenant-a", "module.exports = async () => ({ raw: 1 });", resources="standard")
    runtime.invoke(r, args={})
    (node_pid,) = runtime.pool.node_pids(r.key)
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{node_pid}/status").read_text().splitlines() if ":\t" in line
    )
    assert status["CapEff"].strip() == status["CapPrm"].strip() == status["CapBnd"].strip() == "0000000000000000"
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"
    limits = Path(f"/proc/{node_pid}/limits").read_text().splitlines()
    (files,) = [line.split()[3:5] for line in limits if line.startswith("Max open files")]
    assert files == [str(sandbox.MAX_OPEN_FILES)] * 2
    (core,) = [line.split()[4:6] for line in limits if line.startswith("Max core file size")]
    assert core == ["0", "0"]
    uid_map = Path(f"/proc/{node_pid}/uid_map").read_text().split()
    assert uid_map[0] == str(sandbox.SANDBOX_UID)  # uid 65534 inside; nothing else mapped
    assert len(uid_map) == 3
    # frozen while idle: no code runs between invocations
    assert wait_until(lambda: psutil.Process(node_pid).status() == psutil.STATUS_STOPPED, timeout=5)


# ---- one tenant per process ----------------------------------------------------------------------


def test_identical_code_of_two_tenants_shares_no_process_or_module_state(runtime):
    code = """
        let cached = null;
        module.exports = async (req) => { if (req.args.secret) cached = req.args.secret; return { raw: cached }; };
    """
    a, b = tenant_reactor("tenant-a", code), tenant_reactor("tenant-b", code)
    a = Reactor(a.id, code, a.runtime, tenant_id="tenant-a", kind="proxy")
    b = Reactor(a.id, code, a.runtime, tenant_id="tenant-b", kind="proxy")  # same id, same code: other tenant
    assert runtime.invoke(a, args={"secret": "tenant A's key"}).raw == "tenant A's key"
    assert runtime.invoke(b, args={}).raw is None
    assert runtime.invoke(a, args={}).raw == "tenant A's key"
    assert set(runtime.pool.node_pids(a.key)).isdisjoint(runtime.pool.node_pids(b.key))


def test_an_idle_process_is_reaped_after_its_idle_time(tmp_path):
    rt = ReactorRuntime(tmp_path, pool=NodePool(idle_seconds=60))
    try:
        r = tenant_reactor("tenant-a", "module.exports = async () => ({ raw: 1 });")
        rt.invoke(r, args={})
        (pid,) = rt.pool.pids(r.key)
        assert rt.pool.reap(time.monotonic() + 30) == 0
        assert rt.pool.reap(time.monotonic() + 61) == 1
        assert not rt.pool.pids(r.key)
        assert wait_until(
            lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=5
        )
    finally:
        rt.close()


def test_the_owner_check_ends_the_processes_of_an_owner_that_is_gone(tmp_path):
    gone: set[str] = set()
    rt = ReactorRuntime(tmp_path, pool=NodePool(owner_check=lambda keys: {k for k in keys if k in gone}))
    try:
        kept = tenant_reactor("tenant-a", "module.exports = async () => ({ raw: 1 });")
        deleted = tenant_reactor("tenant-a", "module.exports = async () => ({ raw: 2 });")
        rt.invoke(kept, args={})
        rt.invoke(deleted, args={})
        gone.add(deleted.key)
        assert rt.pool.check_owners() == 1
        assert rt.pool.pids(deleted.key) == [] and len(rt.pool.pids(kept.key)) == 1
    finally:
        rt.close()


# ---- fail closed ---------------------------------------------------------------------------------


def test_without_bubblewrap_nothing_runs_and_the_answer_is_503(tmp_path, monkeypatch):
    rt = ReactorRuntime(tmp_path, pool=NodePool(bwrap="/nonexistent/bwrap"))
    try:
        with pytest.raises(Problem) as caught:
            rt.invoke(tenant_reactor("tenant-a", "module.exports = async () => ({ raw: 1 });"), args={})
    finally:
        rt.close()
    assert caught.value.status == 503
    assert "bubblewrap (/nonexistent/bwrap) is not installed" in caught.value.detail
    assert json.dumps(caught.value.body())  # a problem document
    monkeypatch.setenv("TESSERA_REACTOR_BWRAP", "/nonexistent/bwrap")
    reload_settings()
    try:
        line = sandbox_line()
    finally:
        monkeypatch.delenv("TESSERA_REACTOR_BWRAP")
        reload_settings()
    assert line is not None and "\n" not in line and "bubblewrap" in line and "503" in line
    assert sandbox_line() is None  # this machine has it


def test_a_kernel_that_refuses_namespaces_is_named(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    reason = sandbox.availability(str(fake))
    assert reason is not None and "namespaces" in reason and "No permissions" in reason
