"""The platform's Redis clients and broker options from the settings (``infra/redis_clients.py``):
Sentinel URLs parsed as kombu reads them, a Sentinel URL without the master's name refused, passwords
hidden in the line every command prints first. The failover itself: ``tests/chaos/test_sentinel_failover.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from config.settings import Settings
from infra.celery import create_app
from infra.redis_clients import (
    SentinelUrl,
    broker_transport_options,
    is_redis_url,
    parse_sentinel_url,
    redis_client,
)

pytestmark = pytest.mark.unit

URL = "sentinel://:s%40cret@10.0.0.1:26380/3;sentinel://10.0.0.2;sentinel://:other@10.0.0.3:26381/5"


def test_a_sentinel_url_names_each_sentinel_and_the_first_login_and_database():
    assert parse_sentinel_url(URL) == SentinelUrl(
        sentinels=(("10.0.0.1", 26380), ("10.0.0.2", 26379), ("10.0.0.3", 26381)), db=3, password="s@cret"
    )
    assert parse_sentinel_url("sentinel://h") == SentinelUrl(sentinels=(("h", 26379),))
    with pytest.raises(ValueError, match="not a sentinel://host:port URL"):
        parse_sentinel_url("sentinel://:pw@h:1/0;redis://h:6379/0")
    assert is_redis_url(URL) and is_redis_url("redis://h/0") and not is_redis_url("amqp://h//")


@pytest.mark.parametrize("name", ["broker_url", "redis_url"])
def test_a_sentinel_url_without_the_master_name_is_refused_naming_the_setting(name):
    with pytest.raises(
        ValueError, match=f"TESSERA_{name.upper()} names Redis Sentinels.*TESSERA_REDIS_SENTINEL_MASTER"
    ):
        # whatever the environment says: the other URL plain, no master name
        Settings(**{"broker_url": "redis://h/0", "redis_url": "redis://h/1", name: URL}, redis_sentinel_master=None)


def test_every_command_refuses_to_start_in_one_line_naming_the_setting(tmp_path):
    env = {**os.environ, "TESSERA_BROKER_URL": URL, "TESSERA_REDIS_SENTINEL_MASTER": ""}
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "api"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "tessera: TESSERA_BROKER_URL names Redis Sentinels (sentinel://): set TESSERA_REDIS_SENTINEL_MASTER to the "
        "name they monitor the master by"
    ]


def test_the_broker_gets_the_master_name_and_the_sentinels_password():
    settings = Settings(broker_url=URL, redis_sentinel_master="main", redis_sentinel_password="sentinel-pw")
    assert broker_transport_options(settings) == {"master_name": "main", "sentinel_kwargs": {"password": "sentinel-pw"}}
    options = create_app(settings).conf.broker_transport_options
    assert options["master_name"] == "main" and options["global_keyprefix"] == settings.redis_key_prefix
    assert broker_transport_options(Settings(broker_url="redis://h/0")) == {}
    # an empty password (the compose secret file's) means the sentinels ask for none
    assert (
        Settings(broker_url=URL, redis_sentinel_master="m", redis_sentinel_password="").redis_sentinel_password is None
    )


def test_passwords_of_every_sentinel_url_are_hidden():
    line = Settings(broker_url=URL, redis_sentinel_master="main").services_line()
    assert "s%40cret" not in line and "other" not in line and line.count(":***@") == 2


def test_a_sentinel_client_reaches_the_master_the_sentinels_name():
    settings = Settings(redis_url=URL, redis_sentinel_master="main", redis_sentinel_password="sentinel-pw")
    client = redis_client(settings, socket_timeout=0.5)
    pool = client.connection_pool
    assert pool.service_name == "main" and pool.connection_kwargs["password"] == "s@cret"
    assert pool.connection_kwargs["db"] == 3
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert sentinel["password"] == "sentinel-pw" and sentinel["host"] == "10.0.0.1"
    assert isinstance(redis_client(Settings(redis_url="redis://127.0.0.1:1/0")), redis.Redis)
