"""What the benchmarks share: options, the platform's environment, a fresh database and Redis, child
processes that never outlive the run, CPU accounting, percentiles and the printed tables.

The platform reads its settings from ``TESSERA_*`` variables when first imported, so a benchmark calls
:func:`adopt_env` before anything imports ``tessera``, ``storage`` or ``core`` (as ``tests/conftest.py``
does), and imports the platform inside functions.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks import dashboard
from benchmarks.dashboard import Figure

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"


# ---- options and environment ---------------------------------------------------------------------


def add_service_options(parser: argparse.ArgumentParser) -> None:
    """``--database-url`` and ``--redis-url`` (both are wiped at the start of a run)."""
    parser.add_argument(
        "--database-url",
        default=DEFAULT_DATABASE_URL,
        help="PostgreSQL database to drop, recreate and migrate (default: %(default)s)",
    )
    parser.add_argument(
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="Redis database to flush and use as broker and store (default: %(default)s)",
    )


def platform_env(database_url: str, redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    """The ``TESSERA_*`` variables of a benchmark run: its database, Redis as broker and limiter store,
    no rate limits, quiet logs, a private data dir; ``extra`` adds or overrides variables."""
    return {
        # a shared database never gets a key file of its own: every process of the run shares this key
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
        "TESSERA_DATABASE_URL": database_url,
        "TESSERA_BROKER_URL": redis_url,
        "TESSERA_REDIS_URL": redis_url,
        "TESSERA_DATA_DIR": str(data_dir),
        "TESSERA_RATE_LIMIT_ENABLED": "false",
        "TESSERA_LOG_LEVEL": "WARNING",
        **extra,
    }


def adopt_env(variables: dict[str, str]) -> None:
    """Put ``variables`` into this process's environment, before the platform reads its settings."""
    os.environ.update(variables)
    if "config.settings" in sys.modules:  # imported already: make it read the environment again
        from config.settings import reload_settings

        reload_settings()


def executable(name: str) -> str:
    """A command of the virtual environment running this script (``tessera``, ``celery``)."""
    for folder in (Path(sys.executable).parent, REPO / ".venv" / "bin"):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed in the virtual environment")
    return found


def install_uvloop() -> bool:
    """Use uvloop's event loop when it is installed (it is optional); True when it is in use."""
    try:
        import uvloop
    except ImportError:
        return False
    uvloop.install()
    return True


# ---- services ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _admin_connection(database_url: str):
    """An autocommit connection to the server's ``postgres`` database (not the one benchmarked)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    admin = create_engine(make_url(database_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            yield conn
    finally:
        admin.dispose()


@contextlib.contextmanager
def exclusive_use(database_url: str, redis_url: str) -> Iterator[None]:
    """Hold PostgreSQL advisory locks named after both URLs for the block, so that two benchmark runs
    never wipe each other's database or Redis; RuntimeError when another run holds one of them."""
    from sqlalchemy import text

    with _admin_connection(database_url) as conn:
        for url in (database_url, redis_url):
            if not conn.execute(
                text("SELECT pg_try_advisory_lock(hashtext(:name))"), {"name": f"tessera-benchmark:{url}"}
            ).scalar():
                raise RuntimeError(
                    f"another benchmark run is using {url}; wait for it or pass --database-url/--redis-url of your own"
                )
        yield  # closing the connection releases the locks


def recreate_database(url: str) -> None:
    """Drop and create the database at ``url``, then migrate it to head."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from storage import migrate

    name = make_url(url).database
    with _admin_connection(url) as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    migrate.upgrade(url)


def vacuum_analyze(database_url: str, *tables: str) -> None:
    """``VACUUM (ANALYZE)`` of ``tables`` (every table when none is given) in the database at
    ``database_url``: what autovacuum does on a production server as a benchmark's rows pile up. A
    server configured with ``autovacuum = off`` (as CI machines may be) never gathers statistics for
    a fresh benchmark database: the plans PostgreSQL caches for the prepared hot statements are then
    made for empty tables (sequential scans of ``jobs``) and stay so as the table grows, which
    measures a database no operator runs. Benchmarks call this once the tables hold some history, and
    before each measured round."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text("VACUUM (ANALYZE) " + ", ".join(f'"{table}"' for table in tables)))
    finally:
        engine.dispose()


