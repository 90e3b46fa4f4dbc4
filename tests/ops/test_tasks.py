"""Task names read as the domain, and tasks take ids only (Flower shows their arguments)."""

from __future__ import annotations

import inspect
import re

from infra.celery import QUEUE_OF_FAMILY, celery_app

_ID_PARAMETER = re.compile(r"^[a-z_]+_ids?$")


def _platform_tasks() -> dict:
    celery_app.loader.import_default_modules()
    return {
        name: task
        for name, task in celery_app.tasks.items()
        if type(task).__module__.startswith(("tasks.", "workers.")) or task.run.__module__.startswith("tasks.")
    }


def test_tasks_are_named_family_dot_action():
    tasks = _platform_tasks()
    assert {"webhooks.deliver", "sweeps.relay_outbox"} <= set(tasks)
    for name in tasks:
        family, _, action = name.partition(".")
        assert re.fullmatch(r"[a-z_]+", family) and re.fullmatch(r"[a-z_]+", action), name


def test_tasks_take_ids_only():
    checked = {}
    for name, task in _platform_tasks().items():
        parameters = [p for p in inspect.signature(task.run).parameters.values() if p.name != "self"]
        for parameter in parameters:
            assert _ID_PARAMETER.match(parameter.name), f"{name} takes '{parameter.name}': tasks take ids only"
        checked[name] = [p.name for p in parameters]
    assert checked["webhooks.deliver"] == ["delivery_ids"]
    assert checked["mail.webhook_disabled"] == ["webhook_id"]


def test_every_family_routes_to_a_declared_queue():
    from infra.celery import QUEUES

    assert set(QUEUE_OF_FAMILY.values()) <= set(QUEUES)
