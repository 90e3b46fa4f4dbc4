"""The operators' ``tessera`` commands: ``jobs list|show|retry|cancel``, ``queues``, ``alive`` and
``keys status|rewrap|rotate`` (``infra/job_admin.py``, ``infra/ops.py``, ``domain/keys``)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import uuid

from config.settings import get_settings
from tessera.cli.output import print_json, short, table
from tessera.cli.processes import keys_open


def jobs_list(args: argparse.Namespace) -> int:
    from infra import job_admin
    from storage.db import session_scope

    try:
        tenant = uuid.UUID(args.tenant) if args.tenant else None
    except ValueError:
        print(f"error: '{args.tenant}' is not a tenant id", file=sys.stderr)
        return 2
    with session_scope() as session:
        rows = job_admin.list_jobs(
            session, get_settings(), states=args.state, kind=args.kind, tenant_id=tenant, limit=args.limit
        )
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no jobs match", flush=True)
        return 0
    for row in rows:
        row["tries"] = f"{row['attempts']}/{row['max_attempts']}"
        row["error"] = short(row["last_error"])
    columns = [
        ("id", "ID"),
        ("kind", "KIND"),
        ("state", "STATE"),
        ("tries", "ATTEMPTS"),
        ("updated_at", "UPDATED"),
        ("error", "LAST ERROR"),
    ]
    print(table(rows, columns), flush=True)
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
            lines += ["  " + line for line in table(log, columns).splitlines()]
        else:
            lines.append("  (none yet)")
    return "\n".join(lines)


def jobs_one(operation: str):
    def run(args: argparse.Namespace) -> int:
        from infra import job_admin
        from storage.db import session_scope

        settings = get_settings()
        try:
            with session_scope() as session:
                view = getattr(job_admin, {"show": "show_job"}.get(operation, operation))(session, settings, args.id)
        except (job_admin.NotFound, job_admin.Refused) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        if args.json:
            print_json(view)
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


def alive(args: argparse.Namespace) -> int:
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
    if args.role == "beat":  # the active beat's heartbeat, or this host's beat process's (standby or active)
        mine = [b for b in beats.values() if b.kind == "beat" and b.host == host]
        ok = any(b.alive() for b in mine)
        problem = (
            "no beat heartbeat from this host"
            if not mine
            else f"beat's last heartbeat is {min(b.age() for b in mine):.0f}s old"
        )
    else:
        mine = [b for b in beats.values() if b.kind == "worker" and b.host == host]
        stale = sorted(b.name for b in mine if not b.alive())
        ok = bool(mine) and not stale
        problem = f"stale heartbeats: {', '.join(stale)}" if stale else "no worker heartbeat from this host"
    if not ok:
        print(f"not alive: {problem}", file=sys.stderr, flush=True)
    return 0 if ok else 1


def queues(args: argparse.Namespace) -> int:
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
        print_json(report)
        return failed
    rows = [{**q, "oldest": _age(q["oldest_age_seconds"]) if q["due"] else "-"} for q in report["queues"]]
    columns = [("queue", "QUEUE"), ("depth", "DEPTH"), ("due", "DUE"), ("oldest", "OLDEST"), ("consumers", "CONSUMERS")]
    lines = [table(rows, columns), ""]
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
    for process in report["beats"]:
        age = _age(process["heartbeat_age_seconds"])
        lines.append(f"  beat on {process['host']} (pid {process['pid']}): {process['state']}, heartbeat {age} ago")
    for source, error in report["errors"].items():
        lines.append(f"error reading {source}: {error}")
    if missing:
        lines.append(f"missing: {', '.join(missing)}")
    print("\n".join(lines), flush=True)
    return failed


def keys_status(args: argparse.Namespace) -> int:
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


def keys_rewrap(args: argparse.Namespace) -> int:
    from domain.keys import service
    from storage.db import session_scope

    if not keys_open(wait_seconds=0):
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


def keys_rotate(args: argparse.Namespace) -> int:
    from domain.keys import service
    from storage.db import session_scope

    if not keys_open(wait_seconds=0):
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
                progress = service.rotation_progress(session, tenant_id)
            if progress is None:  # the tenant was deleted meanwhile: its keys and rows are gone
                print(f"  tenant {tenant_id}: deleted", flush=True)
                pending.discard(tenant_id)
                continue
            print(f"  tenant {tenant_id}: {progress['done']} of {progress['total']} ({progress['status']})", flush=True)
            if progress["status"] == service.COMPLETED:
                pending.discard(tenant_id)
    print("rotation completed: the retiring versions are destroyed", flush=True)
    return 0
