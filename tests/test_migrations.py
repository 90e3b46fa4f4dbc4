"""The SQLModel models and the Alembic migrations agree, on PostgreSQL and on the embedded SQLite."""

from __future__ import annotations

import pytest
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, inspect, text
from sqlmodel import SQLModel

import storage.models  # noqa: F401  (registers every table on SQLModel.metadata)
from storage import migrate


def _current_revision(url: str) -> str | None:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    finally:
        engine.dispose()


def _head() -> str:
    return ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_single_head():
    heads = ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_heads()
    assert len(heads) == 1, f"the migrations have several heads: {heads}"


def test_postgresql_matches_the_models(database):
    """``database`` is the session's PostgreSQL, migrated to head from nothing."""
    assert _current_revision(database) == _head()
    assert _tables(database) == set(SQLModel.metadata.tables)
    migrate.check(database)  # raises CommandError when the models and the migrations disagree


def test_sqlite_fresh_file_matches_the_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    migrate.upgrade(url)
    assert _current_revision(url) == _head()
    assert _tables(url) == set(SQLModel.metadata.tables)
    migrate.check(url)
    migrate.upgrade(url)  # a second upgrade is a no-op
    assert _current_revision(url) == _head()


def test_sqlite_downgrade_and_upgrade_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'roundtrip.db'}"
    migrate.upgrade(url)
    from alembic import command

    command.downgrade(migrate.alembic_config(url), "base")
    assert _tables(url) == set()
    migrate.upgrade(url)
    migrate.check(url)


def test_check_notices_drift(tmp_path):
    """The check is not a formality: a schema that lacks what the models declare fails it."""
    url = f"sqlite:///{tmp_path / 'drift.db'}"
    migrate.upgrade(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_audit_logs_list"))
    engine.dispose()
    with pytest.raises(CommandError):
        migrate.check(url)


def test_composite_job_subjects_are_split_into_typed_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'subjects.db'}"
    migrate.upgrade(url, "0005")
    engine = create_engine(url)
    job_id, chunk_job, delete_job = "9b1f0c52-0000-4000-8000-000000000001", "c1", "d1"
    with engine.begin() as conn:
        insert = text(
            "INSERT INTO jobs (id, kind, subject_id, status, attempts, max_attempts, due_at, created_at, "
            "updated_at) VALUES (:id, :kind, :subject, 'queued', 0, 5, '2026-01-01', '2026-01-01', "
            "'2026-01-01')"
        )
        conn.execute(insert, {"id": chunk_job, "kind": "account_updater.process_chunk", "subject": f"{job_id}:7"})
        conn.execute(insert, {"id": delete_job, "kind": "agentic.delete_payment_method", "subject": "pm_1/op_2"})
    migrate.upgrade(url)
    with engine.connect() as conn:
        rows = dict(
            (row[0], row[1:])
            for row in conn.execute(text("SELECT id, subject_type, subject_id, subject_number, operation_id FROM jobs"))
        )
    engine.dispose()
    assert rows[chunk_job] == ("account_updater_job", job_id, 7, None)
    assert rows[delete_job] == ("payment_method", "pm_1", None, "op_2")
