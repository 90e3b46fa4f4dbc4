"""The one place that makes the platform's Redis clients, from the settings: a plain Redis URL
(``redis://``, ``rediss://``, ``unix://``) or Redis Sentinel.

A Sentinel URL names the sentinels, one URL each, separated by ``;``:
``sentinel://:password@sentinel-1:26379/1;sentinel://sentinel-2:26379;sentinel://sentinel-3:26379``.
The first URL that carries them gives the master's user, password and database number (as kombu's
``sentinel://`` broker transport reads them); ``TESSERA_REDIS_SENTINEL_MASTER`` names the master the
sentinels monitor and ``TESSERA_REDIS_SENTINEL_PASSWORD`` is the sentinels' own password, if they ask
for one. The client asks the sentinels for the master's address on every new connection
(``Sentinel.master_for``), so after a failover its next command reaches the promoted replica. The
Celery broker takes the same URL and settings through kombu's transport (``infra/celery.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

from config.settings import SENTINEL_SCHEME, Settings

#: The port of a sentinel whose URL names none.
SENTINEL_PORT = 26379


def is_redis_url(url: str | None) -> bool:
    """True when ``url`` reaches Redis: a server or its sentinels."""
    return bool(url) and str(url).startswith(("redis://", "rediss://", "unix://", SENTINEL_SCHEME))


def is_sentinel_url(url: str | None) -> bool:
    """True when ``url`` names Redis Sentinels (``sentinel://``)."""
    return bool(url) and str(url).startswith(SENTINEL_SCHEME)


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed Sentinel URL: the sentinels' ``(host, port)`` and the master's login and database."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The sentinels of ``url`` (``sentinel://[[user]:password@]host[:port][/db]``, several joined by
    ``;``) and the master's login and database from the first part that gives them. Raises
    ``ValueError`` for a part that is not a ``sentinel://`` URL or names no host."""
    sentinels: list[tuple[str, int]] = []
    db: int | None = None
    username = password = None
    for part in filter(None, (piece.strip() for piece in url.split(";"))):
        parts = urlsplit(part)
        if parts.scheme != "sentinel" or not parts.hostname:
            raise ValueError(f"not a sentinel://host:port URL: {part.split('@')[-1]!r}")
        sentinels.append((parts.hostname, parts.port or SENTINEL_PORT))
        if password is None and parts.password is not None:
            username, password = unquote(parts.username or "") or None, unquote(parts.password)
        if db is None and parts.path.strip("/"):
            db = int(parts.path.strip("/"))
    if not sentinels:
        raise ValueError("a sentinel:// URL names no sentinel")
    return SentinelUrl(tuple(sentinels), db or 0, username, password)


def _sentinel_kwargs(settings: Settings, options: dict[str, Any]) -> dict[str, Any]:
    """The options of the connections to the sentinels themselves: their password and the timeouts."""
    kwargs = {key: value for key, value in options.items() if key.startswith("socket_")}
    if settings.redis_sentinel_password is not None:
        kwargs["password"] = settings.redis_sentinel_password.get_secret_value()
    return kwargs


def _master_options(parsed: SentinelUrl, options: dict[str, Any]) -> dict[str, Any]:
    login = {"username": parsed.username, "password": parsed.password} if parsed.password is not None else {}
    return {"db": parsed.db, **login, **options}


def redis_client(settings: Settings, url: str | None = None, **options: Any) -> redis.Redis:
    """A Redis client for ``url`` (default: ``settings.redis_url``); ``options`` are redis-py's
    connection options (``socket_timeout``, ``client_name``, ...). On a Sentinel URL the client
    reaches the master ``settings.redis_sentinel_master`` wherever the sentinels say it is now.
    Raises ``ValueError`` when there is no URL, or a Sentinel URL without a master name."""
    return _client(redis.Redis, Sentinel, settings, url, options)


def async_redis_client(settings: Settings, url: str | None = None, **options: Any) -> aioredis.Redis:
    """:func:`redis_client` for asyncio (``redis.asyncio``): same URL, settings and errors."""
    return _client(aioredis.Redis, AsyncSentinel, settings, url, options)


def _client(client: Any, sentinel_class: Any, settings: Settings, url: str | None, options: dict[str, Any]) -> Any:
    """The client of :func:`redis_client` made with redis-py's ``client`` class (``from_url``) or, on a
    Sentinel URL, ``sentinel_class`` (``master_for``): the sync or the asyncio ones."""
    url = url or settings.redis_url
    if not url:
        raise ValueError("no Redis URL: set TESSERA_REDIS_URL")
    if not is_sentinel_url(url):
        return client.from_url(url, **options)
    parsed = parse_sentinel_url(url)
    sentinel = sentinel_class(
        list(parsed.sentinels), sentinel_kwargs=_sentinel_kwargs(settings, options), **_master_options(parsed, options)
    )
    return sentinel.master_for(_master_name(settings))


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    """The options kombu's ``sentinel://`` transport needs beside the URL: the master's name and the
    sentinels' password (``sentinel_kwargs``); nothing for another URL."""
    if not is_sentinel_url(settings.effective_broker_url):
        return {}
    options: dict[str, Any] = {"master_name": _master_name(settings)}
    sentinel_kwargs = _sentinel_kwargs(settings, {})
    if sentinel_kwargs:
        options["sentinel_kwargs"] = sentinel_kwargs
    return options


def _master_name(settings: Settings) -> str:
    if not settings.redis_sentinel_master:
        raise ValueError("a sentinel:// URL needs TESSERA_REDIS_SENTINEL_MASTER (the master's name)")
    return settings.redis_sentinel_master
