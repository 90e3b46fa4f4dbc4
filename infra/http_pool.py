"""The outbound HTTP client's connection pools (:mod:`infra.http`): one keep-alive ``ClientSession`` per
event loop and set of options, whose resolver is the SSRF guard (:mod:`infra.addresses`), and the
process's own event loop for callers without one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import socket
import ssl
import threading

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from infra.addresses import DnsTimeout, resolve, vet


class VettingResolver(AbstractResolver):
    """aiohttp's resolver with the SSRF guard inside: a host name is resolved with :func:`resolve`
    (bounded by ``timeout_s``) and every address is vetted by :func:`vet` before aiohttp may connect
    to any of them, so only vetted addresses are ever connected to (the connection pool's DNS cache
    holds vetted answers only)."""

    def __init__(self, *, allow_private: bool, timeout_s: float) -> None:
        self._allow_private = allow_private
        self._timeout_s = timeout_s

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        try:
            addresses = await asyncio.to_thread(resolve, host, port, self._timeout_s)
        except DnsTimeout:
            raise DnsTimeout() from None
        except UnicodeError as exc:
            raise OSError("DNS resolution failed") from exc
        vet(addresses, self._allow_private)
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in addresses
        ]

    async def close(self) -> None:
        return None


class SessionPool:
    """The process's event loop (a daemon thread) and its keep-alive connection pools.

    One loop per process, made on first use and again after a fork, for callers without a loop of
    their own (:func:`deliver`, :func:`deliver_many`); one ``ClientSession`` per event loop and
    ``(allow_private, ca_certs, timeout_s, per_host)`` (in practice one per worker process, and for
    the api one on its own loop: :func:`forward` runs there, with no hop to another thread), reused by
    every request of that loop. Sessions of other loops than the pool's are closed by
    :func:`close_sessions` on their loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sessions: dict[tuple, aiohttp.ClientSession] = {}

    def _forked(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's loop and sessions are not ours
            self._loop, self._pid, self._sessions = None, os.getpid(), {}

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            self._forked()
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tessera-http", daemon=True).start()
                self._loop = loop
                self._sessions = {k: v for k, v in self._sessions.items() if not k[0].is_closed()}
            return self._loop

    def session(
        self, *, allow_private: bool, ca_certs: str | None, timeout_s: float, per_host: int, extra_ca: str | None = None
    ):
        """The pooled session of the running loop for these options (call on that loop). ``ca_certs``
        replaces the system's trusted roots; ``extra_ca`` (a PEM path) adds roots to them. TLS 1.2 at
        least."""
        loop = asyncio.get_running_loop()
        key = (loop, allow_private, ca_certs, extra_ca, timeout_s, per_host)
        session = self._sessions.get(key)
        if session is None or session.closed:
            with self._lock:
                self._forked()
                for old in [k for k in self._sessions if k[0].is_closed()]:  # loops gone (tests)
                    del self._sessions[old]
            ssl_context = ssl.create_default_context(cafile=ca_certs)
            if extra_ca:
                ssl_context.load_verify_locations(cafile=extra_ca)
            ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
            connector = aiohttp.TCPConnector(
                resolver=VettingResolver(allow_private=allow_private, timeout_s=timeout_s),
                limit=0,
                limit_per_host=per_host,
                ssl=ssl_context,
                ttl_dns_cache=10,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
            self._sessions[key] = session
        return session

    async def close_loop_sessions(self) -> None:
        """Close the sessions of the running loop."""
        loop = asyncio.get_running_loop()
        for key in [k for k in self._sessions if k[0] is loop]:
            session = self._sessions.pop(key, None)
            if session is not None:
                await session.close()

    def close(self) -> None:
        """Close the pool loop's sessions (at interpreter exit: no "unclosed session" warnings)."""
        loop = self._loop
        if self._pid != os.getpid() or loop is None or loop.is_closed():
            return
        if not any(k[0] is loop for k in self._sessions):
            return
        with contextlib.suppress(Exception):  # exiting anyway
            asyncio.run_coroutine_threadsafe(self.close_loop_sessions(), loop).result(timeout=2)


POOL = SessionPool()
atexit.register(POOL.close)
