"""``GET /healthz`` and ``GET /readyz``, and the heartbeats behind worker and beat liveness."""

from __future__ import annotations

import time

from config.settings import get_settings
from infra import ops
from tests.conftest import RunningApi, free_port, serve_in_thread


def test_healthz_answers_without_a_key(api):
    answer = api.client().get("/healthz")
    assert answer.status == 200
    assert answer.json == {"status": "ok"}


def test_readyz_checks_database_keys_broker_and_s3(api):
    answer = api.client().get("/readyz")
    assert answer.status == 200, answer
    body = answer.json
    assert body["status"] == "ready" and body["failed"] == []
    assert set(body["checks"]) == {"database", "keys", "broker", "s3"}
    assert all(check["ok"] and check["ms"] >= 0 for check in body["checks"].values())
    assert "workers" in body and "beat" in body


def test_readyz_answers_503_naming_what_failed(database, s3_server):
    from app.main import init_app

    closed = free_port()
    broken = get_settings().model_copy(
        update={"broker_url": f"redis://127.0.0.1:{closed}/0", "s3_endpoint_url": f"http://127.0.0.1:{closed}"}
    )
    port = free_port()
    stop = serve_in_thread(lambda: init_app(broken), port)
    try:
        answer = RunningApi(f"http://127.0.0.1:{port}").client().get("/readyz")
    finally:
        stop()
    assert answer.status == 503, answer
    body = answer.json
    assert body["status"] == "unavailable"
    assert body["failed"] == ["broker", "s3"]
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["broker"]["ok"] is False and body["checks"]["broker"]["error"]
    assert body["checks"]["s3"]["ok"] is False


def test_heartbeats_in_redis_say_who_is_alive(redis_flushed):
    settings = get_settings()
    ops.record_heartbeat(settings, "worker:ops-probe@host")
    ops.record_heartbeat(settings, "beat", every=1.0)
    try:
        beats = ops.heartbeats(settings)
        worker = beats["worker:ops-probe@host"]
        assert worker.kind == "worker" and worker.alive() and worker.age() < 5
        assert beats["beat"].kind == "beat"
        assert not beats["beat"].alive(time.time() + 10)  # three periods without a heartbeat: gone
        key = f"{settings.redis_key_prefix}tessera:heartbeat:beat"
        assert 0 < redis_flushed.ttl(key) <= 60
    finally:
        ops.forget_heartbeat(settings, "worker:ops-probe@host")
        ops.forget_heartbeat(settings, "beat")
    assert "worker:ops-probe@host" not in ops.heartbeats(settings)


def test_heartbeats_without_redis_are_files_in_the_data_dir(tmp_path):
    settings = get_settings().model_copy(update={"data_dir": tmp_path, "redis_url": None, "broker_url": None})
    ops.record_heartbeat(settings, "relay")
    assert (tmp_path / "heartbeats" / "relay.json").is_file()
    assert ops.heartbeats(settings)["relay"].alive()
    ops.forget_heartbeat(settings, "relay")
    assert ops.heartbeats(settings) == {}
