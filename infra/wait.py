"""Waiting for a job's outcome: woken by a Redis pub/sub notification, with a database poll behind it.

The worker side: when a job settles (``infra.jobs`` closes it: ``succeeded``, ``failed``, ``dead``),
:func:`announce_on_commit` publishes its outcome once the transaction that settled it commits, on the
channel ``<TESSERA_REDIS_KEY_PREFIX>tessera:job-outcome:<job id>``, or, when the job's task message
names the api process whose request recorded it (its ``reply_to``, :func:`message_reply_to`), on that
process's own channel ``<prefix>tessera:job-outcome-to:<its address>``: then only the process that
waits for the job reads the message (the other api processes are not woken by it). The message is JSON
``{"job_id", "status", "result"}`` where ``result`` keeps only the :data:`SAFE_RESULT_KEYS` of the job
result (ids, status codes and error codes: never card data, a key or a secret; a sealed cryptogram
stays in the job row, read once by its request). A job whose outcome was written in one statement
may add ``"answer"``: the values that statement wrote, for the waiting request to answer from without
reading them back (ids, states, the provider's non-secret details and values sealed with the tenant's
key, bound to their resource: never a plain card number or a key; ``infra.jobs.OutcomeWrite``). Jobs
settled together by one commit (a payment method's rails) share one message, ``{"outcomes": [...]}``
with one such object per job, on the first job's channel (:func:`publish_outcomes`): their waiter is
woken once, by one message, when all of them are in.
Publishing is best effort: a lost message costs the waiting request one poll interval, nothing else.

The api side: one :class:`JobWaits` per api process holds one pattern subscription
(``PSUBSCRIBE <prefix>tessera:job-outcome:*``) and the subscription of its own channel (``SUBSCRIBE
<prefix>tessera:job-outcome-to:<address>``, a random address per process, on the same connection),
and a map of job id -> futures of the requests waiting for it (started and stopped in the aiohttp
application's ``cleanup_ctx``). While it is subscribed, the jobs a request records are sent naming
its address (:func:`reply_to_waits`; a job a worker sends while running one answers where that one
does); jobs sent otherwise (the outbox relay's re-sends, an api process without its subscription)
answer on the job's channel, which every api process reads. A message for a job nobody waits for yet
is kept for :data:`RECENT_SECONDS` (the worker can be faster than the request that recorded the job
is to start waiting). :meth:`JobWaits.wait` registers its futures first; unless the
subscription has been live without a break since before the job was recorded (``since``), it then
reads the jobs' statuses once from the database (the job may have settled, and its message gone out,
before this process listened); then it sleeps on the futures. The database is read again every
``TESSERA_JOB_WAIT_POLL_SECONDS`` (default 1 s) as a safety net for a missed message. Without Redis
(the embedded default of ``tessera dev``) or while the subscription is down, the wait polls the
database, from 10 ms backing off to that same interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlmodel import col

from config.settings import Settings, get_settings
from infra.redis_clients import async_redis_client, redis_client
from storage.db import on_commit
from storage.models import Job
from storage.states import JOB_TERMINAL

log = logging.getLogger("tessera.wait")

CHANNEL = "tessera:job-outcome:"
#: The channel of one api process's outcomes, before its address.
ADDRESSED_CHANNEL = "tessera:job-outcome-to:"
#: How a task message's ``reply_to`` names a :class:`JobWaits` address (Celery puts its own value
#: there when none is given; no result backend reads it).
REPLY_PREFIX = "tessera-job-waits:"
#: The address of the subscription the jobs recorded in this context answer to (api: the request's
#: process's; worker: the running job's message's); None: the job's own channel.
_REPLY_TO: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_job_reply_to", default=None)
#: A job in one of these states is settled: nothing about it changes any more (``infra.jobs.TERMINAL``).
SETTLED = frozenset(JOB_TERMINAL)
#: The keys of a job result that its outcome message may carry (ids, codes, states; nothing secret).
SAFE_RESULT_KEYS = ("code", "status", "network_token_id", "rail_status", "skipped", "removed", "stale")
#: The first interval (seconds) of the database poll when no subscription is live.
FIRST_POLL_SECONDS = 0.01
#: Seconds between two attempts to (re)subscribe after Redis failed.
RESUBSCRIBE_SECONDS = 1.0
#: Seconds an outcome nobody waits for yet is kept, and how many such outcomes at most.
RECENT_SECONDS = 10.0
RECENT_MAX = 10_000


def channel_prefix(prefix: str) -> str:
    """The channel name of a job outcome without the job id, under the Redis key prefix ``prefix``."""
    return f"{prefix}{CHANNEL}"


def addressed_channel(prefix: str, address: str) -> str:
    """The channel of the api process whose :class:`JobWaits` has ``address``, under ``prefix``."""
    return f"{prefix}{ADDRESSED_CHANNEL}{address}"


def reply_to_waits(address: str | None) -> None:
    """The jobs recorded from now on in this context (an api request's task) answer to the
    :class:`JobWaits` of ``address`` (:attr:`JobWaits.reply_address`; None: on their own channels)."""
    _REPLY_TO.set(address)


def message_reply_to() -> str | None:
    """The ``reply_to`` of a task message sent now: the address this context's jobs answer to
    (:func:`reply_to_waits`), or None (Celery's default, which names no subscription)."""
    address = _REPLY_TO.get()
    return f"{REPLY_PREFIX}{address}" if address else None


@contextlib.contextmanager
def answering(reply_to: str | None) -> Iterator[None]:
    """Within the block, outcomes published in this context go where a task message's ``reply_to``
    asks (:func:`message_reply_to`), else on each job's channel (any other ``reply_to``: Celery's
    own default value, a message the outbox relay sent)."""
    address = reply_to[len(REPLY_PREFIX) :] if reply_to and reply_to.startswith(REPLY_PREFIX) else None
    token = _REPLY_TO.set(address or None)
    try:
        yield
    finally:
        _REPLY_TO.reset(token)


@dataclass(frozen=True)
class Outcome:
    """A job's outcome as a waiting request sees it: ``status`` and the safe part of its result;
    ``answer``, when its message carried one, the values its one outcome statement wrote (None when
    read from the database, or not given: the request then reads what it answers)."""

    status: str | None
    result: dict = field(default_factory=dict)
    answer: dict | None = None

    @property
    def settled(self) -> bool:
        """True when the job will not change any more."""
        return self.status in SETTLED


def safe_result(result: dict | None) -> dict:
    """The :data:`SAFE_RESULT_KEYS` of a job result (the part an outcome message may carry)."""
    return {key: value for key, value in (result or {}).items() if key in SAFE_RESULT_KEYS}


#: One settled job as an outcome message names it: ``(job id, status, result, answer)`` (see
#: :func:`outcome_message`).
SettledJob = tuple[uuid.UUID, str, dict | None, dict | None]


def _outcome_body(job_id: uuid.UUID, status: str, result: dict | None, answer: dict | None) -> dict:
    body: dict = {"job_id": str(job_id), "status": status, "result": safe_result(result)}
    if answer is not None:
        body["answer"] = answer
    return body


def outcome_message(job_id: uuid.UUID, status: str, result: dict | None, answer: dict | None = None) -> str:
    """The JSON published for a settled job (only the :func:`safe_result` of ``result``; ``answer``
    when given: JSON values only, see the module's text)."""
    return json.dumps(_outcome_body(job_id, status, result, answer))


def outcomes_message(settled: Sequence[SettledJob]) -> str:
    """The JSON published for jobs settled by one commit: :func:`outcome_message` of one job, else
    ``{"outcomes": [...]}`` holding each job's body in order."""
    if len(settled) == 1:
        return outcome_message(*settled[0])
    return json.dumps({"outcomes": [_outcome_body(*one) for one in settled]})


# ---- the worker side -----------------------------------------------------------------------------


class _Publisher:
    """A process-wide Redis client for publishing (redis-py clients are thread-safe and re-make their
    connections after a fork)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client = None
        self._key: tuple | None = None

    def client(self):
        settings = get_settings()
        if not settings.redis_url:
            return None
        key = (settings.redis_url, settings.redis_sentinel_master, os.getpid())
        with self._lock:
            if self._key != key:
                self._client = redis_client(settings, socket_timeout=2, socket_connect_timeout=2)
                self._key = key
            return self._client

    def publish(self, settled: Sequence[SettledJob]) -> None:
        client = self.client()
        if client is None or not settled:
            return
        first, address, prefix = settled[0][0], _REPLY_TO.get(), get_settings().redis_key_prefix
        channel = addressed_channel(prefix, address) if address else channel_prefix(prefix) + str(first)
        try:
            client.publish(channel, outcomes_message(settled))
        except Exception:
            log.warning("could not publish the outcome of job %s; its waiter polls", first, exc_info=True)


_publisher = _Publisher()


def publish_outcome(job_id: uuid.UUID, status: str, result: dict | None, answer: dict | None = None) -> None:
    """Publish a job's outcome now (best effort; nothing when no Redis is configured), on the channel
    of the subscription this context answers to (:func:`answering`), else on the job's; ``answer``:
    see :func:`outcome_message`."""
    publish_outcomes([(job_id, status, result, answer)])


def publish_outcomes(settled: Sequence[SettledJob]) -> None:
    """Publish the outcomes of jobs one commit settled now, in one message (:func:`outcomes_message`;
    best effort, nothing when no Redis is configured), where :func:`publish_outcome` would."""
    _publisher.publish(settled)


def announce_on_commit(session: Session, job_id: uuid.UUID, status: str, result: dict | None) -> None:
    """Publish the outcome of job ``job_id`` once ``session`` commits (dropped on rollback)."""
    safe = safe_result(result)
    on_commit(session, lambda: publish_outcome(job_id, status, safe))


# ---- the api side --------------------------------------------------------------------------------


ReadOutcomes = Callable[[list[uuid.UUID]], Awaitable[dict[uuid.UUID, Outcome]]]


class JobWaits:
    """The job-outcome subscription of one api process and the requests waiting on it.

    ``redis_url`` None: no subscription, waits poll the database (a Sentinel URL: the master named by
    ``settings``, default the process settings; ``infra/redis_clients.py``). ``poll_seconds``: the safety-net
    interval of the database re-read while subscribed, and the longest interval of the poll without.
    """

    def __init__(
        self, redis_url: str | None, *, prefix: str = "", poll_seconds: float = 1.0, settings: Settings | None = None
    ):
        self.redis_url = redis_url
        self.settings = settings
        self.pattern = channel_prefix(prefix) + "*"
        #: This instance's address: the jobs its process's requests record answer on its channel.
        self.address = uuid.uuid4().hex
        self.channel = addressed_channel(prefix, self.address)
        #: The subscription's Redis client name (``CLIENT LIST``): the process and this instance.
        self.client_name = f"tessera-job-waits-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.poll_seconds = poll_seconds
        self._waiters: dict[uuid.UUID, set[asyncio.Future]] = {}
        self._recent: OrderedDict[uuid.UUID, tuple[float, Outcome]] = OrderedDict()
        self._subscribed = asyncio.Event()
        self._live_since: float | None = None
        self._reader: asyncio.Task | None = None
        self._client: aioredis.Redis | None = None
        #: Counters for operators and tests: messages delivered to a waiter, database reads made, and
        #: how often a wait resumed (once per wait when its jobs' messages came: woken when the last
        #: one settles, not per job).
        self.notified = 0
        self.polls = 0
        self.wakes = 0

    @property
    def subscribed(self) -> bool:
        """True while the subscriptions (the pattern and this instance's channel) are live."""
        return self._subscribed.is_set()

    @property
    def reply_address(self) -> str | None:
        """What the jobs a request records now should answer to (:func:`reply_to_waits`): this
        instance's address while it is subscribed, else None (their own channels)."""
        return self.address if self.subscribed else None

    def live_since(self, since: float) -> bool:
        """True when the subscription has been live without a break since ``time.monotonic()`` was
        ``since``: every outcome published after that reached this process."""
        return self._live_since is not None and self._live_since <= since

    async def start(self, *, ready_timeout: float = 2.0) -> None:
        """Subscribe (in a background task that re-subscribes after a Redis failure); waits up to
        ``ready_timeout`` seconds for the first subscription, never failing when Redis is down."""
        if not self.redis_url:
            return
        self._client = async_redis_client(self.settings or get_settings(), self.redis_url, client_name=self.client_name)
        self._reader = asyncio.create_task(self._read(self._client), name="tessera-job-waits")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), ready_timeout)

    async def close(self) -> None:
        """Stop the subscription; waits still running fall back to polling."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _read(self, client: aioredis.Redis) -> None:
        while True:
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe(self.pattern)
                await pubsub.subscribe(self.channel)
                confirmed: set[str] = set()
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message["type"] in ("psubscribe", "subscribe"):
                        confirmed.add(message["type"])
                        if len(confirmed) == 2:  # both live: no outcome of ours can be missed from now on
                            self._live_since = time.monotonic()
                            self._subscribed.set()
                    elif message["type"] in ("pmessage", "message"):
                        self._deliver(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("the job outcome subscription failed; waits poll until it is back", exc_info=True)
            finally:
                self._live_since = None
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    def _deliver(self, data: bytes) -> None:
        try:
            message = json.loads(data)
            bodies = message["outcomes"] if "outcomes" in message else [message]
            outcomes = []
            for body in bodies:
                answer = body.get("answer")
                outcomes.append(
                    (
                        uuid.UUID(body["job_id"]),
                        Outcome(
                            body.get("status"), body.get("result") or {}, answer if isinstance(answer, dict) else None
                        ),
                    )
                )
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignored a malformed job outcome message")
            return
        for job_id, outcome in outcomes:
            self._settle(job_id, outcome)

    def _settle(self, job_id: uuid.UUID, outcome: Outcome) -> None:
        waiting = self._waiters.get(job_id)
        if not waiting:
            self._keep(job_id, outcome)
        for future in waiting or ():
            if not future.done():
                future.set_result(outcome)
                self.notified += 1

    def _keep(self, job_id: uuid.UUID, outcome: Outcome) -> None:
        now = time.monotonic()
        self._recent[job_id] = (now, outcome)
        while self._recent and (
            len(self._recent) > RECENT_MAX or next(iter(self._recent.values()))[0] < now - RECENT_SECONDS
        ):
            self._recent.popitem(last=False)

    def _register(self, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, asyncio.Future]:
        loop = asyncio.get_running_loop()
        futures = {}
        for job_id in job_ids:
            future = loop.create_future()
            recent = self._recent.pop(job_id, None)
            if recent is not None:
                future.set_result(recent[1])
                self.notified += 1
            self._waiters.setdefault(job_id, set()).add(future)
            futures[job_id] = future
        return futures

    def _unregister(self, futures: dict[uuid.UUID, asyncio.Future]) -> None:
        for job_id, future in futures.items():
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(future)
                if not waiting:
                    del self._waiters[job_id]

    @property
    def waiting(self) -> int:
        """How many jobs have a request waiting for them now."""
        return len(self._waiters)

    async def wait(
        self, job_ids: Iterable[uuid.UUID], read: ReadOutcomes, *, timeout: float, since: float | None = None
    ) -> dict[uuid.UUID, Outcome]:
        """Wait until every job of ``job_ids`` is settled or ``timeout`` seconds pass: the caller is
        woken once, when the last of them settles (a payment method's rails: when the slowest is in),
        or at a safety-net read or the deadline.

        ``read(ids)`` reads the outcomes of ``ids`` from the database (off the event loop; a job
        missing from its answer counts as unsettled). ``since``: a ``time.monotonic()`` taken before
        the jobs were recorded; when the subscription has been live since then, the first database
        read is skipped (no outcome can have been missed). Returns the last outcome known of each job.
        """
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        futures = self._register(ids)
        try:
            if since is not None and self.live_since(since):
                known = {job_id: Outcome(None) for job_id in ids}
            else:
                known = await self._read_once(read, ids)
            pending = {job_id for job_id in ids if not known[job_id].settled}
            interval = self.poll_seconds if self.subscribed else FIRST_POLL_SECONDS
            next_read = loop.time() + interval
            while pending and loop.time() < deadline:
                wake = min(next_read, deadline) - loop.time()
                done, _ = await asyncio.wait([futures[job_id] for job_id in pending], timeout=max(0.0, wake))
                self.wakes += 1
                for job_id in list(pending):
                    if futures[job_id] in done and futures[job_id].result().settled:
                        known[job_id] = futures[job_id].result()
                        pending.discard(job_id)
                if pending and loop.time() >= next_read and loop.time() < deadline:
                    known.update(await self._read_once(read, sorted(pending)))
                    pending = {job_id for job_id in pending if not known[job_id].settled}
                    interval = self.poll_seconds if self.subscribed else min(self.poll_seconds, interval * 1.5)
                    next_read = loop.time() + interval
            return known
        finally:
            self._unregister(futures)

    async def _read_once(self, read: ReadOutcomes, ids: list[uuid.UUID]) -> dict[uuid.UUID, Outcome]:
        self.polls += 1
        found = await read(ids)
        return {job_id: found.get(job_id) or Outcome(None) for job_id in ids}


def read_outcomes(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, Outcome]:
    """The outcomes of the jobs ``job_ids`` as stored (status and the safe part of the result)."""
    rows = session.execute(select(col(Job.id), col(Job.status), col(Job.result)).where(col(Job.id).in_(job_ids))).all()
    return {row.id: Outcome(row.status, safe_result(row.result)) for row in rows}
