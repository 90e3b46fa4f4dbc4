"""Prometheus metrics: the series every process records and what ``GET /metrics`` serves.

Recorded where they happen:

* api: ``tessera_http_requests_total`` and ``tessera_http_request_duration_seconds`` by method, route
  template (the aiohttp resource's canonical path, never the raw path) and status;
* workers (Celery signals, ``workers/signals.py``): ``tessera_tasks_total`` by task name and outcome,
  ``tessera_task_duration_seconds``, ``tessera_task_retries_total``, ``tessera_task_failures_total``
  by reason, ``tessera_tasks_in_progress``, ``tessera_webhook_deliveries_total`` by outcome;
* provider adapters: ``tessera_provider_call_duration_seconds`` by provider and outcome
  (:func:`observe_provider_call`).

Read at scrape time (:class:`OpsCollector`, from ``infra/ops.py``): queue depth from the broker and the
age of the oldest due work from the database per queue, the outbox backlog, jobs by state, live
workers and the age of beat's heartbeat, and whether the database and the broker answered.

Processes share their series through prometheus-client's multiprocess mode: ``tessera api`` and
``tessera worker`` set ``PROMETHEUS_MULTIPROC_DIR`` to ``TESSERA_METRICS_DIR`` (default ``metrics/``
in the data dir) before this module is imported, each process writes its own files, and the api's
``/metrics`` adds them up. Without the variable (tests, an embedded app) the process's own registry
is served. Labels never hold a tenant id, a key or card data: only task, route, queue and provider
names, outcomes and statuses.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.core import GaugeMetricFamily

from infra import ops

log = logging.getLogger("tessera.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())


def process_identifier() -> str:
    """This process's name in the multiprocess files: host and pid (containers share a volume and
    each may have a pid 1), with no ``_`` (the file names are split on it). Asked on every update
    of a series (to notice a fork), so it asks the kernel nothing: made at import and again in a
    forked child (``os.register_at_fork``; ``os.getpid()`` is a system call, three a request)."""
    return _IDENTIFIER


def _name_this_process() -> None:
    global _IDENTIFIER
    _IDENTIFIER = f"{_HOST}-{os.getpid()}"


_IDENTIFIER = ""
_name_this_process()
os.register_at_fork(after_in_child=_name_this_process)


def multiprocess_dir() -> str | None:
    """The multiprocess folder of this process, or None when it keeps its series in memory."""
    return os.environ.get(MULTIPROC_ENV) or None


if multiprocess_dir():
    # Chosen before the first metric exists; see process_identifier for why not the bare pid.
    values.ValueClass = values.MultiProcessValue(process_identifier)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TASK_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

HTTP_REQUESTS = Counter("tessera_http_requests", "HTTP requests answered by the api.", ("method", "route", "status"))
HTTP_LATENCY = Histogram(
    "tessera_http_request_duration_seconds",
    "Time to answer an HTTP request.",
    ("method", "route", "status"),
    buckets=_LATENCY_BUCKETS,
)
TASKS = Counter("tessera_tasks", "Task runs finished, by task name and outcome.", ("task", "outcome"))
TASK_DURATION = Histogram(
    "tessera_task_duration_seconds", "Time a task run took, by task name.", ("task",), buckets=_TASK_BUCKETS
)
TASK_RETRIES = Counter("tessera_task_retries", "Task runs that ended in a retry, by task name.", ("task",))
TASK_FAILURES = Counter(
    "tessera_task_failures",
    "Task runs that failed, by task name and reason (permanent, dead: retries exhausted, exception).",
    ("task", "reason"),
)
TASKS_IN_PROGRESS = Gauge("tessera_tasks_in_progress", "Tasks running now.", ("task",), multiprocess_mode="livesum")
WEBHOOK_DELIVERIES = Counter("tessera_webhook_deliveries", "Webhook delivery attempts, by outcome.", ("outcome",))
PROVIDER_CALLS = Histogram(
    "tessera_provider_call_duration_seconds",
    "Calls to external providers, by provider and outcome.",
    ("provider", "outcome"),
    buckets=_LATENCY_BUCKETS,
)

#: Outcomes a job task returns (``infra/task.py``) that the task metrics tell apart.
JOB_OUTCOMES = frozenset({"succeeded", "retrying", "dead", "failed", "skipped"})
_UNMATCHED = "unmatched"


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def observe_request(method: str, route: str | None, status: int, seconds: float) -> None:
    """Count one answered request under its route template (``unmatched`` when no route matched;
    methods outside the usual ones as ``other``: a client must not be able to mint label values)."""
    labels = (method if method in _METHODS else "other", route or _UNMATCHED, status)
    series = _REQUEST_SERIES.get(labels)
    if series is None:  # a few dozen label sets (routes x methods x statuses); looked up once each
        text = (*labels[:2], str(status))
        series = _REQUEST_SERIES[labels] = (HTTP_REQUESTS.labels(*text), HTTP_LATENCY.labels(*text))
    series[0].inc()
    series[1].observe(seconds)


#: (method, route, status) -> the request counter's and the latency histogram's series.
_REQUEST_SERIES: dict[tuple[str, str, int], tuple] = {}


def observe_provider_call(provider: str, outcome: str, seconds: float) -> None:
    """Record one provider call: ``provider`` is the adapter's name (``card_network``, ``vic``...),
    ``outcome`` a word such as ``ok``, ``client_error``, ``server_error``, ``timeout``,
    ``unreachable``; never an id or a message."""
    PROVIDER_CALLS.labels(provider, outcome).observe(seconds)


def task_started(task: str) -> None:
    """A task run began (paired with :func:`task_finished`)."""
    TASKS_IN_PROGRESS.labels(task).inc()


def task_finished(task: str, outcome: str, seconds: float | None) -> None:
    """A task run ended with ``outcome`` (a job status, ``succeeded``, ``retrying`` or ``error``)."""
    TASKS_IN_PROGRESS.labels(task).dec()
    TASKS.labels(task, outcome).inc()
    if seconds is not None:
        TASK_DURATION.labels(task).observe(seconds)
    if outcome == "retrying":
        TASK_RETRIES.labels(task).inc()
    elif outcome in ("failed", "dead", "error"):
        TASK_FAILURES.labels(task, {"failed": "permanent", "error": "exception"}.get(outcome, outcome)).inc()


def webhook_outcomes(counts: dict) -> None:
    """Count the outcome of each delivery attempt a ``webhooks.deliver`` run made."""
    for outcome, count in counts.items():
        if isinstance(outcome, str) and isinstance(count, int) and count > 0:
            WEBHOOK_DELIVERIES.labels(outcome).inc(count)


class OpsCollector:
    """Series read when scraped: queues, the outbox backlog, jobs by state, workers, beat."""

    def __init__(self, settings) -> None:
        self.settings = settings

    def collect(self):
        """Yield the scrape-time metric families (each source may fail on its own)."""
        up = GaugeMetricFamily(
            "tessera_dependency_up", "Whether a dependency answered during this scrape.", labels=("dependency",)
        )
        started = time.monotonic()
        try:
            depths = ops.queue_depths(self.settings)
            broker_up = 1
        except Exception:
            log.warning("queue depth unavailable: the broker did not answer", exc_info=True)
            depths, broker_up = {}, 0
        up.add_metric(["broker"], broker_up)
        depth = GaugeMetricFamily(
            "tessera_queue_depth", "Messages waiting in the broker, per queue.", labels=("queue",)
        )
        for queue, size in depths.items():
            if size is not None:
                depth.add_metric([queue], size)
        yield depth

        try:
            waiting = ops.waiting_work()
            jobs = ops.jobs_by_state()
            database_up = 1
        except Exception:
            log.warning("job metrics unavailable: the database did not answer", exc_info=True)
            waiting, jobs, database_up = None, {}, 0
        up.add_metric(["database"], database_up)
        if waiting is not None:
            oldest = GaugeMetricFamily(
                "tessera_queue_oldest_age_seconds",
                "Age of the oldest due, unleased job or webhook delivery, per queue (0 when none waits).",
                labels=("queue",),
            )
            due = GaugeMetricFamily(
                "tessera_queue_due", "Due, unleased jobs and webhook deliveries, per queue.", labels=("queue",)
            )
            for queue in ops.queue_names():
                entry = waiting.queues.get(queue)
                oldest.add_metric([queue], entry.oldest_age_seconds if entry else 0.0)
                due.add_metric([queue], entry.count if entry else 0)
            yield oldest
            yield due
            backlog = GaugeMetricFamily(
                "tessera_outbox_backlog",
                "Recorded work due and not taken by a worker: queued jobs and pending webhook deliveries.",
                labels=("kind",),
            )
            backlog.add_metric(["job"], waiting.jobs)
            backlog.add_metric(["webhook_delivery"], waiting.deliveries)
            yield backlog
        states = GaugeMetricFamily(
            "tessera_jobs", "Jobs not finished, and dead letters, by kind and state.", labels=("kind", "state")
        )
        for (kind, state), count in sorted(jobs.items()):
            states.add_metric([kind, state], count)
        yield states

        try:
            beats = ops.heartbeats(self.settings)
        except Exception:  # noqa: BLE001
            beats = {}
        now = time.time()
        workers = GaugeMetricFamily("tessera_workers_alive", "Workers whose heartbeat is recent.")
        workers.add_metric([], sum(1 for b in beats.values() if b.kind == "worker" and b.alive(now)))
        yield workers
        beat_age = GaugeMetricFamily(
            "tessera_heartbeat_age_seconds",
            "Seconds since beat last sent a scheduled task (beat) and since the outbox relay last ran (relay).",
            labels=("component",),
        )
        for name in ("beat", "relay"):
            if name in beats:
                beat_age.add_metric([name], max(0.0, now - beats[name].at))
        yield beat_age
        yield up
        scrape = GaugeMetricFamily("tessera_ops_scrape_duration_seconds", "Time to read the scrape-time series.")
        scrape.add_metric([], time.monotonic() - started)
        yield scrape


class _ProcessRegistry:
    """The in-memory default registry of this process, as one collector."""

    def collect(self):
        return REGISTRY.collect()


def render(settings) -> tuple[bytes, str]:
    """The Prometheus text exposition of every series: ``(body, content type)``. Blocking (it reads
    the database, the broker and the multiprocess files): run it off the event loop."""
    registry = CollectorRegistry(auto_describe=False)
    path = multiprocess_dir()
    if path and os.path.isdir(path):
        from prometheus_client.multiprocess import MultiProcessCollector

        MultiProcessCollector(registry, path=path)
    else:
        registry.register(_ProcessRegistry())
    registry.register(OpsCollector(settings))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_process_dead() -> None:
    """Drop this process's live gauges from the multiprocess files (at process exit)."""
    path = multiprocess_dir()
    if path:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process_identifier(), path)
