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
import os
import sys

from config import __version__
from config.settings import get_settings

try:  # a refused setting stops every command in one line, before the modules below read the settings
    get_settings()
except ValueError as exc:  # pydantic's ValidationError is one too
    sys.exit(f"tessera: {exc}")

from tessera.cli import operations, processes, state

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
        func=processes.dev
    )
    api = commands.add_parser("api", help="run the HTTP API")
    api.add_argument("--host", help="address to listen on (default: TESSERA_API_HOST, 127.0.0.1)")
    api.add_argument("--port", type=int, help="port to listen on (default: TESSERA_API_PORT, 8080)")
    api.add_argument(
        "--workers", type=int, help="api processes sharing the port (default: TESSERA_API_WORKERS, else one per core)"
    )
    api.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # one of --workers N
    api.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a socket bound by tessera dev
    api.set_defaults(func=processes.api)
    raw = argparse.RawDescriptionHelpFormatter
    worker = commands.add_parser(
        "worker",
        help="run a Celery worker (extra options go to celery worker)",
        description="Run the platform's Celery worker.",
        epilog=_WORKER_TEXT,
        formatter_class=raw,
    )
    worker.set_defaults(func=processes.worker)
    beat = commands.add_parser(
        "beat",
        help="run Celery beat (sweeps and the outbox relay)",
        description="Run Celery beat: the sweeps and the outbox relay.",
        epilog=_BEAT_TEXT,
        formatter_class=raw,
    )
    beat.set_defaults(func=processes.beat)
    commands.add_parser("migrate", help="apply the database migrations").set_defaults(
        func=state.migrate, reads_state=True
    )
    sandbox = commands.add_parser("sandbox", help="run the sandbox providers")
    sandbox.add_argument("--host", help="address to listen on (default: the host of TESSERA_SANDBOX_URL)")
    sandbox.add_argument("--port", type=int, help="port to listen on (default: the port of TESSERA_SANDBOX_URL)")
    sandbox.set_defaults(func=processes.sandbox)

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
    create.set_defaults(func=state.tenants_create, reads_state=True)
    tenant_list = tenants.add_parser("list", help="the live tenants, newest first")
    tenant_list.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    tenant_list.add_argument("--json", action="store_true", help="print a JSON array")
    tenant_list.set_defaults(func=state.tenants_list, reads_state=True)

    flower = commands.add_parser(
        "flower",
        help="run Flower on the platform's Celery app (basic auth: TESSERA_FLOWER_USER/PASSWORD)",
        description="Run Flower, Celery's monitor, on the platform's Celery app.",
        epilog=_FLOWER_TEXT,
        formatter_class=raw,
    )
    flower.add_argument("--address", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    flower.add_argument("--port", type=int, default=5555, help="port to listen on (default 5555)")
    flower.set_defaults(func=processes.flower)

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
    listing.set_defaults(func=operations.jobs_list, reads_state=True)
    for operation, text in (
        ("show", "one job with its attempts and last error (a delivery with its attempt log)"),
        ("retry", "replay a dead, failed or cancelled job, or a failed webhook delivery"),
        ("cancel", "cancel a queued job or a pending webhook delivery that no worker holds"),
    ):
        one = jobs.add_parser(operation, help=text)
        one.add_argument("id", help="a job id or a webhook delivery id (msg_... accepted)")
        one.add_argument("--json", action="store_true", help="print one JSON object")
        one.set_defaults(func=operations.jobs_one(operation), reads_state=True)

    keys = _group(commands.add_parser("keys", help="key status, rotation and rewrap"), "keys_command")
    key_status = keys.add_parser(
        "status",
        help="the wrapping key, the key check and keys under a previous key; "
        "with --tenant, a tenant's data key versions and rotation",
    )
    key_status.add_argument("--tenant", help="a tenant id: its versions, their values and its rotation")
    key_status.add_argument("--json", action="store_true", help="print one JSON object")
    key_status.set_defaults(func=operations.keys_status, reads_state=True)
    rewrap = keys.add_parser(
        "rewrap",
        help="move every wrapped key under TESSERA_MASTER_KEY (or TESSERA_KMS_KEY_ID) "
        "as a job; the _PREVIOUS keys open the others meanwhile",
    )
    rewrap.add_argument("--wait", action="store_true", help="wait for the end, printing progress")
    rewrap.set_defaults(func=operations.keys_rewrap, reads_state=True)
    rotate = keys.add_parser(
        "rotate",
        help="make a tenant's next data key version and re-encrypt every value "
        "sealed under older ones as a job; then destroy them",
    )
    rotate.add_argument("--tenant", help="the tenant id")
    rotate.add_argument("--all", action="store_true", help="every tenant")
    rotate.add_argument("--wait", action="store_true", help="wait for the end, printing progress")
    rotate.set_defaults(func=operations.keys_rotate, reads_state=True)

    queues = commands.add_parser("queues", help="queue depth, oldest waiting work, consumers, workers and beat")
    queues.add_argument("--json", action="store_true", help="print one JSON object")
    queues.add_argument("--timeout", type=float, default=1.0, help="seconds to wait for workers to answer")
    queues.set_defaults(func=operations.queues, reads_state=True)

    alive = commands.add_parser(
        "alive", help="exit 0 when this host's worker or beat heartbeats are alive (a container healthcheck)"
    )
    alive.add_argument("role", choices=("worker", "beat"), help="worker (every node of this host) or beat")
    alive.set_defaults(func=operations.alive)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tessera`` command. Output cut short by its reader (``tessera jobs list |
    head``) ends quietly."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.func not in (processes.worker, processes.beat, processes.flower):
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
