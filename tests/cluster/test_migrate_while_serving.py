"""The newest migration runs while the previous release serves, as an upgrade of several hosts does it
(README, Upgrading): ``tessera migrate`` of the new code once, while the old roles keep serving, which
are then restarted one host at a time.

The previous release (``tests/storage/migration_rule.py``: the code of the commit before the one that
added the newest migration file) is exported from git into a folder of its own; its ``tessera api``,
``worker`` and ``beat`` run from there (its ``PYTHONPATH`` and working directory: the api's and the
worker's ``python -m`` children import from the working directory first; the same virtual environment)
on a fresh database migrated to the newest migration's ``down_revision``. Under a steady load of
tokenize, token reads and network-token creates, the new code's ``tessera migrate`` brings the database
to head. No request fails, every job ends, the database is at head with its indexes valid; the new
code's api then serves on the same database beside the old roles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from storage import migrate
from tests.chaos.platform import CHAOS_ENV
from tests.cluster.conftest import card
from tests.conftest import _drop_database, free_port
from tests.conftest import serve_in_thread as serve
from tests.factories.load import Load
from tests.helpers import ApiClient, wait_until
from tests.network_tokens.test_network_token_kill import Processes, own_platform
from tests.storage.migration_rule import ROOT, export_tree, git_missing, previous_release

pytestmark = [pytest.mark.kill, pytest.mark.timeout(300)]

RATE = 30.0  # requests per second, all clients together
BEFORE, AFTER = 3.0, 3.0  # seconds of load before the migration starts and after it ended


def _sql(database_url: str, query: str) -> list[dict]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [dict(row) for row in conn.execute(text(query)).mappings()]
    finally:
        engine.dispose()


def _serving(api_url: str) -> bool:
    try:
        return ApiClient(api_url).get("/status").status == 200
    except Exception:
        return False


def _imported_from(processes: Processes) -> Path:
    """The folder ``processes`` and the ``python -m`` children they start import the platform from (the
    working directory first, then ``PYTHONPATH``)."""
    where = subprocess.run(
        [sys.executable, "-c", "import storage; print(storage.__file__)"],
        env=processes.env,
        cwd=processes.cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(where.stdout.strip()).parents[1]


def _settle(database_url: str, timeout: float) -> None:
    """Wait until no job is queued or running (AssertionError naming some when they still are)."""
    unfinished = "SELECT kind, status, attempts, last_error FROM jobs WHERE status IN ('queued', 'running')"
    deadline = time.monotonic() + timeout
    while (left := _sql(database_url, unfinished)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{len(left)} jobs unfinished after {timeout} s, e.g. {left[:5]}"


@pytest.fixture
def previous(tmp_path) -> tuple[str, Path]:
    """``(commit, folder)`` of the previous release of the newest migration, exported from git."""
    if reason := git_missing():
        pytest.skip(f"the previous release is taken from git: {reason}")
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    newest = script.get_revision(script.get_current_head())
    assert newest is not None and newest.path
    commit = previous_release(Path(newest.path))
    return commit, export_tree(commit, tmp_path / "previous")


def test_the_newest_migration_runs_while_the_previous_release_serves(previous, redis_flushed, s3_server):
    from sandbox.app import make_app

    commit, tree = previous
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    head = script.get_revision(script.get_current_head())
    assert head is not None and isinstance(head.down_revision, str)
    sandbox_port, api_port, new_api_port = free_port(), free_port(), free_port()
    stop_sandbox = serve(lambda: make_app(), sandbox_port)
    database_url, work_dir, env = own_platform(
        f"expand{os.urandom(2).hex()}",
        f"http://127.0.0.1:{sandbox_port}",
        api_port,
        dict(CHAOS_ENV),
        revision=head.down_revision,
    )
    old = Processes(work_dir, {**env, "PYTHONPATH": str(tree)}, cwd=tree)
    new = Processes(work_dir, {**env, "PYTHONPATH": str(ROOT), "TESSERA_API_PORT": str(new_api_port)}, cwd=ROOT)
    api_url, new_api_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{new_api_port}"
    try:
        assert _imported_from(old) == tree and _imported_from(new) == ROOT
        assert _sql(database_url, "SELECT version_num FROM alembic_version") == [{"version_num": head.down_revision}]
        old.start("api", "api")
        old.start("worker", "worker", "--concurrency", "2", "--hostname", "old@%h")
        old.start("beat", "beat")
        tenant = json.loads(
            old.run("tenants", "create", "--name", "expand", "--owner-email", "owner@example.com", "--json")
        )
        wait_until(lambda: _serving(api_url), timeout=60, interval=0.2)
        client = ApiClient(api_url, tenant["api_key"])
        seeds = [client.post("/tokenize", card()).json["id"] for _ in range(4)]

        load = Load(api_url, tenant["api_key"], seeds, card(), rate=RATE).start()
        try:
            time.sleep(BEFORE)
            started = time.monotonic()
            migrated = new.run("migrate")
            took = time.monotonic() - started
            time.sleep(AFTER)
        finally:
            load.stop()
        print(f"previous release {commit[:12]}; migrate took {took:.1f} s; answers {dict(load.answers)}")

        assert "database migrated to head" in migrated
        assert load.failures == [], [failure[:80] for failure in load.failures]
        assert load.answers["tokenize"] and load.answers["read"] and load.answers["network token"]
        assert sum(load.answers.values()) >= RATE * (BEFORE + AFTER) / 2  # the load ran all along
        assert _sql(database_url, "SELECT version_num FROM alembic_version") == [{"version_num": head.revision}]
        invalid = "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE NOT i.indisvalid"
        assert _sql(database_url, invalid) == []  # a CONCURRENTLY build that failed leaves an invalid index
        _settle(database_url, 60)

        # the new code serves on the same database, beside the old roles
        new.start("api-new", "api")
        wait_until(lambda: _serving(new_api_url), timeout=60, interval=0.2)
        newer = ApiClient(new_api_url, tenant["api_key"])
        assert newer.get(f"/tokens/{load.tokens[0]}").status == 200
        assert newer.post("/tokenize", card()).status == 201
        assert newer.post("/network-tokens", {"token_id": seeds[0]}).status in (201, 202)
        _settle(database_url, 60)
        ended = _sql(database_url, "SELECT status, count(*) AS jobs FROM jobs GROUP BY status ORDER BY status")
        assert {row["status"] for row in ended} <= {"succeeded"}, ended
    except BaseException:
        print(old.logs())  # both releases' processes log to the same folder
        raise
    finally:
        new.stop_all()
        old.stop_all()
        stop_sandbox()
        _drop_database(database_url)
