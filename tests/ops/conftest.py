"""Operations tests: fixtures for real ``tessera`` subprocesses, and the session-wide log capture.

The log capture: importing this conftest (pytest does it while collecting, before any test runs)
puts :data:`CAPTURE` on the root logger. It formats each record with the production JSON formatter
in the thread that logs it (so the line holds that thread's trace, tenant, job and task) and scans
the line and the raw message for card numbers, CVCs, API keys and signing secrets
(``tests/ops/scan.py``), noting the test that was running. The level of the root logger is kept at
INFO (the production default; Celery's test worker lowers it to WARNING) so the lines production
would write are the lines checked. ``test_logs.py::test_no_secret_reaches_a_log_line`` runs last and
fails on any finding: the whole run's records, not only these tests'.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra import logs
from tests.conftest import REDIS_PREFIX, free_port
from tests.ops.scan import find_secrets, redact

SCAN_TEST = "test_no_secret_reaches_a_log_line"


class CaptureHandler(logging.Handler):
    """Keeps every record of the run as its JSON line, and what secrets any of them held."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.setFormatter(logs.formatter("json"))
        self.lines: collections.deque[str] = collections.deque(maxlen=200_000)
        self.count = 0
        self.findings: list[tuple[str, str, str, str]] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception as exc:  # a record that cannot be formatted is still scanned
            line = f"(unformattable {type(exc).__name__}) {record.__dict__!r}"
        try:
            raw = record.getMessage()
        except Exception:
            raw = str(record.msg)
        secrets = find_secrets(line) + find_secrets(raw)
        with self._lock:
            self.count += 1
            self.lines.append(line)
            if secrets:
                test = os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)")
                kinds = ", ".join(sorted(set(secrets)))
                self.findings.append((test, record.name, kinds, redact(raw)[:300]))

    def ensure_installed(self) -> None:
        """On the root logger, with the root at INFO or lower."""
        root = logging.getLogger()
        if self not in root.handlers:
            root.addHandler(self)
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)

    def json_lines(self) -> list[dict]:
        """The captured lines parsed (lines that are not JSON are left out)."""
        parsed = []
        for line in list(self.lines):
            try:
                parsed.append(json.loads(line))
            except ValueError:
                continue
        return parsed


CAPTURE = CaptureHandler()
CAPTURE.ensure_installed()


class _KeepCapturing:
    """A plugin (registered for every test, not only these) that puts the capture back before each
    phase: Celery's worker set-up lowers the root logger to WARNING."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        CAPTURE.ensure_installed()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        CAPTURE.ensure_installed()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item):
        CAPTURE.ensure_installed()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Register the capture plugin for the whole run; move the secret scan to the very end."""
    if not config.pluginmanager.has_plugin("tessera-ops-log-capture"):
        config.pluginmanager.register(_KeepCapturing(), "tessera-ops-log-capture")
    last = [item for item in items if item.name == SCAN_TEST]
    items[:] = [item for item in items if item.name != SCAN_TEST] + last


# ---- real tessera processes ----------------------------------------------------------------------


TESSERA = [sys.executable, "-m", "tessera.cli"]


@dataclass
class Process:
    """A ``tessera`` subprocess in its own session, its stdout and stderr in files."""

    name: str
    popen: subprocess.Popen
    stdout: Path
    stderr: Path

    def output(self) -> str:
        """The tail of what it wrote, for assertion messages."""
        text = self.stdout.read_text(errors="replace")[-3000:] + "\n---stderr---\n"
        return text + self.stderr.read_text(errors="replace")[-5000:]

    def stderr_lines(self) -> list[str]:
        """Every line it wrote to stderr."""
        return self.stderr.read_text(errors="replace").splitlines()

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself."""
        self.popen.send_signal(signum)

    def kill_group(self) -> None:
        """SIGKILL the process and every child it started (its own process group)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(10)


@dataclass
class Platform:
    """Real ``tessera`` processes on the test database, under a Redis key prefix of their own."""

    tmp_path: Path
    env: dict[str, str]
    processes: list[Process] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        """The base URL of ``tessera api`` started by :meth:`start_api`."""
        return f"http://127.0.0.1:{self.env['TESSERA_API_PORT']}"

    def start(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> Process:
        """Start ``tessera <args>``."""
        index = len(self.processes)
        out = self.tmp_path / f"{index}-{name}.out"
        err = self.tmp_path / f"{index}-{name}.err"
        env = {**self.env, **(extra_env or {})}
        popen = subprocess.Popen(
            [*TESSERA, *args],
            env=env,
            stdout=out.open("wb"),
            stderr=err.open("wb"),
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        process = Process(name, popen, out, err)
        self.processes.append(process)
        return process

    def start_api(self) -> Process:
        """``tessera api`` on the platform's port, once it answers ``/healthz``."""
        import urllib3

        process = self.start("api", "api")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.alive(), process.output()
            try:
                if urllib3.request("GET", self.api_url + "/healthz", timeout=2, retries=False).status == 200:
                    return process
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("tessera api did not start\n" + process.output())

    def start_worker(self, *args: str, extra_env: dict[str, str] | None = None) -> Process:
        """``tessera worker`` (prefork), once it says it is ready."""
        process = self.start("worker", "worker", *args, extra_env=extra_env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.alive(), process.output()
            if " ready." in process.stderr.read_text(errors="replace"):
                return process
            time.sleep(0.2)
        raise AssertionError("tessera worker did not start\n" + process.output())

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``tessera <args>`` to completion."""
        return subprocess.run([*TESSERA, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def settings(self):
        """The settings the processes read (the test settings, with their key prefix)."""
        from config.settings import get_settings

        return get_settings().model_copy(update={"redis_key_prefix": self.env["TESSERA_REDIS_KEY_PREFIX"]})

    def stop_all(self) -> None:
        """Kill whatever still runs."""
        for process in self.processes:
            if process.alive():
                process.kill_group()


@pytest.fixture
def platform(database, redis_flushed, s3_server, sandbox, tmp_path):
    """Real ``tessera`` processes (api, worker, beat, flower) on the test database and Redis, under a
    key prefix of their own (the in-process test worker never sees their messages); JSON logs."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.update(
        {
            "TESSERA_REDIS_KEY_PREFIX": f"{REDIS_PREFIX}ops{os.urandom(3).hex()}:",
            # The run's TESSERA_MASTER_KEY (inherited) sealed the in-process tenants' keys.
            "TESSERA_METRICS_DIR": str(tmp_path / "metrics"),
            "TESSERA_API_PORT": str(free_port()),
            "TESSERA_LOG_FORMAT": "json",
            "TESSERA_LOG_LEVEL": "INFO",
        }
    )
    running = Platform(tmp_path, env)
    yield running
    running.stop_all()
