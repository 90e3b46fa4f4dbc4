"""Shared fixtures: real PostgreSQL and Redis, a real Celery worker, the API over real HTTP.

Each run creates and migrates its own database beside the one ``TESSERA_TEST_DATABASE_URL`` names
(``<name>_<pid>``; the named database itself is never dropped; default ``tessera_test_<pid>`` on the
local PostgreSQL) and drops it at the end; it uses Redis database 15
(``TESSERA_TEST_REDIS_URL``) under a key prefix of its own, removed at the end. Tests are isolated by
giving each its own tenant (fixture ``tenant``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

# Each run gets its own database and its own Redis key prefix, so runs side by side never meet.
RUN_ID = f"{os.getpid()}"
#: Written by scripts/services.sh when the local PostgreSQL asks for passwords: a role of the tests' own.
TEST_URL_FILE = Path(__file__).resolve().parents[1] / ".tessera-test-database-url"


def _given_database_url() -> str:
    """The database the tests are pointed at: ``TESSERA_TEST_DATABASE_URL`` (for example a PostgreSQL in
    a container, with its password); else the role ``scripts/services.sh`` made (password
    authentication); else user postgres on loopback. It is never dropped nor written to."""
    if os.environ.get("TESSERA_TEST_DATABASE_URL"):
        return os.environ["TESSERA_TEST_DATABASE_URL"]
    if TEST_URL_FILE.is_file() and TEST_URL_FILE.read_text().strip():
        return TEST_URL_FILE.read_text().strip()
    return "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_test"


def _test_database_url() -> str:
    """A fresh database of this run's own beside the given one (same server and login, its name plus
    ``_<pid>``), created and dropped by the run."""
    from sqlalchemy.engine import make_url

    given = make_url(_given_database_url())
    return given.set(database=f"{given.database or 'tessera_test'}_{RUN_ID}").render_as_string(hide_password=False)


TEST_DATABASE_URL = _test_database_url()
TEST_REDIS_URL = os.environ.get("TESSERA_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
#: The broker of the run: Redis (the same database) unless ``TESSERA_TEST_BROKER_URL`` names another
#: (``amqp://guest:guest@127.0.0.1:5672//`` runs the suite on RabbitMQ).
TEST_BROKER_URL = os.environ.get("TESSERA_TEST_BROKER_URL", TEST_REDIS_URL)
#: Behind Redis Sentinel (``TESSERA_TEST_REDIS_URL=sentinel://...``, ``tests/factories/sentinel.py``
#: starts such a group): the master's name and the sentinels' password, passed to the platform as
#: ``TESSERA_REDIS_SENTINEL_MASTER`` and ``TESSERA_REDIS_SENTINEL_PASSWORD``.
TEST_SENTINEL_SETTINGS = {
    f"TESSERA_REDIS_SENTINEL_{name}": os.environ[f"TESSERA_TEST_REDIS_SENTINEL_{name}"]
    for name in ("MASTER", "PASSWORD")
    if os.environ.get(f"TESSERA_TEST_REDIS_SENTINEL_{name}")
}
REDIS_PREFIX = f"test{RUN_ID}:"


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SANDBOX_PORT = free_port()
S3_PORT = free_port()
#: The sandbox's slow card answers after this long: just past the API's 10 s bounded wait.
SANDBOX_SLOW_SECONDS = 12.0
DATA_DIR = Path(tempfile.mkdtemp(prefix="tessera-test-"))
#: Where the wallet tests serve domains' association files over HTTPS (tests/wallets/conftest.py).
WALLET_DOMAINS_PORT = free_port()

# The settings are read from the environment when first used: set them before importing the platform.
os.environ.update(
    {
        "TESSERA_DATABASE_URL": TEST_DATABASE_URL,
        "TESSERA_BROKER_URL": TEST_BROKER_URL,
        "TESSERA_REDIS_URL": TEST_REDIS_URL,
        "TESSERA_REDIS_KEY_PREFIX": REDIS_PREFIX,
        **TEST_SENTINEL_SETTINGS,
        "TESSERA_DATA_DIR": str(DATA_DIR),
        # A shared database never gets a key file of its own: the run's processes share this key.
        "TESSERA_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
        "TESSERA_ALLOW_PRIVATE_DESTINATIONS": "true",
        "TESSERA_RATE_LIMIT_ENABLED": "false",
        "TESSERA_LOG_FORMAT": "console",
        "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{SANDBOX_PORT}",
        "TESSERA_S3_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
        "TESSERA_S3_BUCKET": f"tessera-test-{RUN_ID}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # Short webhook retry delays keep the retry tests quick; the default schedule is tested apart.
        "TESSERA_WEBHOOK_RETRY_SCHEDULE": "1,1,2",
        # Wallet token roots the wallet tests write at import (tests/wallets/conftest.py): their own CA.
        "TESSERA_WALLET_A_ROOT_CA": str(DATA_DIR / "wallet-a-root.pem"),
        "TESSERA_WALLET_B_ROOT_KEYS": str(DATA_DIR / "wallet-b-root-keys.json"),
        "TESSERA_WALLET_A_DOMAIN_FILE_URL": f"https://127.0.0.1:{WALLET_DOMAINS_PORT}/{{domain}}/.well-known/"
        "apple-developer-merchantid-domain-association",
        "TESSERA_WALLET_A_DOMAIN_CA_CERTS": str(DATA_DIR / "wallet-domains-ca.pem"),
    }
)

pytest.register_assert_rewrite("tests.security.leaks")  # imported by tests.helpers, loaded as a plugin below
from tests.helpers import ApiClient, WebhookReceiver  # noqa: E402

pytest_plugins = ("celery.contrib.pytest", "tests.security.leaks")


def _admin_engine(url: str):
    """An engine for CREATE and DROP DATABASE of ``url``'s database: on the given database when it
    exists (a container's login may reach no other), else on ``postgres``."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    given = make_url(_given_database_url())
    if given.database and given.database != make_url(url).database:
        engine = create_engine(given, isolation_level="AUTOCOMMIT")
        try:
            engine.connect().close()
            return engine
        except OperationalError:
            engine.dispose()
    return create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")


def _drop_database(url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    admin = _admin_engine(url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def _recreate_database(url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    target = make_url(url)
    admin = _admin_engine(url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{target.database}"'))
    admin.dispose()


@pytest.fixture(scope="session")
def database() -> str:
    """A freshly migrated PostgreSQL database; yields its URL."""
    from storage import migrate
    from storage.db import reset_engine

    _recreate_database(TEST_DATABASE_URL)
    migrate.upgrade(TEST_DATABASE_URL)
    yield TEST_DATABASE_URL
    reset_engine()
    if "TESSERA_TEST_DATABASE_URL" not in os.environ:
        _drop_database(TEST_DATABASE_URL)


def run_redis(**options):
    """A client of the run's Redis (``TEST_REDIS_URL``; behind Sentinel, its master), made as the
    platform makes its own (``infra.redis_clients``)."""
    from config.settings import get_settings
    from infra.redis_clients import redis_client

    return redis_client(get_settings(), TEST_REDIS_URL, **options)


@pytest.fixture(scope="session")
def redis_flushed():
    """Redis for this run: its keys (under the run's prefix) are removed before and after."""
    client = run_redis()

    def clear():
        for key in client.scan_iter(match=f"{REDIS_PREFIX}*", count=1000):
            client.delete(key)

    clear()
    yield client
    clear()
    client.close()


@pytest.fixture(scope="session")
def celery_session_app(database, redis_flushed):
    """The platform's own Celery app as a worker process loads it (``workers.celery_app``: the shared app of
    ``infra.celery`` plus the worker signals), configured from the test settings; not a test double."""
    from workers.celery_app import celery_app

    return celery_app


@pytest.fixture(scope="session")
def worker(celery_session_app):
    """A real Celery worker (thread pool, 4 threads) consuming every queue, in this process."""
    from celery.contrib.testing.worker import start_worker

    from infra.celery import QUEUES

    with start_worker(
        celery_session_app,
        pool="threads",
        concurrency=4,
        perform_ping_check=False,
        queues=list(QUEUES),
        loglevel="warning",
        shutdown_timeout=60,  # a key rotation pass running at the end may take longer on a 2-core machine
    ) as controller:
        yield controller


@dataclass
class RunningApi:
    """The API served over real HTTP on a loopback port."""

    base_url: str
    prefix: str = "TS"

    def client(self, api_key: str | None = None) -> ApiClient:
        return ApiClient(self.base_url, api_key, self.prefix)


def serve_in_thread(app_factory, port: int, *, ssl_context=None):
    """Serve an aiohttp application on 127.0.0.1:port (HTTPS with ``ssl_context``) in a daemon thread;
    returns a stop function."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def start():
        runner = web.AppRunner(app_factory(), shutdown_timeout=2, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
        holder["runner"] = runner
        started.set()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    if not started.wait(20):
        raise RuntimeError("the server did not start")

    def stop():
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)

    return stop


@pytest.fixture(scope="session")
def sandbox() -> str:
    """The sandbox providers (``tessera sandbox``) on loopback; yields their base URL."""
    from sandbox.app import make_app

    stop = serve_in_thread(
        lambda: make_app(slow_seconds=SANDBOX_SLOW_SECONDS, hang_seconds=120.0, pending_seconds=2.0), SANDBOX_PORT
    )
    yield f"http://127.0.0.1:{SANDBOX_PORT}"
    stop()


@pytest.fixture(scope="session")
def s3_server() -> str:
    """moto's S3 server on loopback (real HTTP, so pre-signed URLs work with any HTTP client)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=S3_PORT, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{S3_PORT}"
    server.stop()


@pytest.fixture(scope="session")
def api(database, redis_flushed, worker, sandbox, s3_server) -> RunningApi:
    """``tessera api`` served in-process on a free loopback port, with a real worker running."""
    from app.main import init_app

    port = free_port()
    stop = serve_in_thread(init_app, port)
    yield RunningApi(f"http://127.0.0.1:{port}")
    stop()


@dataclass
class TenantFixture:
    """A fresh tenant with its management application's key, and a client using that key."""

    id: object
    application_id: object
    api_key: str
    client: ApiClient


def make_tenant(api: RunningApi, *, type: str = "test", name: str = "acme") -> TenantFixture:
    """Create a tenant directly through the domain function the CLI uses."""
    from domain.tenancy.tenants import create_tenant
    from storage.db import session_scope

    with session_scope() as session:
        created = create_tenant(session, name=name, owner_email=f"owner-{os.urandom(4).hex()}@example.com", type=type)
    return TenantFixture(created.tenant_id, created.application_id, created.api_key, api.client(created.api_key))


@pytest.fixture
def tenant(api) -> TenantFixture:
    """A new test tenant for this test."""
    return make_tenant(api)


@pytest.fixture
def other_tenant(api) -> TenantFixture:
    """A second tenant, to prove isolation (its resources must answer 404 to ``tenant``)."""
    return make_tenant(api, name="other")


@pytest.fixture
def receiver():
    """A real webhook receiver on loopback."""
    server = WebhookReceiver().start()
    yield server
    server.stop()


def app_with_permissions(tenant: TenantFixture, permissions: list[str], type: str = "server_to_server") -> ApiClient:
    """Create an application holding exactly ``permissions`` and return a client using its key."""
    answer = tenant.client.post("/applications", {"name": "limited", "type": type, "permissions": permissions})
    assert answer.status == 201, answer
    return tenant.client.with_key(answer.json["key"])


@pytest.fixture
def limited():
    """``limited(tenant, [permissions])``: a client whose key holds only those permissions."""
    return app_with_permissions