def flush_redis(url: str) -> None:
    """Empty the Redis database at ``url``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


@contextlib.contextmanager
def fresh_platform(args: argparse.Namespace, prefix: str, **extra_env: str) -> Iterator[Path]:
    """The set-up every benchmark run starts with; yields a scratch folder (data dir, child logs).

    Takes exclusive use of ``args.database_url`` and ``args.redis_url``, adopts the platform's
    environment (:func:`platform_env` plus ``extra_env``), recreates and migrates the database and
    flushes Redis.
    """
    with scratch_dir(prefix) as scratch, exclusive_use(args.database_url, args.redis_url):
        adopt_env(platform_env(args.database_url, args.redis_url, scratch / "data", **extra_env))
        print(f"database {args.database_url} (recreated), redis {args.redis_url} (flushed)", flush=True)
        recreate_database(args.database_url)
        flush_redis(args.redis_url)
        yield scratch


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; 130 after Ctrl-C or SIGTERM (the children are stopped by then)."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; child processes stopped", file=sys.stderr)
        code = 130
    sys.exit(code)


def warn_if_shared(redis_url: str) -> None:
    """Print a warning naming any process outside this run connected to the run's Redis database: a
    worker of another run there takes this run's messages (and, not finding their rows in its own
    database, drops them), and a producer there adds load."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        settings = client.connection_pool.connection_kwargs
        db, port = settings.get("db", 0), settings.get("port", 6379)
        ports = {int(c["addr"].rsplit(":", 1)[1]) for c in client.client_list() if int(c.get("db", -1)) == db}
    finally:
        client.close()
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
    others = {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.pid and c.pid not in ours and c.laddr and c.laddr.port in ports and c.raddr and c.raddr.port == port
    }
    for pid in sorted(others):
        with contextlib.suppress(psutil.Error):
            command = " ".join(psutil.Process(pid).cmdline())[:160]
            print(f"WARNING: process {pid} outside this run uses {redis_url}: {command}", file=sys.stderr)


def make_tenant(name: str):
    """A new test tenant with its management application (``domain.tenancy.tenants.NewTenant``)."""
    from domain.tenancy.tenants import create_tenant
    from storage.db import session_scope

    with session_scope() as session:
        return create_tenant(session, name=name, owner_email=f"bench-{os.urandom(4).hex()}@example.com")


def subscribe_webhook(tenant_id, url: str, events: Sequence[str] = ("token.created",)) -> None:
    """Give the tenant an enabled webhook to ``url`` for ``events`` (as ``POST /webhooks`` would)."""
    from domain.tenancy.auth import system_caller
    from domain.webhooks.service import create_webhook
    from storage.db import session_scope
    from storage.models import Tenant

    with session_scope() as session:
        caller = system_caller(session.get(Tenant, tenant_id))
        create_webhook(session, caller, name="bench", url=url, notify_email=None, events=list(events))


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder (data dir, child logs), removed when the block ends."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- child processes -----------------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM the child if this process dies without cleaning up (SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """A child process (leader of its own process group) whose output goes to a log file."""

    name: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def check(self) -> None:
        """Raise when the child has exited."""
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"{self.name} exited with code {code}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the child's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(f"  {self.name}| {line}" for line in text.splitlines()[-lines:])


@dataclass
class Children:
    """Child processes that are all stopped when the ``with`` block ends, however it ends.

    Each child runs in its own session (so a Ctrl-C in the terminal reaches only this process, which
    then stops them in order) and is stopped with SIGTERM to its whole process group (a Celery
    worker's pool too), then SIGKILL after ``grace`` seconds. SIGTERM and SIGHUP to this process are
    handled as a Ctrl-C so the same clean-up runs; on Linux a child is also sent SIGTERM if this
    process is killed outright.
    """

    log_dir: Path
    grace: float = 15.0
    children: list[Child] = field(default_factory=list)
    _saved_handlers: dict = field(default_factory=dict)

    def __enter__(self) -> Children:
        # Started in the background by a shell, SIGINT comes ignored: take it back, so that an explicit
        # SIGINT stops the run too and asyncio.run can install its clean Ctrl-C handling.
        self._saved_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: leave SIGHUP ignored
                self._saved_handlers[sig] = signal.signal(sig, _interrupt)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
                for child in self.children:
                    print(f"--- last output of {child.name} ---\n{child.log_tail()}", file=sys.stderr)
            self.stop_all()
        finally:
            for sig, handler in self._saved_handlers.items():
                signal.signal(sig, handler)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` in the repository root with this environment plus ``env``."""
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                list(argv),
                cwd=REPO,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, process, log_path)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        """Stop every child, newest first, then reap them."""
        _stop_groups(list(reversed(self.children)), self.grace)
        self.children.clear()


