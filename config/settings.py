"""The one settings class of the platform.

Every setting is read from an environment variable ``TESSERA_<NAME>`` or, when the environment does
not set it, from a ``.env`` file in the working folder (:data:`ENV_FILE`, lines ``TESSERA_<NAME>=value``;
pydantic-settings). README.md lists each with its default. Each secret (:data:`FILE_SETTINGS`) may
instead be read from a file named by ``TESSERA_<NAME>_FILE`` (Docker secrets: ``/run/secrets/...``):
the file's content, without its trailing newline, is the value. Services left unset fall back, each on
its own, to the embedded defaults kept in ``TESSERA_DATA_DIR``: a SQLite database, the kombu
SQLAlchemy transport on SQLite, an in-process rate limiter, mail written to files.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "tessera"


#: The settings file read from the working folder (the environment wins over it).
ENV_FILE = ".env"


def _without_password(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***`` (each of several separated by
    ``;``, as Sentinel URLs are)."""
    if ";" in url:
        return ";".join(_without_password(part) for part in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


#: The scheme of a URL naming Redis Sentinels rather than a Redis server (``sentinel://host:26379``).
SENTINEL_SCHEME = "sentinel://"


#: The settings that may come from a file named by ``TESSERA_<NAME>_FILE``: the secrets, and the
#: service URLs that carry passwords.
FILE_SETTINGS = (
    "master_key",
    "master_key_previous",
    "flower_password",
    "database_url",
    "broker_url",
    "redis_url",
    "redis_sentinel_password",
    "smtp_url",
)


def file_variable(name: str) -> str:
    """The environment variable naming the file a setting is read from: ``TESSERA_<NAME>_FILE``."""
    return f"TESSERA_{name.upper()}_FILE"


class _SettingFiles(PydanticBaseSettingsSource):
    """``TESSERA_<NAME>_FILE`` for each of :data:`FILE_SETTINGS`: the value is the named file's content
    (trailing newline dropped). Setting both ``TESSERA_<NAME>`` and ``TESSERA_<NAME>_FILE`` is refused."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[object, str, bool]:
        return None, field_name, False  # every value comes from __call__

    def __call__(self) -> dict[str, object]:
        values: dict[str, object] = {}
        for name in FILE_SETTINGS:
            variable = file_variable(name)
            path = os.environ.get(variable)
            if not path:
                continue
            if os.environ.get(f"TESSERA_{name.upper()}"):
                raise ValueError(f"both TESSERA_{name.upper()} and {variable} are set: keep one")
            try:
                values[name] = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                raise ValueError(f"{variable}: cannot read {path}: {exc.strerror}") from None
        return values


class Settings(BaseSettings):
    """Process-wide configuration; instantiate through :func:`get_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="TESSERA_", extra="ignore", frozen=True, env_file=ENV_FILE, env_file_encoding="utf-8"
    )

    # Where the embedded defaults live (SQLite files, master key file, mail sink).
    data_dir: Path = Field(default_factory=_default_data_dir)

    # Services. None means "use the embedded default" (see the module docstring).
    database_url: str | None = None
    broker_url: str | None = None
    # Prefix of every Redis key the broker and the rate limiter write (deployments sharing one Redis).
    redis_key_prefix: str = ""
    redis_url: str | None = None
    #: Redis Sentinel: the name the sentinels know the master by (their ``sentinel monitor <name>``).
    #: Required when ``broker_url`` or ``redis_url`` is a ``sentinel://`` URL (one per sentinel,
    #: separated by ``;``; the first carries the master's password and database number); the
    #: sentinels' own password (their ``requirepass``), unset when they ask for none.
    redis_sentinel_master: str | None = None
    redis_sentinel_password: SecretStr | None = None
    s3_endpoint_url: str | None = None
    # The S3 endpoint as clients outside the platform's network reach it (pre-signed URLs); None: the same.
    s3_public_endpoint_url: str | None = None
    s3_bucket: str = "tessera"
    s3_region: str = "us-east-1"
    smtp_url: str | None = None
    mail_from: str = "Tessera <no-reply@tessera.localhost>"
    sandbox_url: str = "http://127.0.0.1:8081"

    # The API process.
    api_host: str = "127.0.0.1"
    api_port: int = 8080
    header_prefix: str = "TS"
    public_base_url: str | None = None
    max_body_bytes: int = 1_048_576
    api_db_threads: int = 16
    # Processes of `tessera api`, sharing its port through SO_REUSEPORT (unset: one per core;
    # `tessera dev` runs one unless this is set).
    api_workers: int | None = None
    # How long an api process trusts an API key (and a proxy key) it has looked up (0: look up on every
    # request). A change or deletion made through this process applies at once; other processes see it within this.
    auth_cache_seconds: float = 2.0
    # How long an api process trusts the event types a tenant's webhooks subscribe to (0: read them
    # on every event). Same rule as auth_cache_seconds for changes made here and elsewhere.
    webhook_cache_seconds: float = 2.0
    # Units of work of the token hot path arriving within this many milliseconds share one
    # statement and one commit (0: each its own transaction).
    group_commit_ms: float = 1.0
    db_pool_size: int = 10
    # Run the hot statements (a job's lease and outcome, the recording of rows, the reads answering a
    # create) as server-side prepared statements, planned once per connection for any values
    # (`plan_cache_mode = force_generic_plan`); off behind a pooler in
    # transaction mode that does not keep a session's prepared statements (PgBouncer's
    # `pool_mode = transaction`).
    db_prepared_statements: bool = True

    # Secrets at rest: a base64 32-byte master key, else a key file made in data_dir on first start;
    # an AWS KMS key id wraps the tenant data keys instead when set.
    master_key: SecretStr | None = None
    #: Previous master keys still accepted for unwrapping (comma-separated base64), during a rotation:
    #: ``tessera keys rewrap`` moves every data key under ``master_key``; then remove them.
    master_key_previous: SecretStr | None = None
    kms_key_id: str | None = None
    #: Previous KMS key ids still accepted for unwrapping (comma-separated), during a KMS key change.
    kms_key_id_previous: str | None = None
    kms_endpoint_url: str | None = None
    aws_region: str = "us-east-1"

    # Outbound calls.
    allow_private_destinations: bool = False
    # The outbound proxy: a PEM file of extra trusted roots (added to the system's) for destinations
    # with private certificate authorities; the destination's time to answer (spec section 8: 25 s,
    # then 408); the longest answer passed back, in bytes.
    proxy_ca_bundle: str | None = None
    proxy_timeout_seconds: float = 25.0
    proxy_max_response_bytes: int = 10 * 1024 * 1024

    # Rate limits (spec section 8): requests per window per client IP, then blocked.
    rate_limit_enabled: bool = True
    rate_limit_window_seconds: int = 10
    rate_limit_block_seconds: int = 10
    rate_limit_global: int = 1000
    rate_limit_token_create: int = 200
    rate_limit_token_list: int = 100
    rate_limit_token_search: int = 50

    # Tokens.
    cvc_retention_seconds: int = 3600

    # Wallet tokens. The wallet-a root replacing the pinned Apple Root CA - G3 (a PEM path, for
    # sandboxes and tests); how far a wallet-a signing time may be from the clock; the wallet-b root
    # signing keys (a path to the provider's published key list, JSON); how long an unused cryptogram
    # is kept (it is erased at its first use in any case).
    wallet_a_root_ca: str | None = None
    wallet_a_signing_time_window_seconds: int = 300
    wallet_b_root_keys: str | None = None
    wallet_cryptogram_retention_seconds: int = 3600
    # Where a domain's association file is fetched ({domain} is replaced), the CA bundle trusted for it
    # (unset: the system's), and how long a request waits for domain and session work.
    wallet_a_domain_file_url: str = "https://{domain}/.well-known/apple-developer-merchantid-domain-association"
    wallet_a_domain_ca_certs: str | None = None
    wallet_wait_seconds: float = 10.0

    # Providers: test tenants call the sandbox; production tenants the live URLs below (unset: 422).
    provider_connect_timeout_seconds: float = 5.0
    provider_read_timeout_seconds: float = 45.0
    card_network_url: str | None = None
    job_lease_seconds: float = 120.0
    network_token_wait_seconds: float = 10.0

    # Agentic payment methods (second document): live provider URLs, the bounded wait of create and
    # retry, the provider call timeout, provider-error retention and the operation lease.
    vic_url: str | None = None
    agentpay_url: str | None = None
    psp_url: str | None = None
    agentic_wait_seconds: float = 10.0
    agentic_provider_timeout_seconds: float = 8.0
    provider_error_retention_days: int = 90
    operation_lease_seconds: int = 300

    # Account updater (second document): upload window, file cap, rows per chunk.
    account_updater_upload_seconds: int = 3600
    account_updater_max_bytes: int = 30 * 1024 * 1024
    account_updater_chunk_rows: int = 5000

    # Tenant administration (core document sections 2 and 8).
    invitation_ttl_hours: int = 72
    document_max_bytes: int = 25 * 1024 * 1024
    rate_limit_documents_per_minute: int = 25
    client_key_default_days: int = 182
    included_monthly_active_tokens: int = 10_000

    # Webhooks: the retry schedule is the delay in seconds before each retry after the first attempt.
    webhook_timeout_seconds: float = 10.0
    webhook_retry_schedule: str = "5,30,120,600,1800,7200,18000,36000,36000"
    webhook_disable_after_seconds: int = 5 * 24 * 3600
    #: At most this many connections (deliveries in flight) to one receiving host per worker process.
    webhook_host_concurrency: int = Field(default=32, ge=1)
    #: Fairness between tenants (``infra/fairness.py``): a tenant holding this many worker slots (task
    #: runs) does not take more while another tenant's deliveries wait: those are delivered in place of
    #: its own, which are handed back. A tenant alone uses every slot, in short turns (one round of
    #: concurrent POSTs a run) while it is behind: a delivery due more than ``webhook_backlog_seconds``
    #: ago still pending (0: off).
    webhook_tenant_slots: int = Field(default=1, ge=0)
    webhook_backlog_seconds: float = 2.0

    # Reactors (core document sections 2 and 8): a JSON file of {name, version, severity, id}
    # advisories the builds scan against instead of `npm audit` (offline deployments, tests), and how
    # long `POST /reactors/{id}/react` waits for the invocation's outcome (seconds), and how long an
    # invocation's sealed arguments and answer are kept after it ended (hours).
    reactor_advisories: Path | None = None
    reactor_wait_seconds: float = 30.0
    reactor_result_retention_hours: int = 168
    # The sandbox of customer code (reactors and proxy code transforms, ``infra/node_runtime``):
    # the bubblewrap executable (a name on PATH or a path), the ``host:port`` pairs customer code may
    # reach although they are not public (comma-separated; empty by default: tests and local
    # development name their own receivers here, ``TESSERA_ALLOW_PRIVATE_DESTINATIONS`` does not
    # apply to customer code), the size of a process's private ``/tmp`` (MiB), and how long an idle
    # warm process is kept (seconds).
    reactor_bwrap: str = "bwrap"
    reactor_egress_allow: str = ""
    reactor_tmp_mib: int = Field(default=16, ge=1, le=1024)
    reactor_idle_seconds: float = Field(default=300.0, gt=0)
    #: Reactor slots of one ``reactors`` worker node: a tenant alone may run this many invocations
    #: at once; while other tenants wait, each holds at most its share. The node runs twice as many
    #: threads, so a tenant arriving during another's flood never waits for a slot to end.
    reactor_slots: int = Field(default=4, ge=1, le=64)

    # The async spine.
    outbox_relay_after_seconds: int = 15
    #: A request waiting for a job is woken by its outcome message (``infra/wait.py``); the database
    #: is re-read this often (seconds) for a missed message, and polled at most this slowly without Redis.
    job_wait_poll_seconds: float = 1.0
    #: Threads of the ``providers`` queue's worker (I/O-bound provider calls), beside the prefork pool.
    provider_concurrency: int = 16
    task_time_limit_seconds: int = 120
    worker_concurrency: int | None = None
    #: Producers send Celery's ``task-sent`` event, so Flower shows a task as PENDING from the moment it
    #: is queued (up to 0.1 s later); they go out after their messages, from a thread of the producer's
    #: own that publishes the events of 0.1 s as one message (``infra.celery.SentEvents``), not on the
    #: path of a request that waits for its job. False saves that publish; Flower then lists a task from
    #: its ``task-received`` event on, and its Broker page still counts what waits in a queue.
    task_sent_events: bool = True

    # Logging.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "console"] = "json"

    # Operations: Flower's basic auth (``tessera flower`` refuses to start without a password), the
    # folder where api and worker processes share their Prometheus series (unset: ``metrics/`` in
    # data_dir), and the api's stop after SIGTERM: how long it keeps reading the requests of connections
    # it accepted before it stopped listening, then how long it lets requests in flight finish.
    flower_user: str = "tessera"
    flower_password: SecretStr | None = None
    metrics_dir: Path | None = None
    api_drain_seconds: float = Field(default=1.0, ge=0)
    api_shutdown_timeout_seconds: float = 30.0

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The environment, then the files ``TESSERA_<NAME>_FILE`` name, then ``./.env``."""
        return init_settings, env_settings, _SettingFiles(settings_cls), dotenv_settings, file_secret_settings

    def __init__(self, **values: Any) -> None:
        """Read the settings; a ``sentinel://`` URL without ``TESSERA_REDIS_SENTINEL_MASTER`` raises
        ``ValueError`` naming both settings."""
        super().__init__(**values)
        for name in ("broker_url", "redis_url"):
            url = getattr(self, name)
            if url and url.startswith(SENTINEL_SCHEME) and not self.redis_sentinel_master:
                raise ValueError(
                    f"TESSERA_{name.upper()} names Redis Sentinels (sentinel://): set TESSERA_REDIS_SENTINEL_MASTER "
                    "to the name they monitor the master by"
                )

    @field_validator("redis_sentinel_password")
    @classmethod
    def _no_empty_password(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None  # empty: the sentinels ask none

    @field_validator("header_prefix")
    @classmethod
    def _prefix_form(cls, value: str) -> str:
        if not value or not value.replace("-", "").isalnum():
            raise ValueError("header prefix must be letters, digits and dashes")
        return value.upper()

    # ---- derived values -------------------------------------------------------------------------

    @property
    def effective_database_url(self) -> str:
        """The SQLAlchemy URL in use: the configured one or the SQLite file in ``data_dir``."""
        return self.database_url or f"sqlite:///{self.data_dir / 'tessera.db'}"

    @property
    def effective_broker_url(self) -> str:
        """The Celery broker URL: the configured one or kombu's SQLAlchemy transport on SQLite."""
        return self.broker_url or f"sqla+sqlite:///{self.data_dir / 'broker.db'}"

    def services_line(self) -> str:
        """One line naming the database and the broker these settings reach (passwords hidden) and
        where the settings came from: what every command that reads state says first."""
        source = f"the environment and {Path(ENV_FILE).resolve()}" if Path(ENV_FILE).is_file() else "the environment"
        return (
            f"database {_without_password(self.effective_database_url)}, "
            f"broker {_without_password(self.effective_broker_url)} (settings from {source})"
        )

    @property
    def uses_embedded_database(self) -> bool:
        """True when the database is the embedded SQLite file."""
        return self.effective_database_url.startswith("sqlite")

    @property
    def effective_metrics_dir(self) -> Path:
        """The folder of the Prometheus multiprocess files: ``metrics_dir`` or ``metrics/`` in data_dir."""
        return self.metrics_dir or self.data_dir / "metrics"

    @property
    def reactor_egress_allowlist(self) -> frozenset[str]:
        """``reactor_egress_allow`` as a set of lower-case ``host:port`` pairs."""
        return frozenset(part.strip().lower() for part in self.reactor_egress_allow.split(",") if part.strip())

    @property
    def webhook_retry_delays(self) -> list[int]:
        """Delays in seconds before retry 1, 2, ... of a webhook delivery."""
        return [int(part) for part in self.webhook_retry_schedule.split(",") if part.strip()]

    def header(self, suffix: str) -> str:
        """The full name of one of the service's own headers, e.g. ``header("API-KEY")``."""
        return f"{self.header_prefix}-{suffix}"


@functools.cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment and ``./.env``."""
    return Settings()


def reload_settings() -> Settings:
    """Drop the cached settings and read the environment again (tests, CLI overrides)."""
    get_settings.cache_clear()
    return get_settings()
