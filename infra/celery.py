"""The configured Celery application every process shares: broker, queues, routing, reliability settings.

Reliability rules (``ARCHITECTURE.md``): late acknowledgement with reject on worker loss, prefetch of
one, a time limit on every task, a Redis visibility timeout longer than the longest task, task
events for Flower, results in the database (no result backend), arguments that are ids only.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
import time
from typing import Any

from celery import Celery, signals
from celery.events import Event
from celery.utils.time import utcoffset
from celery.worker.consumer import Consumer
from kombu import Exchange, Queue

from config.settings import Settings, get_settings
from infra import broker_transport, logs
from infra.redis_clients import broker_transport_options

_log = logging.getLogger("tessera.celery")

#: Message headers that carry the producer's log context to the worker.
TRACE_HEADER = "tessera_trace_id"
TENANT_HEADER = "tessera_tenant_id"
#: The task that delivers webhook events (a batch of delivery ids a message).
DELIVER_TASK = "webhooks.deliver"

#: The one routing table: the queue of each module of ``tasks/``. A task's dotted name starts with
#: its module's name (``tasks/mail.py`` holds the ``mail.*`` tasks), so a task's queue follows from its
#: name; beat's periodic sweeps all run on ``sweeps`` (``beat_schedule.py``), whatever their module.
QUEUE_OF_MODULE = {
    "webhooks": "webhooks",
    "mail": "mail",
    "sweeps": "sweeps",
    "tenancy": "sweeps",
    "client_keys": "sweeps",
    "network_tokens": "providers",
    "agentic": "providers",
    "account_updater": "files",
    "documents": "files",
    "wallets": "providers",
    "enrichments": "providers",
    "reactors": "reactors",
    "keys": "files",
}
#: The queue of beat's periodic tasks.
SWEEPS_QUEUE = "sweeps"
#: Queues of the platform: the table's, and ``default`` for a name outside it.
QUEUES = ("default", *sorted(set(QUEUE_OF_MODULE.values())))

#: Broker URL schemes of RabbitMQ.
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")


def publish_options(app: Celery) -> dict[str, Any]:
    """Options a task message of ``app`` is published with on its broker, beside Celery's.

    On Redis and the embedded SQLAlchemy transport the queues' exchanges are direct, and Celery
    publishes such a message through the anonymous exchange straight to the queue named by its
    routing key: no declaration is needed to deliver it, so none is made (``declare=[]``). kombu's
    declaration, though cached per connection, still copied and bound the queue on every publish:
    about a quarter of a task message's CPU (``benchmarks/README.md``). Workers declare their
    queues when they start. On RabbitMQ a message routed to a queue that does not exist yet is
    dropped, so there each connection declares the queue on its first publish, as Celery does by
    default (no options)."""
    if str(app.conf.broker_url or "").startswith(AMQP_SCHEMES):
        return {}
    return {"declare": []}


#: Periodic tasks whose runs send no task events: beat runs them every few seconds or minutes, and
#: their runs would fill Flower's history (bounded) with sweeps that found nothing. The worker side
#: (``workers/celery_app.py``) fills it from beat's schedule; the tasks' log lines stay.
QUIET_TASKS: set[str] = set()


#: Seconds a worker keeps the task events it buffered before publishing them (one ``task.multi``
#: message a flush). Celery flushes on the next turn of the event loop after each event: about three
#: publishes a job (received, started, succeeded), each 0.3-0.9 ms of the consumer thread holding
#: the GIL while the job's own thread leases and calls its provider. Batched, a job's events cost a
#: fraction of one publish, and Flower sees them at most this much later. A producer's ``task-sent``
#: events are batched over the same while (:class:`SentEvents`).
EVENT_FLUSH_SECONDS = 0.1
#: How a publish of the platform's (a task's message, a batch of ``task-sent`` events) is retried
#: when the broker does not take it (kombu's ``retry_policy``); then it is given up (a task's message
#: is left to the outbox relay, events are dropped).
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


class EventBatchingConsumer(Consumer):
    """The worker's consumer (``worker_consumer``) on a Redis broker, publishing its buffered task events once per
    :data:`EVENT_FLUSH_SECONDS` rather than after each event. Celery's own flush of a buffer holding
    ``buffer_limit`` (24) events still applies, and the buffer is flushed at shutdown. A flush timer
    that never fired (the event loop cancels the timers of a broken connection) is armed again by
    the next event a second after it was due."""

    _flush_due: float | None = None  # time.monotonic() of the armed flush

    def _unarmed(self) -> bool:
        """No flush is armed, or the armed one is a second overdue (its timer was cancelled)."""
        due = self._flush_due
        return bool(self.hub) and (due is None or time.monotonic() > due + 1.0)

    def on_send_event_buffered(self) -> None:
        """An event was buffered (by any thread): the event loop arms the flush timer if it is not."""
        if self._unarmed():
            self.hub.call_soon(self._arm_flush)

    def _arm_flush(self) -> None:
        if self._unarmed():
            self._flush_due = time.monotonic() + EVENT_FLUSH_SECONDS
            self.hub.call_later(EVENT_FLUSH_SECONDS, self._flush_buffered)

    def _flush_buffered(self) -> None:
        self._flush_due = None
        self._flush_events()

    def shutdown(self) -> None:
        """Publish what is buffered, then shut down as Celery does."""
        self._flush_events()
        super().shutdown()


class SentEvents:
    """Celery's ``task-sent`` events of this process, published by a thread of their own, a batch at
    a time: the sender (a request waiting for its job) goes on once its message is out, and the
    events of the sends of :data:`EVENT_FLUSH_SECONDS` go out as one message, as the worker's own
    task events do (:class:`EventBatchingConsumer`): Celery's group form ``task.multi`` (a list of
    events), which Celery's event receivers, Flower's among them, take apart. Given to Celery as a
    send's ``event_dispatcher`` (Celery calls :meth:`publish` once the task's message is out), each
    event is made then, with the time of the send as its ``timestamp`` and the process's clock; so
    Flower shows a queued task at most :data:`EVENT_FLUSH_SECONDS` (and one publish) after its send.
    One publish instead of one per send: about 0.4 ms of the sender's CPU per message
    (``benchmarks/broker_publish.py``), spent beside the request's commit and its job's worker on the
    same cores. A process forked from this one starts a thread of its own on its first event, and
    drops its parent's queue. What could not be published is logged and dropped (events are
    monitoring: a task never waits for one); what is queued at exit is published then."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._held: list[dict[str, Any]] = []  # the event the thread took, until it publishes it

    def publish(self, event_type: str, fields: dict[str, Any], producer: Any, **_: Any) -> None:
        """Queue the event ``event_type`` (``task-sent``) with ``fields`` (Celery's: the task's id, name,
        arguments, queue ...) for the thread; ``producer`` (the message's) and the message's retry
        options are not used (the batch has its own, :data:`PUBLISH_RETRY_POLICY`)."""
        dispatcher = self._dispatcher
        event = Event(
            event_type,
            hostname=dispatcher.hostname,
            utcoffset=utcoffset(),
            pid=dispatcher.pid,
            clock=dispatcher.clock.forward(),
            **fields,
        )
        self._started().put(event)

    def _started(self) -> queue.SimpleQueue[dict[str, Any]]:
        """This process's queue, its thread started on the first event."""
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    self._queue = queue.SimpleQueue()  # a parent's events are its own to publish
                    self._held = []
                    threading.Thread(target=self._publish_forever, name="tessera-sent-events", daemon=True).start()
                    if self._pid is None:
                        atexit.register(self.flush)
                    self._pid = pid
        return self._queue

    @functools.cached_property
    def _dispatcher(self) -> Any:
        """Celery's event dispatcher, not enabled: the events' host name, pid, clock, exchange and
        serializer (it publishes nothing itself)."""
        return self._app.events.Dispatcher(enabled=False)

    def _publish_forever(self) -> None:
        while True:
            self._held = [self._queue.get()]  # a flush at exit publishes it while this waits
            time.sleep(EVENT_FLUSH_SECONDS)  # the sends of this while go in the same message
            held, self._held = self._held, []
            self._publish(held)

    def flush(self) -> None:
        """Publish what is queued now, and what the thread holds, on the calling thread."""
        held, self._held = self._held, []
        self._publish(held)

    def _publish(self, events: list[dict[str, Any]]) -> None:
        """Publish ``events`` and whatever else is queued as one ``task.multi`` message."""
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if not events:
            return
        dispatcher = self._dispatcher
        try:
            with self._app.producer_or_acquire() as producer:
                producer.publish(
                    events,
                    routing_key="task.multi",
                    exchange=dispatcher.exchange.name,
                    declare=[dispatcher.exchange],
                    serializer=dispatcher.serializer,
                    headers=dispatcher.headers,
                    delivery_mode=dispatcher.delivery_mode,
                    retry=True,
                    retry_policy=PUBLISH_RETRY_POLICY,
                )
        except Exception:  # noqa: BLE001 - events are monitoring: the thread goes on, the events are dropped
            _log.warning("could not publish %d task-sent events", len(events), exc_info=True)