def _interrupt(signum, frame) -> None:
    """Treat the signal as a Ctrl-C: through the current SIGINT handler (asyncio.run's cancels its
    main task cleanly), else as KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt(f"signal {signum}")


def _signal_group(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


def _stop_groups(children: list[Child], grace: float) -> None:
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(max(0.1, deadline - time.monotonic()))
    for child in children:  # stragglers, and pool processes left behind by a leader that exited
        _signal_group(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(5)


def python_module(module: str, *args: str) -> list[str]:
    """The argv running ``python -m module args`` (from the repository root, so nothing in
    ``benchmarks/`` shadows the standard library, e.g. ``benchmarks/tokenize.py``)."""
    return [sys.executable, "-m", module, *args]


# ---- waiting -------------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], object],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    children: Iterable[Child] = (),
) -> object:
    """Poll ``predicate()`` until it returns something truthy and return that; raise TimeoutError after
    ``timeout`` seconds, or RuntimeError as soon as one of ``children`` has exited."""
    watched = list(children)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for child in watched:
            child.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``url``: (status, body); any HTTP answer counts, connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http(url: str, child: Child, timeout: float = 60.0) -> None:
    """Wait until ``url`` answers at all (any status), failing early if ``child`` exits."""

    def answers() -> bool:
        try:
            http_get(url, timeout=2)
        except OSError:
            return False
        return True

    wait_until(answers, timeout=timeout, what=f"{child.name} answering {url}", interval=0.1, children=[child])


# ---- the platform's processes -------------------------------------------------------------------


def start_sandbox_and_api(children: Children, sandbox_port: int, api_port: int) -> tuple[Child, Child]:
    """``tessera sandbox`` and ``tessera api`` on these ports, each answering before the next starts."""
    sandbox = children.start("sandbox", [executable("tessera"), "sandbox", "--port", str(sandbox_port)])
    wait_http(f"http://127.0.0.1:{sandbox_port}/health", sandbox)
    api = children.start("api", [executable("tessera"), "api", "--port", str(api_port)])
    wait_http(f"http://127.0.0.1:{api_port}/status", api)
    return sandbox, api


def start_platform_worker(children: Children, concurrency: int) -> Child:
    """``tessera worker --concurrency N`` on every platform queue, with this process's settings."""
    return children.start("worker", [executable("tessera"), "worker", "--concurrency", str(concurrency)])


# ---- CPU accounting ------------------------------------------------------------------------------


def process_tree(pid: int) -> Callable[[], list[psutil.Process]]:
    """A process and all its descendants (a server, a Celery worker with its pool)."""

    def members() -> list[psutil.Process]:
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    return members


def processes_named(name: str) -> Callable[[], list[psutil.Process]]:
    """Every process of the machine with this name (``postgres``, ``redis-server``): shared services,
    so their CPU includes anyone else's load at the time."""

    def members() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]

    return members


def this_process() -> Callable[[], list[psutil.Process]]:
    """The benchmark process itself (the load generator, the producer)."""
    return lambda: [psutil.Process()]


