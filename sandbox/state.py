"""Per-app state shared by the simulated providers: settings, background work, idempotency, counters.

One :class:`Sandbox` lives in each application made by :func:`sandbox.app.make_app` (under the
:data:`SANDBOX` key), so two apps never share state. Each provider part registers its own state
object with :meth:`Sandbox.register` so that ``POST /_admin/reset`` clears it too.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web

from sandbox.cards import CardFilter, CardRef
from sandbox.replies import Reply, SandboxError, require_valid

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY_LENGTH = 255

ABORTED = Reply(
    503,
    {"code": "aborted", "message": "the call was cut short by a sandbox reset or shutdown; repeat it"},
)
"""What a caller gets when its operation is cancelled under it (reset or shutdown)."""

Operation = Callable[[], Awaitable[Reply]]
"""A provider operation: runs once per idempotency key and answers with a :class:`Reply`."""


@dataclass(frozen=True)
class Settings:
    """Delays of the time-dependent test cards, in seconds.

    ``slow_seconds``: the slow network-token card answers after this; ``hang_seconds``: the
    hanging agentic card answers after this; ``pending_seconds``: a pending enrollment turns
    enabled after this.
    """

    slow_seconds: float
    hang_seconds: float
    pending_seconds: float


class Background:
    """Tasks that outlive the request that started them; cancelled on reset and on shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coroutine`` as a task of the running loop and keep a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        """Cancel every running task and wait until all have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class IdempotencyStore:
    """Operations and their replies, per ``(scope..., Idempotency-Key)``.

    The first call with a key runs the operation as a background task (a client that gives up
    does not stop it); every later or concurrent call with the same key waits for that same task
    and gets the same reply. Replies with a 5xx status, like cancelled operations, are not kept:
    the next call with the key runs the operation again. Without a key every call runs it.
    """

    def __init__(self, background: Background) -> None:
        self._background = background
        self._calls: dict[tuple[str, ...], asyncio.Task[Reply]] = {}

    def clear(self) -> None:
        """Forget every key."""
        self._calls.clear()

    async def run(self, scope: tuple[str, ...], key: str | None, operation: Operation) -> tuple[Reply, bool]:
        """The reply of ``operation`` under ``key`` in ``scope``, and whether it was already there.

        :class:`~sandbox.replies.SandboxError` raised by the operation becomes its reply. An
        operation cancelled by a reset or shutdown answers :data:`ABORTED`.
        """
        entry = (*scope, key) if key is not None else None
        task = self._calls.get(entry) if entry else None
        if task is not None:
            return await _outcome(task), True
        task = self._background.spawn(_settle(operation))
        if entry:
            self._calls[entry] = task
            task.add_done_callback(partial(self._forget_unless_final, entry))
        return await _outcome(task), False

    def _forget_unless_final(self, entry: tuple[str, ...], task: asyncio.Task[Reply]) -> None:
        """Done callback: drop ``entry`` when its task failed, was cancelled or answered 5xx."""
        final = not task.cancelled() and task.exception() is None and task.result().status < 500
        if not final and self._calls.get(entry) is task:
            del self._calls[entry]


async def _settle(operation: Operation) -> Reply:
    """Run ``operation``; a :class:`~sandbox.replies.SandboxError` it raises becomes its reply."""
    try:
        return await operation()
    except SandboxError as error:
        return error.reply


async def _outcome(task: asyncio.Task[Reply]) -> Reply:
    """Wait for ``task`` without letting the waiter's cancellation cancel it."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if task.cancelled() and current is not None and not current.cancelling():
            return ABORTED
        raise


class RequestCounter:
    """How many requests each endpoint received, per card (:class:`~sandbox.cards.CardRef` or None)."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, CardRef | None]] = Counter()

    def clear(self) -> None:
        """Forget every count."""
        self._counts.clear()

    def count(self, endpoint: str, card: CardRef | None) -> None:
        """Record one request to ``endpoint`` about ``card`` (None: no identifiable card)."""
        self._counts[endpoint, card] += 1

    def report(self, endpoint: str | None, cards: CardFilter) -> list[dict[str, Any]]:
        """Counts as ``[{endpoint, par, pan_last4, count}]`` (sorted), filtered by endpoint and card."""
        rows = [
            {
                "endpoint": name,
                "par": card.par if card else None,
                "pan_last4": card.last4 if card else None,
                "count": count,
            }
            for (name, card), count in self._counts.items()
            if endpoint in (None, name) and cards.matches(card)
        ]
        return sorted(rows, key=lambda row: (row["endpoint"], row["par"] or "", row["pan_last4"] or ""))


class Clearable(Protocol):
    """State of a provider part that ``POST /_admin/reset`` empties."""

    def clear(self) -> None:
        """Forget everything."""


PartT = TypeVar("PartT", bound=Clearable)


class Sandbox:
    """The state of one sandbox application.

    ``settings``: :class:`Settings`; ``background``: :class:`Background`; ``idempotency``:
    :class:`IdempotencyStore`; ``requests``: :class:`RequestCounter`; ``http``: the client session
    for callbacks, open while the app runs (None before start-up).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.background = Background()
        self.idempotency = IdempotencyStore(self.background)
        self.requests = RequestCounter()
        self.http: aiohttp.ClientSession | None = None
        self._parts: list[Clearable] = []

    def register(self, part: PartT) -> PartT:
        """Have :meth:`reset` clear ``part``; returns ``part``."""
        self._parts.append(part)
        return part

    async def reset(self) -> None:
        """Cancel background work, then forget keys, counts and every registered part's state."""
        await self.background.cancel_all()
        parts: list[Clearable] = [self.idempotency, self.requests, *self._parts]
        for part in parts:
            part.clear()


SANDBOX = web.AppKey("sandbox", Sandbox)
"""Application key of the :class:`Sandbox`."""


def sandbox_of(request: web.Request) -> Sandbox:
    """The :class:`Sandbox` of the application serving ``request``."""
    return request.app[SANDBOX]


def idempotency_key(request: web.Request) -> str | None:
    """The ``Idempotency-Key`` header (None when absent).

    Raises :class:`~sandbox.replies.SandboxError` 400 when it is empty or longer than 255 characters.
    """
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_LENGTH:
        require_valid({IDEMPOTENCY_HEADER: f"must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} characters"})
    return key


async def respond_idempotently(request: web.Request, scope: tuple[str, ...], operation: Operation) -> web.Response:
    """Run ``operation`` under the request's ``Idempotency-Key`` in ``scope`` and render its reply.

    A reply taken from the store carries ``Idempotent-Replayed: true``.
    """
    reply, replayed = await sandbox_of(request).idempotency.run(scope, idempotency_key(request), operation)
    return reply.response(replayed=replayed)
