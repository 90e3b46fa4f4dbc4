"""The ``tessera`` command.

    tessera dev                      migrations, then api, worker, beat, sandbox (and S3) as children
    tessera api [--host H] [--port P] [--workers N]
    tessera worker [celery worker options]   prefork pool, and the providers and reactors queues on threads
    tessera beat [celery beat options]
    tessera migrate
    tessera tenants create --name NAME --owner-email EMAIL [--type test|production] [--json]
    tessera tenants list [--json]
    tessera sandbox [--host H] [--port P]
    tessera flower [--address A] [--port P] [flower options]
    tessera jobs list [--state S]... [--kind K] [--tenant ID] [--limit N] [--json]
    tessera jobs show|retry|cancel ID [--json]
    tessera queues [--json] [--timeout S]
    tessera keys status [--tenant ID] [--json]
    tessera keys rewrap [--wait]
    tessera keys rotate --tenant ID | --all [--wait]
    tessera --version

Every command reads the same ``TESSERA_*`` settings (``config/settings.py``: the environment, then
``./.env``); each one that reads state (migrate, tenants, jobs, queues) says first, on stderr, which
database and broker it looked at.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from config import __version__
from config.settings import get_settings


def share_metrics(settings) -> str:
    """Point prometheus-client's multiprocess mode at ``TESSERA_METRICS_DIR`` (unless
    ``PROMETHEUS_MULTIPROC_DIR`` is set already), before anything imports the metrics; returns it."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or str(settings.effective_metrics_dir)
    os.makedirs(folder, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


def _keys_open() -> bool:
    """The key check (``storage.key_check``): True when this process's keys open the database's;
    else one line on stderr naming the setting, and False (the caller exits 1)."""
    from storage.key_check import KeyCheckFailed, require

    try:
        require()
    except KeyCheckFailed as exc:
        print(f"tessera: refusing to start: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def _api(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.listen_fd is None and not args.reuse_port and not _keys_open():
        return 1
    share_metrics(settings)
    host = args.host or settings.api_host
    port = args.port or settings.api_port
    workers = args.workers or settings.api_workers or os.cpu_count() or 1
    if args.reuse_port or args.listen_fd is not None or workers == 1:
        return _serve_api(settings, host, port, reuse_port=args.reuse_port, listen_fd=args.listen_fd)
    argv = [sys.executable, "-m", "tessera.cli", "api", "--host", host, "--port", str(port), "--reuse-port"]
    children = [subprocess.Popen(argv) for _ in range(workers)]  # noqa: S603 - our own command
    if _answers(host, port, children):
        print(f"tessera api listening on http://{host}:{port} ({workers} processes)", flush=True)
    return _supervise(children)


def _answers(host: str, port: int, children: list[subprocess.Popen], timeout: float = 60.0) -> bool:
    """Wait until the api answers ``GET /healthz`` on ``host:port`` (False when a child ended first
    or ``timeout`` seconds passed)."""
    import urllib.error
    import urllib.request

    local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a wildcard's loopback
    url = f"http://{f'[{local}]' if ':' in local else local}:{port}/healthz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(child.poll() is None for child in children):
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def _serve_api(settings, host: str, port: int, *, reuse_port: bool, listen_fd: int | None = None) -> int:
    """One api process on ``host:port`` (``reuse_port``: beside its siblings on the same port;
    ``listen_fd``: on the listening socket its parent bound)."""
    import asyncio

    from aiohttp import web

    from app.main import init_app
    from infra.logs import configure_logging

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on the platforms it supports
        pass
    else:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    configure_logging(settings)
    listening: dict = {"host": host, "port": port}
    if listen_fd is not None:  # a socket bound by the parent (tessera dev): the port is surely ours
        listening = {"sock": socket.socket(fileno=listen_fd)}

    def announce(_text: str) -> None:  # called once the site listens and the app answers
        if not reuse_port:
            print(f"tessera api listening on http://{host}:{port}", flush=True)

    app = init_app(settings)
    app.on_startup.append(_freeze_heap)
    web.run_app(
        app,
        **listening,
        print=announce,
        shutdown_timeout=settings.api_shutdown_timeout_seconds,
        access_log=None,
        reuse_port=reuse_port or None,
    )
    return 0


async def _freeze_heap(_app) -> None:
    """Once started, move every object made so far (modules, models, routes: most of the heap) out
    of the garbage collector's sight: a full collection then walks what requests make, not the
    whole platform, so it no longer stalls the event loop for tens of milliseconds."""
    gc.collect()
    gc.freeze()


def _supervise(children: list[subprocess.Popen]) -> int:
    """Wait on the api processes; SIGTERM and SIGINT are passed on to each (each then finishes the
    requests in flight, ``TESSERA_API_SHUTDOWN_TIMEOUT_SECONDS``). When one process ends on its own
    the others are stopped too and the exit status is 1 (the orchestrator restarts the service)."""
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        ended = [child for child in children if child.poll() is not None]
        if ended and not stopping:
            stop(signal.SIGTERM, None)
        if len(ended) == len(children):
            break
        time.sleep(0.2)
    return 0 if stopping and all(c.returncode in (0, -signal.SIGTERM, -signal.SIGINT) for c in children) else 1


def _worker(args: argparse.Namespace) -> int:
    if not _keys_open():
        return 1
    share_metrics(get_settings())
    from infra.logs import configure_logging
    from tessera.worker import run_worker
    from workers.celery_app import QUEUES, celery_app

    configure_logging(get_settings())
    return run_worker(celery_app, QUEUES, args.celery_args)


def _beat(args: argparse.Namespace) -> int:
    from infra.logs import configure_logging
    from workers.celery_app import celery_app

    if not _keys_open():
        return 1
    settings = get_settings()
    configure_logging(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    schedule = str(settings.data_dir / "celerybeat-schedule")
    celery_app.start(["beat", "--loglevel", settings.log_level, "--schedule", schedule, *args.celery_args])
    return 0


def _migrate(_args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from storage import migrate

    url = get_settings().effective_database_url
    try:
        migrate.upgrade(url)
    except OperationalError as exc:
        print(f"error: {database_unreachable(url, exc)}", file=sys.stderr, flush=True)
        return 1
    print("database migrated to head", flush=True)
    return 0


def database_unreachable(url: str, exc: Exception) -> str:
    """One line for an operator whose database does not answer: which database, and for a PostgreSQL
    database that does not exist yet, the command that creates it."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    where = f"{parsed.host or 'localhost'}:{parsed.port or 5432}"
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if parsed.get_backend_name() == "postgresql" and "does not exist" in reason and parsed.database:
        user = f" -U {parsed.username}" if parsed.username else ""
        return (
            f'database "{parsed.database}" does not exist on {where}; create it with '
            f"`createdb -h {parsed.host or 'localhost'} -p {parsed.port or 5432}{user} {parsed.database}` "
            "(or point TESSERA_DATABASE_URL at another database)"
        )
    if parsed.get_backend_name() == "sqlite":
        return f'cannot open the SQLite database "{parsed.database}": {reason}'
    name = parsed.database or parsed.render_as_string(hide_password=True)
    return f'cannot reach database "{name}" ({parsed.get_backend_name()} on {where}): {reason}'


def _tenants_create(args: argparse.Namespace) -> int:
    from domain.tenancy.tenants import create_tenant
    from storage.db import session_scope

    if not _keys_open():
        return 1
    try:
        with session_scope() as session:
            created = create_tenant(session, name=args.name, owner_email=args.owner_email, type=args.type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {
        "tenant_id": str(created.tenant_id),
        "application_id": str(created.application_id),
        "api_key": created.api_key,
    }
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(
            f"tenant:      {result['tenant_id']}\napplication: {result['application_id']}\n"
            f"api key:     {result['api_key']}  (shown once)",
            flush=True,
        )
    return 0


def _tenants_list(args: argparse.Namespace) -> int:
    from domain.tenancy.tenants import list_tenants
    from storage.db import session_scope

    with session_scope() as session:
        rows = list_tenants(session, limit=args.limit)
    if args.json:
        _print_json(rows)
    elif not rows:
        print("no tenants yet: tessera tenants create --name NAME --owner-email EMAIL", flush=True)
    else:
        columns = [
            ("id", "ID"),
            ("name", "NAME"),
            ("type", "TYPE"),
            ("owner_email", "OWNER"),
            ("members", "MEMBERS"),
            ("created_at", "CREATED"),
        ]
        shown = [{**row, "created_at": row["created_at"].strftime("%Y-%m-%d %H:%M")} for row in rows]
        print(_table(shown, columns), flush=True)
    return 0


def _sandbox(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from sandbox.app import run

    default = urlsplit(get_settings().sandbox_url)
    run(args.host or default.hostname or "127.0.0.1", args.port or default.port or 8081)
    return 0


def _flower(args: argparse.Namespace) -> int:
    settings = get_settings()
    password = settings.flower_password.get_secret_value() if settings.flower_password else ""
    if not password:
        print("error: set TESSERA_FLOWER_PASSWORD (Flower answers its API only behind basic auth)", file=sys.stderr)
        return 2
    if ":" in settings.flower_user or "," in settings.flower_user + password:
        print("error: TESSERA_FLOWER_USER may not hold ':' or ',', nor TESSERA_FLOWER_PASSWORD ','", file=sys.stderr)
        return 2
    if settings.effective_broker_url.startswith("sqla+"):
        print(
            "error: the embedded SQLite broker carries no task events, so Flower would show none; set "
            "TESSERA_BROKER_URL=redis://... (in the environment or ./.env) for tessera dev, worker and flower alike",
            file=sys.stderr,
            flush=True,
        )
        return 2
    # Flower reads FLOWER_* options from the environment: the password stays out of the process list.
    os.environ["FLOWER_BASIC_AUTH"] = f"{settings.flower_user}:{password}"
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # Flower serves its own /metrics from memory
    from workers.celery_app import celery_app

    argv = ["flower", f"--address={args.address}", f"--port={args.port}", *args.celery_args]
    celery_app.start(argv)
    return 0


def _print_json(value) -> None:
    print(json.dumps(value, indent=2, default=str), flush=True)


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows as a plain text table: ``columns`` is ``[(key, heading), ...]``."""
    cells = [[heading for _, heading in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else str(row.get(key)) for key, _ in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def _short(text: str | None, width: int = 60) -> str | None:
    if text is None:
        return None
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _jobs_list(args: argparse.Namespace) -> int:
    import uuid

    from infra import ops
    from storage.db import session_scope

    try:
        tenant = uuid.UUID(args.tenant) if args.tenant else None
    except ValueError:
        print(f"error: '{args.tenant}' is not a tenant id", file=sys.stderr)
        return 2
    with session_scope() as session:
        rows = ops.list_jobs(
            session, get_settings(), states=args.state, kind=args.kind, tenant_id=tenant, limit=args.limit
        )
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print("no jobs match", flush=True)
        return 0
    for row in rows:
        row["tries"] = f"{row['attempts']}/{row['max_attempts']}"
        row["error"] = _short(row["last_error"])
    columns = [
        ("id", "ID"),
        ("kind", "KIND"),
        ("state", "STATE"),
        ("tries", "ATTEMPTS"),
        ("updated_at", "UPDATED"),
        ("error", "LAST ERROR"),
    ]
    print(_table(rows, columns), flush=True)
    return 0


def _show(view: dict) -> str:
    lines = []
    for key, value in view.items():
        if key == "attempt_log":
            continue
        lines.append(f"{key + ':':<18}{'-' if value is None else value}")
    log = view.get("attempt_log")
    if log is not None:
        lines.append("attempts log:")
        if log:
            columns = [
                ("number", "#"),
                ("attempted_at", "AT"),
                ("outcome", "OUTCOME"),
                ("status_code", "STATUS"),
                ("duration_ms", "MS"),
                ("error", "ERROR"),
            ]
            lines += ["  " + line for line in _table(log, columns).splitlines()]
        else:
            lines.append("  (none yet)")
    return "\n".join(lines)


def _jobs_one(operation: str):
    def run(args: argparse.Namespace) -> int:
        from infra import ops
        from storage.db import session_scope

        settings = get_settings()
        try:
            with session_scope() as session:
                view = getattr(ops, {"show": "show_job"}.get(operation, operation))(session, settings, args.id)
        except (ops.NotFound, ops.Refused) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        if args.json:
            _print_json(view)
        else:
            if operation == "retry":
                print(f"{view['kind']} {view['id']} queued again; its task was sent", flush=True)
            elif operation == "cancel":
                print(f"{view['kind']} {view['id']} cancelled", flush=True)
            print(_show(view), flush=True)
        return 0

    return run


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _alive(args: argparse.Namespace) -> int:
    """Liveness of this host's worker or beat by its heartbeats (a container's healthcheck): exit 0
    when every worker heartbeat recorded from this host is alive (at least one), or beat's is; else 1
    with one line saying what is missing."""
    from infra import ops

    host = socket.gethostname()
    try:
        beats = ops.heartbeats(get_settings())
    except Exception as exc:  # noqa: BLE001 - the check fails, saying why
        print(f"not alive: heartbeats unreadable ({type(exc).__name__}: {exc})"[:300], file=sys.stderr, flush=True)
        return 1
    if args.role == "beat":
        beat = beats.get("beat")
        ok = bool(beat and beat.host == host and beat.alive())
        problem = (
            "no beat heartbeat from this host"
            if not (beat and beat.host == host)
            else f"beat's last heartbeat is {beat.age():.0f}s old"
        )
    else:
        mine = [b for b in beats.values() if b.kind == "worker" and b.host == host]
        stale = sorted(b.name for b in mine if not b.alive())
        ok = bool(mine) and not stale
        problem = f"stale heartbeats: {', '.join(stale)}" if stale else "no worker heartbeat from this host"
    if not ok:
        print(f"not alive: {problem}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def _queues(args: argparse.Namespace) -> int:
    from infra import ops

    report = ops.queue_report(get_settings(), timeout=args.timeout)
    unreachable = {"broker", "database"} & set(report["errors"])
    missing = [w["name"] for w in report["workers"] if not w["alive"]]
    if not any(w["alive"] for w in report["workers"]):
        missing.append("every worker" if not report["workers"] else "a live worker")
    if not report["beat"]["alive"]:
        missing.append("beat")
    failed = 1 if unreachable or missing else 0
    if args.json:
        _print_json(report)
        return failed
    rows = [{**q, "oldest": _age(q["oldest_age_seconds"]) if q["due"] else "-"} for q in report["queues"]]
    columns = [("queue", "QUEUE"), ("depth", "DEPTH"), ("due", "DUE"), ("oldest", "OLDEST"), ("consumers", "CONSUMERS")]
    lines = [_table(rows, columns), ""]
    backlog = report["outbox_backlog"]
    lines.append(f"outbox backlog: {backlog['job']} jobs, {backlog['webhook_delivery']} webhook deliveries")
    lines.append("workers:" if report["workers"] else "workers: none seen")
    for worker in report["workers"]:
        ping = {True: "answers ping", False: "no ping answer", None: "ping n/a"}[worker["ping"]]
        heartbeat = _age(worker["heartbeat_age_seconds"])
        lines.append(
            f"  {worker['name']}  {'alive' if worker['alive'] else 'MISSING'}  {ping}"
            f"  heartbeat {heartbeat + ' ago' if heartbeat else 'none'}"
        )
    for name, label in (("beat", "beat"), ("relay", "outbox relay")):
        age = _age(report[name]["heartbeat_age_seconds"])
        state = "alive" if report[name]["alive"] else "MISSING"
        lines.append(f"{label}: {state}, last heartbeat {age + ' ago' if age else 'never'}")
    for source, error in report["errors"].items():
        lines.append(f"error reading {source}: {error}")
    if missing:
        lines.append(f"missing: {', '.join(missing)}")
    print("\n".join(lines), flush=True)
    return failed


def _keys_status(args: argparse.Namespace) -> int:
    from domain.keys import service
    from storage.crypto import KeyUnavailable
    from storage.db import session_scope

    try:
        with session_scope() as session:
            report = service.tenant_status(session, uuid.UUID(args.tenant)) if args.tenant else service.status(session)
    except (LookupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
    elif args.tenant:
        print(f"tenant {report['tenant_id']}: active version {report['active_version']}")
        for version in report["versions"]:
            print(f"  v{version['version']}  {version['state']:<9}  {version['values']} values")
        rotation = report["rotation"]
        if rotation:
            print(
                f"  rotation to v{rotation['version']}: {rotation['status']}, {rotation['done']} of "
                f"{rotation['total']} values"
            )
    else:
        print(
            f"wrapping: {report['wrapping']} ({report['wrapped_by']}); key check: {report['key_check']}; "
            f"wrapped keys under a previous key: {report['data_keys_under_previous']}"
        )
    return 0 if report.get("key_check", "ok") == "ok" else 1


def _keys_rewrap(args: argparse.Namespace) -> int:
    from domain.keys import service
    from storage.db import session_scope

    if not _keys_open():
        return 1
    with session_scope() as session:
        left = service.under_previous(session)
        job_id = service.start_rewrap(session)
    print(f"rewrap started (job {job_id}): {left} wrapped keys to move under the current key", flush=True)
    if not args.wait:
        return 0
    while True:
        with session_scope() as session:
            report = service.status(session)
            settled = (
                report["data_keys_under_previous"] == 0 and session.exec(service.rewrap_settled(job_id)).first() is None
            )
        print(f"  {report['data_keys_under_previous']} left", flush=True)
        if settled:
            print("rewrap completed: every wrapped key and the key check are under the current key", flush=True)
            return 0
        time.sleep(1.0)


def _keys_rotate(args: argparse.Namespace) -> int:
    from domain.keys import service
    from storage.db import session_scope

    if not _keys_open():
        return 1
    if bool(args.all) == bool(args.tenant):
        print("error: give --tenant TENANT_ID or --all", file=sys.stderr)
        return 2
    rotations = []
    try:
        with session_scope() as session:
            tenants = service.tenants_with_keys(session) if args.all else [uuid.UUID(args.tenant)]
        for tenant_id in tenants:
            with session_scope() as session:
                rotation = service.start_rotation(session, tenant_id)
                rotations.append((tenant_id, rotation.version, rotation.total))
    except (LookupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for tenant_id, version, total in rotations:
        print(f"tenant {tenant_id}: data key version {version} active; re-encrypting {total} values", flush=True)
    if not args.wait:
        return 0
    pending = {tenant_id for tenant_id, _, _ in rotations}
    while pending:
        time.sleep(1.0)
        for tenant_id in sorted(pending):
            with session_scope() as session:
                rotation = service.tenant_status(session, tenant_id)["rotation"]
            print(f"  tenant {tenant_id}: {rotation['done']} of {rotation['total']} ({rotation['status']})", flush=True)
            if rotation["status"] == service.COMPLETED:
                pending.discard(tenant_id)
    print("rotation completed: the retiring versions are destroyed", flush=True)
    return 0


def _dev(_args: argparse.Namespace) -> int:
    from tessera.dev import run_dev

    return run_dev()


_SETTINGS_TEXT = (
    "Settings come from TESSERA_* environment variables, or from a .env file in the working folder "
    "for those the environment does not set (config/settings.py)."
)
_WORKER_TEXT = f"""Options not listed here pass through to `celery worker` (for example --concurrency N,
-n NAME, -Q QUEUES, --loglevel DEBUG; see `celery worker --help`). Without -Q this process runs every
queue but `providers` and `reactors` on a prefork pool and starts a child on threads for each of
those two (-X reactors leaves customer code to a worker of its own).

Settings that matter: TESSERA_BROKER_URL (default: SQLite in TESSERA_DATA_DIR), TESSERA_DATABASE_URL,
TESSERA_REDIS_URL, TESSERA_WORKER_CONCURRENCY (prefork processes), TESSERA_PROVIDER_CONCURRENCY
(provider threads, default 16), TESSERA_REACTOR_SLOTS (reactor runs a lone tenant may hold; twice as
many threads), TESSERA_REACTOR_EGRESS_ALLOW, TESSERA_MASTER_KEY (checked against the database at start),
TESSERA_TASK_TIME_LIMIT_SECONDS, TESSERA_LOG_LEVEL, TESSERA_LOG_FORMAT.
{_SETTINGS_TEXT}"""
_BEAT_TEXT = f"""Options not listed here pass through to `celery beat` (see `celery beat --help`); the
schedule file is TESSERA_DATA_DIR/celerybeat-schedule. Run one beat per deployment.

Settings that matter: TESSERA_BROKER_URL, TESSERA_DATABASE_URL, TESSERA_DATA_DIR,
TESSERA_OUTBOX_RELAY_AFTER_SECONDS (how soon unsent work is sent again), TESSERA_LOG_LEVEL.
{_SETTINGS_TEXT}"""
_FLOWER_TEXT = f"""Options not listed here pass through to Flower (for example --url_prefix=flower,
--persistent=True; see `celery flower --help`).

Settings that matter: TESSERA_FLOWER_PASSWORD (required) and TESSERA_FLOWER_USER (default tessera) for
its basic auth, TESSERA_BROKER_URL (a Redis broker: the embedded SQLite broker carries no task events).
{_SETTINGS_TEXT}"""


def _group(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction:
    """Subcommands of ``parser``; the group without one prints its help (the subcommands) and exits 2."""
    parser.set_defaults(func=_usage(parser))
    return parser.add_subparsers(dest=dest, title="commands", metavar="COMMAND")


def _usage(parser: argparse.ArgumentParser):
    def run(_args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tessera`` command."""
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera tokenization platform. " + _SETTINGS_TEXT)
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    commands = _group(parser, "command")

    commands.add_parser("dev", help="run everything locally (embedded defaults unless configured)").set_defaults(
        func=_dev
    )
    api = commands.add_parser("api", help="run the HTTP API")
    api.add_argument("--host", help="address to listen on (default: TESSERA_API_HOST, 127.0.0.1)")
    api.add_argument("--port", type=int, help="port to listen on (default: TESSERA_API_PORT, 8080)")
    api.add_argument(
        "--workers", type=int, help="api processes sharing the port (default: TESSERA_API_WORKERS, else one per core)"
    )
    api.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers N
    api.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a socket bound by tessera dev
    api.set_defaults(func=_api)
    raw = argparse.RawDescriptionHelpFormatter
    worker = commands.add_parser(
        "worker",
        help="run a Celery worker (extra options go to celery worker)",
        description="Run the platform's Celery worker.",
        epilog=_WORKER_TEXT,
        formatter_class=raw,
    )
    worker.set_defaults(func=_worker)
    beat = commands.add_parser(
        "beat",
        help="run Celery beat (sweeps and the outbox relay)",
        description="Run Celery beat: the sweeps and the outbox relay.",
        epilog=_BEAT_TEXT,
        formatter_class=raw,
    )
    beat.set_defaults(func=_beat)
    commands.add_parser("migrate", help="apply the database migrations").set_defaults(func=_migrate, reads_state=True)
    sandbox = commands.add_parser("sandbox", help="run the sandbox providers")
    sandbox.add_argument("--host", help="address to listen on (default: the host of TESSERA_SANDBOX_URL)")
    sandbox.add_argument("--port", type=int, help="port to listen on (default: the port of TESSERA_SANDBOX_URL)")
    sandbox.set_defaults(func=_sandbox)

    tenants = _group(commands.add_parser("tenants", help="manage tenants"), "tenants_command")
    create = tenants.add_parser("create", help="create a tenant with a management application")
    create.add_argument("--name", required=True, help="the tenant's name")
    create.add_argument("--owner-email", required=True, help="the owner's email address")
    create.add_argument(
        "--type",
        choices=("test", "production"),
        default="test",
        help="test (sandbox providers, the default) or production (live providers)",
    )
    create.add_argument("--json", action="store_true", help="print one JSON object")
    create.set_defaults(func=_tenants_create, reads_state=True)
    tenant_list = tenants.add_parser("list", help="the live tenants, newest first")
    tenant_list.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    tenant_list.add_argument("--json", action="store_true", help="print a JSON array")
    tenant_list.set_defaults(func=_tenants_list, reads_state=True)

    flower = commands.add_parser(
        "flower",
        help="run Flower on the platform's Celery app (basic auth: TESSERA_FLOWER_USER/PASSWORD)",
        description="Run Flower, Celery's monitor, on the platform's Celery app.",
        epilog=_FLOWER_TEXT,
        formatter_class=raw,
    )
    flower.add_argument("--address", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    flower.add_argument("--port", type=int, default=5555, help="port to listen on (default 5555)")
    flower.set_defaults(func=_flower)

    jobs = _group(
        commands.add_parser("jobs", help="inspect, retry and cancel jobs and webhook deliveries"), "jobs_command"
    )
    listing = jobs.add_parser("list", help="jobs, most recently changed first (webhooks.deliver: deliveries)")
    states = ("queued", "running", "succeeded", "failed", "dead", "cancelled", "pending")
    listing.add_argument(
        "--state",
        action="append",
        choices=states,
        metavar="STATE",
        help="queued, running, succeeded, failed, dead, cancelled (deliveries: pending, "
        "succeeded, failed, cancelled); repeat for several",
    )
    listing.add_argument("--kind", help="the task name, e.g. network_tokens.provision or webhooks.deliver")
    listing.add_argument("--tenant", help="only this tenant's")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    listing.add_argument("--json", action="store_true", help="print a JSON array")
    listing.set_defaults(func=_jobs_list, reads_state=True)
    for operation, text in (
        ("show", "one job with its attempts and last error (a delivery with its attempt log)"),
        ("retry", "replay a dead, failed or cancelled job, or a failed webhook delivery"),
        ("cancel", "cancel a queued job or a pending webhook delivery that no worker holds"),
    ):
        one = jobs.add_parser(operation, help=text)
        one.add_argument("id", help="a job id or a webhook delivery id (msg_... accepted)")
        one.add_argument("--json", action="store_true", help="print one JSON object")
        one.set_defaults(func=_jobs_one(operation), reads_state=True)

    keys = _group(commands.add_parser("keys", help="key status, rotation and rewrap"), "keys_command")
    key_status = keys.add_parser(
        "status",
        help="the wrapping key, the key check and keys under a previous key; "
        "with --tenant, a tenant's data key versions and rotation",
    )
    key_status.add_argument("--tenant", help="a tenant id: its versions, their values and its rotation")
    key_status.add_argument("--json", action="store_true", help="print one JSON object")
    key_status.set_defaults(func=_keys_status, reads_state=True)
    rewrap = keys.add_parser(
        "rewrap",
        help="move every wrapped key under TESSERA_MASTER_KEY (or TESSERA_KMS_KEY_ID) "
        "as a job; the _PREVIOUS keys open the others meanwhile",
    )
    rewrap.add_argument("--wait", action="store_true", help="wait for the end, printing progress")
    rewrap.set_defaults(func=_keys_rewrap, reads_state=True)
    rotate = keys.add_parser(
        "rotate",
        help="make a tenant's next data key version and re-encrypt every value "
        "sealed under older ones as a job; then destroy them",
    )
    rotate.add_argument("--tenant", help="the tenant id")
    rotate.add_argument("--all", action="store_true", help="every tenant")
    rotate.add_argument("--wait", action="store_true", help="wait for the end, printing progress")
    rotate.set_defaults(func=_keys_rotate, reads_state=True)

    queues = commands.add_parser("queues", help="queue depth, oldest waiting work, consumers, workers and beat")
    queues.add_argument("--json", action="store_true", help="print one JSON object")
    queues.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for workers to answer")
    queues.set_defaults(func=_queues, reads_state=True)

    alive = commands.add_parser(
        "alive", help="exit 0 when this host's worker or beat heartbeats are alive (a container healthcheck)"
    )
    alive.add_argument("role", choices=("worker", "beat"), help="worker (every node of this host) or beat")
    alive.set_defaults(func=_alive)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tessera`` command. Output cut short by its reader (``tessera jobs list |
    head``) ends quietly."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func not in (_worker, _beat, _flower):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.celery_args = extra
    if getattr(args, "reads_state", False):
        print(f"tessera: {get_settings().services_line()}", file=sys.stderr, flush=True)
    try:
        return args.func(args) or 0
    except BrokenPipeError:
        # the reader left: send what is still buffered nowhere, so the exit does not complain either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
