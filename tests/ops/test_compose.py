"""docker-compose.yml, checked without a Docker engine: every platform service runs a real
``tessera`` subcommand, every ``TESSERA_*`` variable is a real setting, PostgreSQL and Redis have
health checks that the platform's services wait on, and the api and workers share the metrics volume."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from config.settings import Settings
from tessera.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _platform_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == "tessera:latest" or "build" in s}


def test_every_platform_service_runs_a_real_tessera_subcommand(compose):
    services = _platform_services(compose)
    assert {"migrate", "api", "worker", "beat", "flower", "sandbox"} <= set(services)
    parser = build_parser()
    for name, service in services.items():
        command = service["command"]
        assert command[0] == "tessera", f"{name}: {command}"
        args, extra = parser.parse_known_args(command[1:])  # exits (fails the test) on an unknown command
        assert args.command == name, f"the {name} service runs `tessera {args.command}`"
        assert not extra or args.command in ("worker", "beat", "flower"), f"{name}: unknown options {extra}"
    assert services["flower"]["command"][1] == "flower"


def test_every_tessera_variable_is_a_setting(compose):
    known = {f"TESSERA_{name.upper()}" for name in Settings.model_fields}
    seen = set()
    for name, service in compose["services"].items():
        for variable in service.get("environment") or {}:
            if variable.startswith("TESSERA_"):
                assert variable in known, f"{name} sets {variable}, which is no setting"
                seen.add(variable)
    assert {"TESSERA_DATABASE_URL", "TESSERA_BROKER_URL", "TESSERA_FLOWER_PASSWORD", "TESSERA_METRICS_DIR"} <= seen


def test_services_wait_for_healthy_postgres_and_redis(compose):
    services = compose["services"]
    for store in ("postgres", "redis"):
        check = services[store].get("healthcheck")
        assert check and check["test"], f"{store} has no healthcheck"
    for name, service in _platform_services(compose).items():
        depends = service.get("depends_on") or {}
        for store in ("postgres", "redis"):
            assert depends.get(store, {}).get("condition") == "service_healthy", f"{name} does not wait for {store}"
    for name in ("api", "worker", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_api_and_workers_share_the_metrics_volume(compose):
    services = compose["services"]
    metrics_dir = services["api"]["environment"]["TESSERA_METRICS_DIR"]
    for name in ("api", "worker"):
        assert f"metrics:{metrics_dir}" in services[name]["volumes"], name
    assert "metrics" in compose["volumes"]
    # SIGTERM drains: the grace period outlasts the api's shutdown timeout and the task time limit.
    assert services["api"]["stop_grace_period"] == "35s"
    assert services["worker"]["stop_grace_period"] == "130s"
