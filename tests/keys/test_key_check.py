"""The key check (``storage/key_check.py``) on the real test database: a process whose master key does
not open the database's keys refuses to start with one line naming the setting, ``/readyz`` fails,
a shared database never gets a key file of its own, and a previous key is accepted during a rotation."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import delete

from config.settings import Settings
from storage import key_check
from storage.crypto import Keyring, MasterKeyMissing, load_master_key
from storage.db import session_scope
from storage.key_check import KeyCheckFailed, verify
from storage.models import KeyCheck

TESSERA = [sys.executable, "-m", "tessera.cli"]


def _key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


def _settings(**overrides) -> Settings:
    return Settings(**overrides)


def test_the_running_key_passes_and_a_wrong_key_is_refused(database):
    with session_scope() as session:
        assert verify(session) == "ok"
        with pytest.raises(KeyCheckFailed, match="TESSERA_MASTER_KEY does not open this database's keys"):
            verify(session, Keyring(_settings(master_key=_key())))


def test_a_database_without_its_check_is_not_claimed_by_a_key_that_opens_none_of_its_keys(database, tenant):
    """The check row gone (or never written by a process that sealed data): a wrong key refuses instead of
    recording itself as the database's key; the right key records the check again."""
    with session_scope() as session:
        assert verify(session) == "ok"
    with session_scope() as session:
        session.execute(delete(KeyCheck))
    try:
        with session_scope() as session, pytest.raises(KeyCheckFailed, match="does not open the data keys already"):
            verify(session, Keyring(_settings(master_key=_key())))
        with session_scope() as session:
            assert session.get(KeyCheck, 1) is None  # nothing recorded by the wrong key
    finally:
        with session_scope() as session:
            assert verify(session) == "ok"


def test_the_previous_key_is_accepted_while_the_new_one_is_current(database):
    current = os.environ["TESSERA_MASTER_KEY"]
    rotated = Keyring(_settings(master_key=_key(), master_key_previous=current))
    with session_scope() as session:
        assert verify(session, rotated) == "ok"


def test_a_process_with_a_wrong_key_refuses_to_start_with_one_line(database):
    env = {**os.environ, "TESSERA_MASTER_KEY": _key(), "TESSERA_LOG_LEVEL": "WARNING"}
    for command in (["worker", "--concurrency", "1"], ["beat"], ["api", "--workers", "1", "--port", "1"]):
        done = subprocess.run([*TESSERA, *command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "TESSERA_MASTER_KEY" in lines[0] and "refusing to start" in lines[0], lines


def test_a_shared_database_never_makes_a_key_file(tmp_path, database):
    settings = _settings(data_dir=tmp_path, master_key=None)
    with pytest.raises(MasterKeyMissing, match="TESSERA_MASTER_KEY is not set"):
        load_master_key(settings)
    assert not (tmp_path / "master.key").exists()
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_MASTER_KEY"}
    env["TESSERA_DATA_DIR"] = str(tmp_path)
    done = subprocess.run([*TESSERA, "worker"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "TESSERA_MASTER_KEY is not set" in done.stderr, done.stderr
    assert not (tmp_path / "master.key").exists()


def test_readyz_fails_when_the_key_does_not_open_the_database(api, monkeypatch):
    wrong = Keyring(_settings(master_key=_key()))
    monkeypatch.setattr(key_check, "get_keyring", lambda: wrong)
    answer = api.client().get("/readyz")
    assert answer.status == 503, answer
    assert "keys" in answer.json["failed"] and answer.json["checks"]["keys"]["error"] == "KeyCheckFailed"


def test_keys_status_prints_the_contract(database):
    done = subprocess.run([*TESSERA, "keys", "status", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["wrapping"] == "master" and report["key_check"] == "ok"
    assert isinstance(report["data_keys_under_previous"], int)
    wrong = subprocess.run(
        [*TESSERA, "keys", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TESSERA_MASTER_KEY": _key()},
    )
    assert wrong.returncode == 1 and json.loads(wrong.stdout)["key_check"] == "mismatch"