def queue_of(task_name: str) -> str:
    """The queue task ``task_name`` is routed to (:data:`QUEUE_OF_MODULE`; ``default`` otherwise)."""
    return QUEUE_OF_MODULE.get(task_name.split(".", 1)[0], "default")


def configure(app: Celery, settings: Settings) -> None:
    """Apply the platform's configuration for ``settings`` to ``app``."""
    url = settings.effective_broker_url
    embedded = url.startswith("sqla+")
    amqp = url.startswith(AMQP_SCHEMES)
    broker_transport.register()  # Redis channels that keep their client (infra/broker_transport.py)
    app.conf.update(
        broker_url=url,
        broker_connection_retry_on_startup=True,
        broker_transport_options=_transport_options(settings, embedded=embedded, amqp=amqp),
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        task_time_limit=settings.task_time_limit_seconds,
        task_soft_time_limit=max(1, settings.task_time_limit_seconds - 10),
        # The SQLAlchemy transport of the embedded default has no fan-out exchange for events.
        worker_send_task_events=not embedded,
        task_send_sent_event=settings.task_sent_events and not embedded,
        task_default_queue="default",
        task_queues=[_queue(name, amqp=amqp) for name in QUEUES],
        # Batched task events on Redis; Celery's own consumer on RabbitMQ, where the batching
        # consumer's flush timer left the test worker unable to run jobs (seen on a 2-core machine).
        worker_consumer="celery.worker.consumer:Consumer" if amqp else f"{__name__}:EventBatchingConsumer",
        task_routes=(_route,),
        worker_hijack_root_logger=False,
        timezone="UTC",
        enable_utc=True,
        imports=tuple(f"tasks.{module}" for module in QUEUE_OF_MODULE),
    )
    if settings.worker_concurrency:
        app.conf.worker_concurrency = settings.worker_concurrency


