"""kombu's Redis transports with one client per channel for the broker's synchronous commands.

kombu's Redis channel makes a new ``redis.Redis`` client object for each synchronous command: each
publish of a task message (``LPUSH``) or of a task event (``PUBLISH``), each delivery's bookkeeping
(``HSET``/``ZADD`` of the unacked index) and each acknowledgement. The connections come from the
channel's pool either way, but building the client object is not free: redis-py fills a table of
about 200 response callbacks per client, about 0.1 ms of CPU each, which is as much as the command's
own round trip on loopback. A network-token create built about seven: its task message and
``task-sent`` event in the api; the delivery's bookkeeping, its acknowledgement and three task events
in the worker (``benchmarks/broker_publish.py``: half the CPU per message published with one kept).

The channels here keep one client per connection pool instead (a client holds
no connection of its own and is safe to share between threads), and make a new one when the channel
changes its pool (after a disconnect).

:func:`register` makes the ``redis://``, ``rediss://`` and ``sentinel://`` URL schemes name these
transports in kombu's transport table, so broker URLs, Celery's banner and Flower's broker page read
exactly as before; nothing else of kombu's transport changes.
"""

from __future__ import annotations

from typing import Any

from kombu import transport as kombu_transport
from kombu.transport import redis as kombu_redis


class _OneSyncClient:
    """Channel mixin: :meth:`_create_client` returns one kept client for synchronous commands."""

    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[misc]
        pool = self.pool  # type: ignore[attr-defined]
        client = self._sync_client
        if client is None or client.connection_pool is not pool:
            client = self._sync_client = super()._create_client()  # type: ignore[misc]
        return client


class RedisChannel(_OneSyncClient, kombu_redis.Channel):
    """kombu's Redis channel keeping one client for its synchronous commands."""


class SentinelChannel(_OneSyncClient, kombu_redis.SentinelChannel):
    """kombu's Redis Sentinel channel keeping one client for its synchronous commands."""


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport (``redis://``, ``rediss://``) with :class:`RedisChannel`."""

    Channel = RedisChannel


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Redis Sentinel transport (``sentinel://``) with :class:`SentinelChannel`."""

    Channel = SentinelChannel


#: The URL schemes these transports take over, and each one's transport.
TRANSPORTS = {
    "redis": f"{__name__}:RedisTransport",
    "rediss": f"{__name__}:RedisTransport",
    "sentinel": f"{__name__}:SentinelTransport",
}


def register() -> None:
    """Point kombu's ``redis``, ``rediss`` and ``sentinel`` transport names at this module's
    transports, in this process (idempotent; connections made before keep theirs)."""
    for name, path in TRANSPORTS.items():
        if kombu_transport.TRANSPORT_ALIASES.get(name) != path:
            kombu_transport.TRANSPORT_ALIASES[name] = path
            kombu_transport._transport_cache.pop(name, None)  # the resolved class of the old entry
