"""Secrets from files: each of ``config.settings.FILE_SETTINGS`` is read from the file
``TESSERA_<NAME>_FILE`` names (Docker secrets), its trailing newline dropped."""

from __future__ import annotations

import pytest

from config.settings import FILE_SETTINGS, Settings, file_variable


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ./.env
    for name in FILE_SETTINGS:
        monkeypatch.delenv(f"TESSERA_{name.upper()}", raising=False)
        monkeypatch.delenv(file_variable(name), raising=False)
    return monkeypatch


def test_every_file_setting_is_a_setting():
    assert set(FILE_SETTINGS) <= set(Settings.model_fields)
    assert {"master_key", "master_key_previous", "flower_password", "database_url", "broker_url", "redis_url"} <= set(
        FILE_SETTINGS
    )


def test_each_secret_is_read_from_its_file(clean_env, tmp_path):
    values = {
        "master_key": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        "master_key_previous": "HwAeHR4fAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBk=",
        "flower_password": "s3cret-flower",
        "database_url": "postgresql+psycopg2://tessera:pw@postgres:5432/tessera",
        "broker_url": "redis://:pw@redis:6379/0",
        "redis_url": "redis://:pw@redis:6379/1",
        "smtp_url": "smtp://user:pw@mail:587?starttls=true",
    }
    for name, value in values.items():
        path = tmp_path / name
        path.write_text(value + "\n")  # as `echo` or a shell redirect writes it
        clean_env.setenv(file_variable(name), str(path))
    settings = Settings()
    for name, value in values.items():
        read = getattr(settings, name)
        assert (read.get_secret_value() if hasattr(read, "get_secret_value") else read) == value, name


def test_the_environment_and_the_file_together_are_refused(clean_env, tmp_path):
    (tmp_path / "key").write_text("x")
    clean_env.setenv("TESSERA_MASTER_KEY", "y")
    clean_env.setenv("TESSERA_MASTER_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(ValueError, match="TESSERA_MASTER_KEY and TESSERA_MASTER_KEY_FILE"):
        Settings()


def test_a_missing_file_is_named(clean_env, tmp_path):
    clean_env.setenv("TESSERA_FLOWER_PASSWORD_FILE", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="TESSERA_FLOWER_PASSWORD_FILE: cannot read"):
        Settings()


def test_the_file_wins_over_dotenv_and_the_environment_over_both(clean_env, tmp_path):
    (tmp_path / ".env").write_text("TESSERA_BROKER_URL=redis://dotenv/0\nTESSERA_REDIS_URL=redis://dotenv/1\n")
    (tmp_path / "broker").write_text("redis://file/0")
    clean_env.setenv("TESSERA_BROKER_URL_FILE", str(tmp_path / "broker"))
    settings = Settings()
    assert settings.broker_url == "redis://file/0" and settings.redis_url == "redis://dotenv/1"