def _cpu_seconds(members: list[psutil.Process]) -> dict[tuple[int, float], float]:
    seconds = {}
    for process in members:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            seconds[(process.pid, process.create_time())] = times.user + times.system
    return seconds


class CpuMeter:
    """Cores kept busy by groups of processes over a span: CPU seconds used / wall seconds.

    A process that exits during the span is not counted; one started during it counts in full.
    """

    def __init__(self, groups: dict[str, Callable[[], list[psutil.Process]]]):
        self.groups = groups
        self._start: dict[str, dict] = {}
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._start = {name: _cpu_seconds(members()) for name, members in self.groups.items()}

    def stop(self) -> dict[str, float]:
        """The cores used by each group since :meth:`start`."""
        wall = max(1e-9, time.monotonic() - self._started_at)
        used = {}
        for name, members in self.groups.items():
            before = self._start.get(name, {})
            now = _cpu_seconds(members())
            used[name] = sum(seconds - before.get(key, 0.0) for key, seconds in now.items()) / wall
        return used


# ---- figures -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by the nearest-rank method; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def median(values: Iterable[float]) -> float:
    """The median; NaN when there is nothing."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is 0."""
    return numerator / denominator if denominator else float("nan")


def publish(benchmark: str, figures: Sequence[Figure]) -> Path:
    """Record a finished run's headline figures: write ``benchmarks/results/<benchmark>.json`` with them,
    the UTC date, this machine's 1-minute load average and cores and the command, then regenerate the
    dashboard table in ``benchmarks/README.md`` (:mod:`benchmarks.dashboard`). Call it once the run's
    checks have passed (figures that miss their goal are published too); returns the file's path.

    ValueError for a benchmark not in ``dashboard.BENCHMARKS`` or a figure of another benchmark.
    """
    script = Path(sys.argv[0]).resolve()
    command = [str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0], *sys.argv[1:]]
    result = dashboard.Result(
        benchmark=benchmark,
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        load_average=round(os.getloadavg()[0], 2),
        cores=os.cpu_count(),
        figures=list(figures),
        command=shlex.join(command),
    )
    path = dashboard.save(result)
    dashboard.write_readme()
    print(f"\nfigures published to {path.relative_to(REPO)} and the table of benchmarks/README.md", flush=True)
    return path


def publish_cpu_and_wall(
    benchmark: str,
    rounds: dict[str, list[tuple[float, float]]],
    *,
    platform: str,
    reference: str,
    per: str,
    title: str,
) -> None:
    """Print and publish two variants measured in one process: ``rounds`` maps each variant's name to
    its rounds' ``(CPU, wall)`` microseconds per ``per`` (e.g. "message published"); their medians
    in a table titled ``title``, the CPU ratio ``platform`` / ``reference``, and both figures (in ms)
    with ``reference`` as their reference."""
    cpu = {name: statistics.median(c for c, _ in figures) for name, figures in rounds.items()}
    wall = {name: statistics.median(w for _, w in figures) for name, figures in rounds.items()}
    print_table(
        f"{title} (load average {os.getloadavg()[0]:.2f} at the end)",
        ["variant", "CPU us", "wall us"],
        [(name, round(cpu[name], 1), round(wall[name], 1)) for name in rounds],
    )
    print(f"CPU ratio {platform} / {reference}: {cpu[platform] / cpu[reference]:.2f}")
    publish(
        benchmark,
        [
            Figure(benchmark, f"CPU per {per}", cpu[platform] / 1000, "ms", reference, cpu[reference] / 1000),
            Figure(benchmark, f"wall time per {per}", wall[platform] / 1000, "ms", reference, wall[reference] / 1000),
        ],
    )


def print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Print a plain-text table: text left-aligned, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(_is_number(row[i]) for row in cells if i < len(row)) for i in range(len(headers))]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values))
        return "  ".join(padded).rstrip()

    print(f"\n{title}")
    print(line(list(headers)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))
    sys.stdout.flush()


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _is_number(text: str) -> bool:
    return text == "-" or text.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()
