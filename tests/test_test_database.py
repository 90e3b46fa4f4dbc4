"""``make test`` on other machines: the database ``TESSERA_TEST_DATABASE_URL`` names is never dropped
(the run works in a fresh one beside it), and ``scripts/services.sh`` checks the services the
``TESSERA_TEST_*`` URLs name instead of setting up local ones."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests import conftest
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_a_given_database_is_kept_and_the_run_works_beside_it(database, monkeypatch):
    kept = make_url(database).set(database=f"tessera_keep_{uuid.uuid4().hex[:8]}")
    admin = create_engine(make_url(database).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{kept.database}"'))
    try:
        with create_engine(kept).begin() as conn:
            conn.execute(text("CREATE TABLE precious (id int)"))
        monkeypatch.setenv("TESSERA_TEST_DATABASE_URL", kept.render_as_string(hide_password=False))
        run_url = make_url(conftest._test_database_url())
        assert run_url.database == f"{kept.database}_{conftest.RUN_ID}"
        assert (run_url.host, run_url.port, run_url.username) == (kept.host, kept.port, kept.username)
        conftest._recreate_database(str(run_url.render_as_string(hide_password=False)))
        conftest._drop_database(str(run_url.render_as_string(hide_password=False)))
        with create_engine(kept).connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM precious")).scalar() == 0
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{kept.database}" WITH (FORCE)'))
        admin.dispose()


def _services(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/services.sh"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_services_sh_checks_the_given_urls_and_touches_nothing_local(database):
    done = _services({"TESSERA_TEST_DATABASE_URL": database, "TESSERA_TEST_REDIS_URL": conftest.TEST_REDIS_URL})
    assert done.returncode == 0, done.stderr
    assert "TESSERA_TEST_DATABASE_URL answers" in done.stdout and "TESSERA_TEST_REDIS_URL answers" in done.stdout


def test_services_sh_names_a_given_url_that_does_not_answer_in_one_line():
    url = f"postgresql+psycopg2://tessera:s3cret@127.0.0.1:{free_port()}/tessera"
    done = _services({"TESSERA_TEST_DATABASE_URL": url, "TESSERA_TEST_REDIS_URL": conftest.TEST_REDIS_URL})
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("services: TESSERA_TEST_DATABASE_URL does not answer") and "s3cret" not in line, line
