"""``GET /metrics`` on the in-process api and worker: requests by route template and status, tasks
by name and outcome, webhook deliveries, queue depth and oldest waiting work, the outbox backlog,
provider calls; no tenant id, key or card data in any label."""

from __future__ import annotations

import datetime as dt
import uuid

from prometheus_client.parser import text_string_to_metric_families

from config.settings import get_settings
from infra import metrics, ops
from storage.db import session_scope
from storage.models import Event, Job, Webhook, WebhookDelivery
from tests.conftest import REDIS_PREFIX
from tests.helpers import wait_until
from tests.ops import probe

CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


def scrape(api) -> tuple[dict, str]:
    """The samples of ``GET /metrics`` as ``{(name, frozenset(labels)): value}`` and the raw text."""
    answer = api.client().get("/metrics")
    assert answer.status == 200, answer
    assert answer.headers["Content-Type"].startswith("text/plain; version=")
    text = answer.raw.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, text


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_requests_are_counted_by_route_template_and_status(api, tenant):
    missing = uuid.uuid4()
    assert tenant.client.get(f"/webhooks/{missing}").status == 404
    assert api.client().get(f"/no-such-path/{missing}").status == 404
    assert tenant.client.get("/webhooks").status == 200
    samples, text = scrape(api)
    assert value(samples, "tessera_http_requests_total", method="GET", route="/webhooks/{id}", status="404") >= 1
    assert value(samples, "tessera_http_requests_total", method="GET", route="unmatched", status="404") >= 1
    assert value(samples, "tessera_http_requests_total", method="GET", route="/webhooks", status="200") >= 1
    count = value(samples, "tessera_http_request_duration_seconds_count", method="GET", route="/webhooks", status="200")
    assert count >= 1
    # Never the raw path, a tenant id or a key.
    assert str(missing) not in text and "/no-such-path" not in text
    assert str(tenant.id) not in text and tenant.api_key not in text


