"""``tessera alive worker|beat``: a container's liveness from this host's heartbeats."""

from __future__ import annotations

import socket
import time

import pytest

from config.settings import reload_settings
from infra import ops
from tessera.cli import main


@pytest.fixture
def settings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ./.env
    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path))  # heartbeats as files: no Redis configured
    for variable in ("TESSERA_REDIS_URL", "TESSERA_BROKER_URL"):
        monkeypatch.delenv(variable, raising=False)
    yield reload_settings()
    monkeypatch.undo()  # the environment back first: the settings reloaded below are the run's again
    reload_settings()


def _write(settings, name: str, *, age: float = 0.0, host: str | None = None) -> None:
    ops.record_heartbeat(settings, name)
    path = ops._heartbeat_file(settings, name)
    data = path.read_text().replace(f'"host": "{socket.gethostname()}"', f'"host": "{host or socket.gethostname()}"')
    path.write_text(data.replace('"at": ', f'"at": {time.time() - age}, "was": ', 1))


def test_a_worker_is_alive_when_every_heartbeat_of_its_host_is_fresh(settings, capsys):
    assert main(["alive", "worker"]) == 1
    assert "no worker heartbeat from this host" in capsys.readouterr().err
    _write(settings, "worker:celery@here")
    _write(settings, "worker:celery@elsewhere", age=3600, host="another-host")  # not this container's
    assert main(["alive", "worker"]) == 0
    _write(settings, "worker:celery-providers@here", age=3600)  # a hung child
    assert main(["alive", "worker"]) == 1
    assert "stale heartbeats: worker:celery-providers@here" in capsys.readouterr().err


def test_beat_is_alive_when_its_heartbeat_from_this_host_is_fresh(settings, capsys):
    assert main(["alive", "beat"]) == 1
    _write(settings, "beat", host="another-host")
    assert main(["alive", "beat"]) == 1
    _write(settings, "beat", age=3600)
    assert main(["alive", "beat"]) == 1 and "old" in capsys.readouterr().err
    _write(settings, "beat")
    assert main(["alive", "beat"]) == 0
