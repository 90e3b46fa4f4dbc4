"""The ``tessera`` commands that set up state: ``migrate`` and ``tenants create|list``."""

from __future__ import annotations

import argparse
import json
import sys

from config.settings import get_settings
from tessera.cli.output import print_json, table
from tessera.cli.processes import keys_open


def migrate(_args: argparse.Namespace) -> int:
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


def tenants_create(args: argparse.Namespace) -> int:
    from domain.tenancy.tenants import create_tenant
    from storage.db import session_scope

    if not keys_open(wait_seconds=0):
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


def tenants_list(args: argparse.Namespace) -> int:
    from domain.tenancy.tenants import list_tenants
    from storage.db import session_scope

    with session_scope() as session:
        rows = list_tenants(session, limit=args.limit)
    if args.json:
        print_json(rows)
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
        print(table(shown, columns), flush=True)
    return 0