def _transport_options(settings: Settings, *, embedded: bool, amqp: bool) -> dict[str, object]:
    """The broker transport's options: none for kombu's SQLAlchemy transport (it hands them to
    ``create_engine``); publisher confirms on RabbitMQ (a message is sent once the broker has it);
    on Redis the visibility timeout (longer than any task) and the deployment's key prefix, and behind
    Redis Sentinel (``sentinel://``) the master's name and the sentinels' password."""
    if embedded:
        return {}
    if amqp:
        return {"confirm_publish": True}
    return {
        "visibility_timeout": max(3600, settings.task_time_limit_seconds * 4),
        "global_keyprefix": settings.redis_key_prefix,
        **broker_transport_options(settings),
    }


def _queue(name: str, *, amqp: bool) -> Queue:
    """Queue ``name`` behind an exchange of its own. On RabbitMQ a quorum queue (replicated, durable)
    behind a topic exchange, which Celery's native delayed delivery needs for countdowns on quorum
    queues (global QoS is then turned off by Celery's quorum-queue detection)."""
    if amqp:
        return Queue(name, Exchange(name, type="topic"), routing_key=name, queue_arguments={"x-queue-type": "quorum"})
    return Queue(name, Exchange(name), routing_key=name)


def _route(name: str, args, kwargs, options, task=None, **kw):
    return {"queue": queue_of(name)}


def create_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured for ``settings`` (default: the process settings)."""
    app = Celery("tessera")
    configure(app, settings or get_settings())
    return app


celery_app = create_app()
#: This process's ``task-sent`` events (:class:`SentEvents`), for :func:`infra.dispatch.send_task`.
sent_events = SentEvents(celery_app)


@signals.before_task_publish.connect
def _propagate_context(headers=None, **_kwargs) -> None:
    """Carry the caller's trace and tenant ids to the worker in the message headers (every producer:
    the api, the CLI, tasks and beat)."""
    if headers is None:
        return
    context = logs.current_context()
    for key, header in (("trace_id", TRACE_HEADER), ("tenant_id", TENANT_HEADER)):
        if context.get(key) is not None and header not in headers:
            headers[header] = str(context[key])
