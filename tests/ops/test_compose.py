"""docker-compose.yml, checked without a Docker engine: the file is valid against the Compose
specification's JSON schema (``tests/ops/data/compose-spec.json``, as shipped in docker-compose 1.29.2,
Apache-2.0, licence beside it); every platform service runs a real ``tessera`` subcommand from one
image built once, every ``TESSERA_*`` variable is a real setting, the stores have health checks the
platform's services wait on, their data lives in named volumes, and the api and workers share the
metrics volume."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from config.settings import Settings
from tessera.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path(__file__).with_name("data") / "compose-spec.json"


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
        expected = "worker" if name == "reactors" else name  # customer code: a worker of its own
        assert args.command == expected, f"the {name} service runs `tessera {args.command}`"
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


def test_the_file_is_valid_against_the_compose_specification_schema(compose):
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors] == []
    # The schema does catch a mistake: an unknown service key and a malformed healthcheck.
    broken = {**compose, "services": {**compose["services"], "api": {**compose["services"]["api"], "comand": []}}}
    assert any("comand" in e.message for e in validator.iter_errors(broken))
    broken["services"]["redis"] = {**compose["services"]["redis"], "healthcheck": {"interval": 5}}
    assert list(validator.iter_errors(broken))


def test_one_image_built_once_runs_every_platform_service(compose):
    services = _platform_services(compose)
    built = [name for name, service in services.items() if "build" in service]
    assert built == ["migrate"], built
    assert {service["image"] for service in services.values()} == {"tessera:latest"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in packages["include"]:
        name = package.rstrip("*")
        assert f"COPY {name} {name}" in dockerfile, f"the image lacks the {name} package"
    assert "COPY beat_schedule.py" in dockerfile or "beat_schedule.py ./" in dockerfile


def test_the_stores_are_real_servers_with_named_volumes(compose):
    services = compose["services"]
    env = services["api"]["environment"]
    assert "moto" not in services["s3"]["image"]
    assert env["TESSERA_S3_ENDPOINT_URL"] == "http://s3:9000"
    # Pre-signed URLs are signed for an address reachable from outside the compose network.
    public = env["TESSERA_S3_PUBLIC_ENDPOINT_URL"]
    assert "localhost:9000" in public and "9000:9000" in services["s3"]["ports"]
    assert env["TESSERA_SMTP_URL"] == "smtp://mailpit:1025" and "mailpit" in services["mailpit"]["image"]
    assert "8025:8025" in services["mailpit"]["ports"]  # its web UI
    for store, folder in (("postgres", "/var/lib/postgresql/data"), ("redis", "/data"), ("s3", "/data")):
        mounts = [m.split(":") for m in services[store]["volumes"]]
        assert any(path == folder and volume in compose["volumes"] for volume, path in mounts), store
        assert services[store]["healthcheck"]["test"], store
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    for name, service in _platform_services(compose).items():
        if name == "reactors":  # customer code has no business with files or mail
            assert not {"s3", "mailpit"} & set(service["depends_on"])
            continue
        for dependency in ("s3", "mailpit"):
            assert service["depends_on"][dependency]["condition"] == "service_healthy", (name, dependency)


def test_the_api_runs_several_processes(compose):
    args = build_parser().parse_args(compose["services"]["api"]["command"][1:])
    assert args.workers >= 2


def test_customer_code_runs_in_a_service_of_its_own_with_no_route_to_the_stores(compose):
    services, networks = compose["services"], compose["networks"]
    reactors = services["reactors"]
    assert reactors["command"][1:4] == ["worker", "-Q", "reactors"]
    assert services["worker"]["command"][1:] == ["worker", "-X", "reactors"]  # the platform's worker runs none
    # the stores sit on internal networks; the reactors service is on the broker's and database's
    # (the worker needs them: the code inside its sandboxes has no network at all) and on egress
    assert services["postgres"]["networks"] == ["data"] and services["redis"]["networks"] == ["data"]
    assert "files" not in reactors["networks"] and "front" not in reactors["networks"]
    assert set(services["s3"]["networks"]) == {"files", "front"}
    assert networks["data"]["internal"] is True and networks["files"]["internal"] is True
    assert "egress" in reactors["networks"] and not networks["egress"].get("internal")
    assert reactors["cap_drop"] == ["ALL"]
    assert {"no-new-privileges:true", "seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"} == set(
        reactors["security_opt"])
    text = (ROOT / "docker-compose.yml").read_text()
    for option in ("seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"):
        assert f"* {option}:" in text, f"{option} is not explained"
    assert "bubblewrap" in (ROOT / "Dockerfile").read_text()


def test_every_secret_is_a_required_variable_without_a_literal_default(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    for variable in ("TESSERA_MASTER_KEY", "POSTGRES_PASSWORD", "REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY",
                     "TESSERA_FLOWER_PASSWORD"):
        uses = [line for line in text.splitlines() if "${" + variable in line]
        assert uses, variable
        assert all("${" + variable + ":?" in line for line in uses), (variable, uses)
    env = compose["services"]["api"]["environment"]
    assert "${POSTGRES_PASSWORD:?" in env["TESSERA_DATABASE_URL"] and "tessera:tessera@" not in text
    assert "${REDIS_PASSWORD:?" in env["TESSERA_BROKER_URL"] and "${REDIS_PASSWORD:?" in env["TESSERA_REDIS_URL"]
    assert "--requirepass" in compose["services"]["redis"]["command"]
