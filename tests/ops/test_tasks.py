"""Task names read as the domain, and tasks take ids only (Flower shows their arguments)."""

from __future__ import annotations

import inspect
import re

from infra.celery import QUEUE_OF_MODULE, QUEUES, celery_app, queue_of

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
    # a recorded job, like every mail; jobs recorded together travel with their siblings' ids
    assert checked["mail.webhook_disabled"] == ["job_id", "sibling_ids"]


def test_task_names_start_with_their_module_and_route_by_the_one_table():
    for name, task in _platform_tasks().items():
        module = task.run.__module__ if task.run.__module__.startswith("tasks.") else type(task).__module__
        if not module.startswith("tasks."):
            continue
        assert module == f"tasks.{name.partition('.')[0]}", f"{name} is defined in {module}"
        assert queue_of(name) == QUEUE_OF_MODULE[module.removeprefix("tasks.")] in QUEUES
