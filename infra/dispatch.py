"""Sending Celery tasks only after the transaction that recorded their work commits.

Code that records work calls :func:`enqueue_after_commit` (or :func:`enqueue_batch_after_commit`)
inside its unit of work; the messages go out when the session commits (through the one after-commit
hook, :func:`storage.db.on_commit`) and are dropped if it rolls back. A lost message (the process died
after the commit, or the broker was down) is re-sent by the outbox relay (``sweeps.relay_outbox``), so
a send failure here is logged and otherwise ignored. A job whose request waits for its outcome may be
``gated`` (:func:`enqueue_jobs_after_commit`): its message goes out just before the ``COMMIT``, while
the transaction holds the job's gate, and its lease waits there until the commit is done.

Jobs of a batched kind (:data:`BATCH_ARGUMENT`: webhook deliveries) travel as lists of ids, about a
hundred a message; :func:`enqueue_jobs_after_commit` picks the form by the kind. Jobs recorded
``together`` by one unit of work (a payment method's rails) travel in one message, the first job's
``job_id`` with the others' ids as ``sibling_ids`` (:data:`SIBLINGS_ARGUMENT`), and run side by side in one
task run (``infra.task.JobTask.run``); each is still a job of its own.

A delay rides on the message as a countdown only when it is at most :data:`MAX_COUNTDOWN_SECONDS`;
longer delays are left to the row's ``due_at`` and the relay (a broker holding countdown messages for
hours is a broker that loses them on restart, and Redis' visibility timeout would redeliver them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from celery.utils.saferepr import saferepr
from sqlalchemy.orm import Session

from infra import wait
from infra.celery import DELIVER_TASK, PUBLISH_RETRY_POLICY, celery_app, publish_options, sent_events
from storage.db import before_commit, hold_gates, on_commit, transaction_state

log = logging.getLogger("tessera.dispatch")

_PENDING = "tessera_enqueue"
_GATED = "tessera_enqueue_gated"
#: At most this many ids ride in one batched message (the task works through them together).
BATCH_SIZE = 100
#: The longest delay carried by a Celery countdown (seconds); longer ones wait as ``due_at``.
MAX_COUNTDOWN_SECONDS = 60
#: Job kinds whose task takes a batch of job ids: kind -> the name of its id list argument. The jobs
#: of any other kind are sent one message each, with ``job_id``.
BATCH_ARGUMENT = {DELIVER_TASK: "delivery_ids"}
#: The argument naming the other jobs a message of jobs recorded together carries beside ``job_id``.
SIBLINGS_ARGUMENT = "sibling_ids"


@dataclass
class _Outgoing:
    """The messages one transaction sends when it commits."""

    single: list[tuple[str, float | None, dict]] = field(default_factory=list)
    batches: dict[tuple[str, str, float | None], list[str]] = field(default_factory=dict)
    together: dict[tuple[str, float | None], list[str]] = field(default_factory=dict)

    def messages(self) -> list[tuple[str, float | None, dict]]:
        """Every message, as ``(task name, countdown, kwargs)``: the single ones, the jobs recorded
        together (one message per task and countdown: ``job_id`` and the others as ``sibling_ids``), then
        the batches cut at :data:`BATCH_SIZE` ids."""
        messages = list(self.single)
        for (task_name, countdown), ids in self.together.items():
            kwargs: dict[str, Any] = {"job_id": ids[0]}
            if len(ids) > 1:
                kwargs[SIBLINGS_ARGUMENT] = ids[1:]
            messages.append((task_name, countdown, kwargs))
        for (task_name, key, countdown), ids in self.batches.items():
            for start in range(0, len(ids), BATCH_SIZE):
                messages.append((task_name, countdown, {key: ids[start : start + BATCH_SIZE]}))
        return messages

    def send(self) -> None:
        send_messages(self.messages())


def _outgoing(session: Session, *, gated: bool = False) -> _Outgoing:
    """The messages ``session``'s transaction sends once it commits, or (``gated``) just before its
    ``COMMIT``, behind the gates of their jobs (:func:`storage.db.before_commit`)."""
    outgoing, made = transaction_state(session, _GATED if gated else _PENDING, _Outgoing)
    if made:
        (before_commit if gated else on_commit)(session, outgoing.send)
    return outgoing


def countdown_for(delay: float | None) -> float | bool | None:
    """The countdown a message for work due in ``delay`` seconds carries: None (now) for no delay,
    the delay rounded up to whole seconds up to :data:`MAX_COUNTDOWN_SECONDS` (never early; RabbitMQ's
    native delayed delivery counts whole seconds), else False (no message: the relay sends it when it
    is due)."""
    if delay is None or delay <= 0:
        return None
    return math.ceil(delay) if delay <= MAX_COUNTDOWN_SECONDS else False


def enqueue_after_commit(session: Session, task_name: str, *, delay: float | None = None, **kwargs) -> None:
    """Send task ``task_name`` with keyword arguments ``kwargs`` (ids only) once ``session`` commits,
    to run after ``delay`` seconds (see :func:`countdown_for`: beyond a minute nothing is sent)."""
    countdown = countdown_for(delay)
    if countdown is not False:
        _outgoing(session).single.append((task_name, countdown, kwargs))


def enqueue_batch_after_commit(
    session: Session, task_name: str, key: str, ids: list[str], *, delay: float | None = None
) -> None:
    """Add ``ids`` to the id list argument ``key`` of task ``task_name``, sent once ``session`` commits
    in messages of at most :data:`BATCH_SIZE` ids: one transaction that records many units of work
    (a batch of events) sends a few messages, not one per unit. ``delay`` as in
    :func:`enqueue_after_commit`."""
    countdown = countdown_for(delay)
    if countdown is not False and ids:
        _outgoing(session).batches.setdefault((task_name, key, countdown), []).extend(ids)


def enqueue_jobs_after_commit(
    session: Session,
    kind: str,
    job_ids: list[str],
    *,
    delay: float | None = None,
    together: bool = False,
    gated: bool = False,
) -> None:
    """Send the task ``kind`` of the jobs ``job_ids`` once ``session`` commits: for a kind of
    :data:`BATCH_ARGUMENT` in messages of at most :data:`BATCH_SIZE` ids
    (:func:`enqueue_batch_after_commit`); ``together``: in the one message of the jobs of ``kind``
    this transaction records together (``job_id``, then ``sibling_ids``); otherwise one message per job
    with ``job_id``. ``delay`` as in :func:`enqueue_after_commit`.

    ``gated``: the task leases the message's ``job_id`` by ``infra.jobs.lease`` (or its siblings with
    it, ``lease_together``), whose statement waits at the job's gate (:func:`storage.db.gate_wait`).
    On PostgreSQL the transaction then holds the jobs' gates and their messages go out just before
    its ``COMMIT`` instead of after it (:func:`storage.db.hold_gates`): the worker receives the message
    while the commit waits for its WAL flush, and its lease runs once the commit is done. A commit that
    fails leaves a message naming a job that was never written: its lease takes nothing. Elsewhere,
    or for a batched kind, as without it."""
    key = BATCH_ARGUMENT.get(kind)
    if key is not None:
        enqueue_batch_after_commit(session, kind, key, job_ids, delay=delay)
        return
    countdown = countdown_for(delay)
    if countdown is False or not job_ids:
        return
    outgoing = _outgoing(session, gated=gated and hold_gates(session, job_ids))
    if together:
        outgoing.together.setdefault((kind, countdown), []).extend(job_ids)
        return
    outgoing.single.extend((kind, countdown, {"job_id": job_id}) for job_id in job_ids)


def take_pending(session: Session) -> list[tuple[str, dict]]:
    """Remove the messages ``session``'s transaction would send when it commits and return them as
    ``(task name, kwargs)`` (batches cut as they would be sent, countdowns dropped): for a caller that
    sends them elsewhere itself, or not at all (the relay recovers recorded work)."""
    taken = []
    for key in (_GATED, _PENDING):
        outgoing = session.info.get(key)
        if outgoing is None:
            continue
        taken += [(task_name, kwargs) for task_name, _countdown, kwargs in outgoing.messages()]
        outgoing.single.clear()
        outgoing.batches.clear()
        outgoing.together.clear()
    return taken


def send_task(task_name: str, *, countdown: float | None = None, producer: Any = None, **kwargs) -> bool:
    """Send one task now (to run after ``countdown`` seconds, at most a minute, when given), on
    ``producer`` when given (a kombu producer of :data:`celery_app`'s pool), else on one taken from
    the pool for this message; False (and a log line) when the broker did not take it. The message's
    ``reply_to`` names the job-outcome subscription this context's jobs answer to, if any
    (``infra.wait.message_reply_to``). Its ``task-sent`` event, when they are on, goes out after it
    from a thread of its own (``infra.celery.SentEvents``). It is published with
    :func:`infra.celery.publish_options` and with its arguments' text for Flower made here
    (:func:`arguments_repr`)."""
    try:
        celery_app.send_task(
            task_name,
            kwargs=kwargs,
            countdown=countdown,
            producer=producer,
            retry=True,
            retry_policy=PUBLISH_RETRY_POLICY,
            reply_to=wait.message_reply_to(),
            event_dispatcher=sent_events,  # its task-sent event published after it, off this thread
            argsrepr="()",
            kwargsrepr=arguments_repr(kwargs),
            **publish_options(celery_app),
        )
    except Exception:
        log.warning("could not send task %s; the outbox relay will re-send it", task_name, exc_info=True)
        return False
    return True


def send_messages(messages: list[tuple[str, float | None, dict]]) -> None:
    """Send ``messages`` (``(task name, countdown, kwargs)``) now, back to back on one producer taken
    from the pool once (the jobs one transaction recorded start together: a payment method's rails
    reach the workers one publish apart). A message the broker did not take is logged and left to
    the outbox relay; so is every message when no producer can be had."""
    if not messages:
        return
    try:
        with celery_app.producer_or_acquire() as producer:
            for task_name, countdown, kwargs in messages:
                send_task(task_name, countdown=countdown, producer=producer, **kwargs)
    except Exception:
        log.warning("could not send %d tasks; the outbox relay will re-send them", len(messages), exc_info=True)


def arguments_repr(kwargs: dict[str, Any]) -> str:
    """The text of a task's keyword arguments that its message carries for Flower (the header
    ``kwargsrepr``): what Celery's ``saferepr`` gives, cut at the app's ``kwargsrepr_maxsize``
    characters (1,024). The arguments are ids (strings and lists of them), whose ``repr`` is that text
    unless it is longer than the limit; only then is ``saferepr``, about ten times slower, run."""
    text = repr(kwargs)
    limit = celery_app.amqp.kwargsrepr_maxsize
    if len(text) <= limit:
        return text
    return saferepr(kwargs, limit, maxlevels=celery_app.conf.task_repr_maxlevels)


def broadcast(command: str, **arguments) -> bool:
    """Send the remote-control ``command`` to every worker now (Celery's broadcast: every worker
    connected to the broker runs it). False (and a log line) when the broker did not take it, or
    has no fan-out (the embedded SQLite broker); callers keep a slower path for that case."""
    if celery_app.conf.broker_url.startswith("sqla+"):
        return False
    try:
        celery_app.control.broadcast(command, arguments=arguments)
    except Exception:
        log.warning("could not broadcast %s", command, exc_info=True)
        return False
    return True


def broadcast_after_commit(session: Session, command: str, **arguments) -> None:
    """:func:`broadcast` ``command`` once ``session``'s transaction commits (nothing on rollback)."""
    on_commit(session, lambda: broadcast(command, **arguments))