def test_webhook_tasks_are_counted_timed_and_their_deliveries_by_outcome(api, tenant, receiver):
    before, _ = scrape(api)
    hook = tenant.client.post("/webhooks", {"name": "metrics", "url": receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook
    token = tenant.client.post("/tokenize", CARD)
    assert token.status == 201, token
    receiver.wait_for(lambda r: token.json["id"].encode() in r.body)

    def counted():
        samples, text = scrape(api)
        name, labels = "tessera_tasks_total", {"task": "webhooks.deliver", "outcome": "succeeded"}
        return (samples, text) if value(samples, name, **labels) > value(before, name, **labels) else None

    samples, text = wait_until(counted)
    name = "tessera_task_duration_seconds_count"
    assert value(samples, name, task="webhooks.deliver") > value(before, name, task="webhooks.deliver")
    name = "tessera_webhook_deliveries_total"
    assert value(samples, name, outcome="success") > value(before, name, outcome="success")
    assert "4242424242424242" not in text and token.json["id"] not in text


def test_job_retries_and_dead_letters_are_counted(worker):
    before, _ = scrape_local()
    probe.MODE["value"] = "transient"
    job = probe.record(max_attempts=2)
    wait_until(lambda: probe.read(job.id).status == "dead")
    after = wait_until(
        lambda: (
            (s := scrape_local()[0])
            and value(s, "tessera_task_failures_total", task=probe.KIND, reason="dead")
            > value(before, "tessera_task_failures_total", task=probe.KIND, reason="dead")
            and s
        )
    )
    assert (
        value(after, "tessera_task_retries_total", task=probe.KIND)
        >= value(before, "tessera_task_retries_total", task=probe.KIND) + 1
    )
    assert value(after, "tessera_tasks_total", task=probe.KIND, outcome="retrying") >= 1
    assert value(after, "tessera_tasks_total", task=probe.KIND, outcome="dead") >= 1
    assert value(after, "tessera_jobs", kind=probe.KIND, state="dead") >= 1


def scrape_local() -> tuple[dict, str]:
    """The exposition this process renders (the in-process api serves the same)."""
    body, _ = metrics.render(get_settings())
    text = body.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, text


def test_queue_depth_is_the_length_of_each_queues_redis_lists_under_the_prefix(redis_flushed):
    settings = get_settings().model_copy(update={"redis_key_prefix": f"{REDIS_PREFIX}depth:"})
    keys = ops.redis_queue_keys("files", settings.redis_key_prefix)
    assert keys[0] == f"{REDIS_PREFIX}depth:files"
    redis_flushed.lpush(keys[0], "a", "b")
    redis_flushed.lpush(keys[2], "c")  # priority 6
    elsewhere = f"{REDIS_PREFIX}other:files"  # (never the live queues: the session's worker reads them)
    redis_flushed.lpush(elsewhere, "not under this prefix")
    try:
        depths = ops.queue_depths(settings)
    finally:
        redis_flushed.delete(*keys, elsewhere)
    assert depths == {"default": 0, "webhooks": 0, "providers": 0, "files": 3, "mail": 0, "sweeps": 0, "reactors": 0}


def test_oldest_waiting_work_and_the_outbox_backlog_per_queue(api, tenant):
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        waiting = Job(kind="ops_probe.waiting", status="queued", due_at=now - dt.timedelta(seconds=90))
        held = Job(
            kind="network_tokens.ops_probe",
            status="queued",
            due_at=now - dt.timedelta(seconds=900),
            lease_owner="someone",
            lease_expires_at=now + dt.timedelta(seconds=60),
        )
        later = Job(kind="account_updater.ops_probe", status="queued", due_at=now + dt.timedelta(seconds=600))
        webhook = Webhook(tenant_id=tenant.id, name="oldest", url="https://example.com/h", events=["token.created"])
        event = Event(tenant_id=tenant.id, type="token.created", data={})
        session.add_all([waiting, held, later, webhook, event])
        session.flush()
        delivery_job = Job(
            kind="webhooks.deliver",
            tenant_id=tenant.id,
            subject_type="webhook",
            subject_id=str(webhook.id),
            status="queued",
            due_at=now - dt.timedelta(seconds=300),
        )
        session.add(delivery_job)
        session.flush()
        delivery = WebhookDelivery(id=delivery_job.id, tenant_id=tenant.id, webhook_id=webhook.id, event_id=event.id)
        session.add(delivery)
    try:
        samples, text = scrape(api)
        assert value(samples, "tessera_queue_oldest_age_seconds", queue="default") >= 90
        assert value(samples, "tessera_queue_oldest_age_seconds", queue="webhooks") >= 300
        assert value(samples, "tessera_queue_oldest_age_seconds", queue="providers") < 900  # leased: not waiting
        assert value(samples, "tessera_queue_due", queue="default") >= 1
        assert value(samples, "tessera_outbox_backlog", kind="job") >= 1
        assert value(samples, "tessera_outbox_backlog", kind="webhook_delivery") >= 1
        assert value(samples, "tessera_jobs", kind="ops_probe.waiting", state="queued") == 1
        for queue in ops.queue_names():
            assert ("tessera_queue_depth", frozenset({("queue", queue)})) in samples
        assert value(samples, "tessera_dependency_up", dependency="database") == 1
        assert value(samples, "tessera_dependency_up", dependency="broker") == 1
        assert str(tenant.id) not in text
    finally:
        with session_scope() as session:
            session.delete(session.get(WebhookDelivery, delivery.id))
            session.delete(session.get(Job, delivery_job.id))
            session.delete(session.get(Event, event.id))
            session.delete(session.get(Webhook, webhook.id))
            for job in (waiting, held, later):
                session.delete(session.get(Job, job.id))


def test_provider_calls_are_timed_by_provider_and_outcome(api):
    metrics.observe_provider_call("ops_probe_provider", "ok", 0.2)
    metrics.observe_provider_call("ops_probe_provider", "timeout", 5.0)
    samples, _ = scrape(api)
    name = "tessera_provider_call_duration_seconds"
    assert value(samples, f"{name}_count", provider="ops_probe_provider", outcome="ok") == 1
    assert value(samples, f"{name}_bucket", provider="ops_probe_provider", outcome="ok", le="0.25") == 1
    assert value(samples, f"{name}_sum", provider="ops_probe_provider", outcome="timeout") == 5.0


def test_queue_depth_on_the_embedded_broker(tmp_path):
    from infra.celery import create_app

    settings = get_settings().model_copy(update={"broker_url": None, "data_dir": tmp_path})
    assert settings.effective_broker_url.startswith("sqla+sqlite")
    assert set(ops.queue_depths(settings).values()) == {0}
    producer = create_app(settings)
    for _ in range(2):
        producer.send_task("webhooks.deliver", kwargs={"delivery_ids": []})
    assert ops.queue_depths(settings)["webhooks"] == 2
    ops.check_broker(settings)  # answers: no exception


def test_a_forked_child_names_its_series_after_its_own_pid():
    """The name of this process in the multiprocess files (host and pid) is made at import and again
    in a forked child, never asked of the kernel per update: a child's series are never written to
    its parent's file."""
    import os

    parent = metrics.process_identifier()
    assert parent.endswith(f"-{os.getpid()}") and "_" not in parent
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write, f"{os.getpid()} {metrics.process_identifier()}".encode())
        os._exit(0)
    os.close(write)
    pid, name = os.read(read, 200).decode().split()
    os.close(read)
    os.waitpid(child, 0)
    assert name.endswith(f"-{pid}") and name != parent
    assert metrics.process_identifier() == parent
