"""docker-compose.yml, checked without a Docker engine: the file is valid against the Compose
specification's JSON schema (``tests/ops/data/compose-spec.json``, as shipped in docker-compose 1.29.2,
Apache-2.0, licence beside it); every platform service runs a real ``tessera`` subcommand from one
image built once, every ``TESSERA_*`` variable is a real setting, the stores have health checks the
platform's services wait on, their data lives in named volumes, and the api and workers share the
metrics volume."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from config.settings import FILE_SETTINGS, Settings, file_variable
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
    from_file = {file_variable(name): f"TESSERA_{name.upper()}" for name in FILE_SETTINGS}
    seen = set()
    for name, service in compose["services"].items():
        for variable in service.get("environment") or {}:
            if variable.startswith("TESSERA_"):
                variable = from_file.get(variable, variable)  # TESSERA_<NAME>_FILE sets TESSERA_<NAME>
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
    # Pre-signed URLs are signed for an address reachable from outside the compose network: the S3
    # server's name on the TLS proxy.
    public = env["TESSERA_S3_PUBLIC_ENDPOINT_URL"]
    assert public == "${TESSERA_S3_PUBLIC_ENDPOINT_URL:-https://s3.localhost}"
    assert services["s3"]["ports"] == ["127.0.0.1:9000:9000"]
    # Mail goes where the operator says: a secret file (the URL may carry the mail server's password)
    # the worker reads; Mailpit, the URL make-secrets.sh writes unless told another, is the dev profile's.
    assert "TESSERA_SMTP_URL" not in env and "mailpit" in services["mailpit"]["image"]
    assert services["worker"]["environment"]["TESSERA_SMTP_URL_FILE"] == "/run/secrets/smtp_url"
    assert "127.0.0.1:8025:8025" in services["mailpit"]["ports"]  # its web UI
    for store, folder in (("postgres", "/var/lib/postgresql/data"), ("redis", "/data"), ("s3", "/data")):
        mounts = [m.split(":") for m in services[store]["volumes"]]
        assert any(path == folder and volume in compose["volumes"] for volume, path in mounts), store
        assert services[store]["healthcheck"]["test"], store
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    for name, service in _platform_services(compose).items():
        if name == "reactors":  # customer code has no business with files or mail
            assert not {"s3", "mailpit"} & set(service["depends_on"])
            continue
        assert service["depends_on"]["s3"]["condition"] == "service_healthy", name
        assert "mailpit" not in service["depends_on"], f"{name} needs the dev profile's Mailpit"


def test_the_api_runs_several_processes(compose):
    args = build_parser().parse_args(compose["services"]["api"]["command"][1:])
    workers = args.workers or int(compose["services"]["api"]["environment"]["TESSERA_API_WORKERS"].split(":-")[1][:-1])
    assert workers >= 2


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
        reactors["security_opt"]
    )
    text = (ROOT / "docker-compose.yml").read_text()
    for option in ("seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"):
        assert f"* {option}:" in text, f"{option} is not explained"
    assert "bubblewrap" in (ROOT / "Dockerfile").read_text()


SEALED_ROLES = ("api", "worker", "reactors", "beat")


def test_every_secret_is_a_file_given_only_to_the_services_that_need_it(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    # no secret in the environment or on a command line, no literal password or default
    for variable in (
        "TESSERA_MASTER_KEY",
        "POSTGRES_PASSWORD",
        "REDIS_PASSWORD",
        "S3_ACCESS_KEY",
        "S3_SECRET_KEY",
        "TESSERA_FLOWER_PASSWORD",
        "MINIO_ROOT_PASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
    ):
        assert not re.search(rf"\b{variable}\s*:", text), variable
        assert "${" + variable not in text, variable
    assert "tessera:tessera@" not in text and "--requirepass" not in text
    secrets = compose["secrets"]
    for name, secret in secrets.items():
        assert set(secret) == {"file"} and secret["file"] == f"./secrets/{name}", name
    services = compose["services"]

    def given(service: str) -> set[str]:
        return set(services[service].get("secrets") or ())

    for role in SEALED_ROLES:
        assert {"master_key", "database_url", "broker_url", "redis_url"} <= given(role), role
        env = services[role]["environment"]
        assert env["TESSERA_MASTER_KEY_FILE"] == "/run/secrets/master_key", role
    for role in ("sandbox", "flower", "migrate", "postgres", "redis", "s3", "mailpit"):
        assert "master_key" not in given(role), f"{role} gets the master key"
        assert "TESSERA_MASTER_KEY_FILE" not in (services[role].get("environment") or {}), role
    assert given("sandbox") == set() and given("flower") == {"broker_url", "redis_sentinel_password", "flower_password"}
    assert given("migrate") == {"database_url"} and "aws_credentials" not in given("reactors")
    # the mail server's URL (and password) only to the worker, which sends the mail
    assert {name for name in services if "smtp_url" in given(name)} == {"worker"}
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert services["s3"]["environment"]["MINIO_ROOT_PASSWORD_FILE"] == "/run/secrets/s3_secret_key"
    assert services["redis"]["command"][1] == "/run/secrets/redis.conf"
    # every file a service reads from /run/secrets is a secret that service is given
    for name, service in services.items():
        mentioned = set(re.findall(r"/run/secrets/([\w.]+)", json.dumps(service)))
        assert mentioned <= given(name), (name, mentioned - given(name))
        assert given(name) <= set(secrets), name


def test_the_secrets_script_writes_every_secret_once(compose, tmp_path):
    folder = tmp_path / "secrets"
    subprocess.run(["sh", str(ROOT / "scripts" / "make-secrets.sh"), str(folder)], check=True, capture_output=True)
    assert {p.name for p in folder.iterdir()} == set(compose["secrets"])
    assert folder.stat().st_mode & 0o077 == 0  # only the operator on the host
    key = (folder / "master_key").read_text()
    assert len(base64.b64decode(key.strip(), validate=True)) == 32
    password = (folder / "postgres_password").read_text().strip()
    assert f":{password}@postgres:5432/" in (folder / "database_url").read_text()
    redis = (folder / "redis_password").read_text().strip()
    assert (folder / "redis.conf").read_text() == f"requirepass {redis}\n"
    assert f"redis://:{redis}@redis:6379/0" == (folder / "broker_url").read_text().strip()
    credentials = (folder / "aws_credentials").read_text()
    assert (folder / "s3_secret_key").read_text().strip() in credentials and "[default]" in credentials
    assert (folder / "smtp_url").read_text() == "smtp://mailpit:1025\n"  # the dev profile's, unless told
    other = tmp_path / "other"
    subprocess.run(
        ["sh", str(ROOT / "scripts" / "make-secrets.sh"), str(other)],
        check=True,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "TESSERA_SMTP_URL": "smtps://mailer:s3cret@mail.example.com:465"},
    )
    assert (other / "smtp_url").read_text() == "smtps://mailer:s3cret@mail.example.com:465\n"
    # run again: nothing is replaced (a new master key over the same database opens nothing)
    result = subprocess.run(
        ["sh", str(ROOT / "scripts" / "make-secrets.sh"), str(folder)], check=True, capture_output=True, text=True
    )
    assert (folder / "master_key").read_text() == key and "wrote" not in result.stdout
    # the platform reads them as written
    env = {file_variable(n): str(folder / n) for n in ("master_key", "database_url", "broker_url", "redis_url")}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from config.settings import Settings; s = Settings(); "
            "print(len(s.master_key.get_secret_value()), s.database_url.split('@')[1], s.broker_url.split('@')[1])",
        ],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.split() == ["44", "postgres:5432/tessera", "redis:6379/0"], probe.stderr


def _published(service: dict) -> list[str]:
    return [str(port) for port in service.get("ports") or ()]


def test_only_the_tls_proxy_publishes_beyond_loopback(compose):
    for name, service in compose["services"].items():
        if name == "proxy":
            continue
        for port in _published(service):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert set(_published(compose["services"]["proxy"])) >= {"80:80", "443:443"}


def test_mailpit_and_the_minio_console_only_in_the_dev_profile(compose):
    services = compose["services"]
    for name in ("mailpit", "s3-console"):
        assert services[name]["profiles"] == ["dev"], name
    assert not any("9001" in port for port in _published(services["s3"]))
    assert services["s3-console"]["ports"] == ["127.0.0.1:9001:9001"]
    for name, service in services.items():
        if name not in ("mailpit", "s3-console"):
            assert "profiles" not in service, f"{name} would not start by default"


def test_the_tls_proxy_fronts_the_api_flower_and_s3(compose):
    proxy = compose["services"]["proxy"]
    assert re.fullmatch(r"caddy:\d+\.\d+\.\d+", proxy["image"]), proxy["image"]  # an exact version
    mount = next(v for v in proxy["volumes"] if v.endswith(":/etc/caddy/Caddyfile:ro"))
    caddyfile = (ROOT / mount.split(":")[0]).read_text()
    sites = dict(re.findall(r"^\{\$(\w+_DOMAIN):[\w.]+\} \{\n(?:.*\n)*?\treverse_proxy (\S+)\n", caddyfile, re.M))
    assert sites == {"API_DOMAIN": "api:8080", "FLOWER_DOMAIN": "flower:5555", "S3_DOMAIN": "s3:9000"}, sites
    assert set(sites) <= set(proxy["environment"])
    assert "ACME" in caddyfile and "tls /certs/" in caddyfile  # the certificate source is documented
    # GET /metrics answers without an API key: never through the proxy (Prometheus scrapes api:8080)
    api_site = re.search(r"^\{\$API_DOMAIN:[\w.]+\} \{\n(.*?)^\}", caddyfile, re.M | re.S).group(1)
    assert "\trespond /metrics 404\n" in api_site
    assert "caddy_data:/data" in proxy["volumes"] and "caddy_data" in compose["volumes"]
    for upstream in ("api", "flower", "s3"):
        assert "front" in compose["services"][upstream]["networks"], upstream
    assert "front" in proxy["networks"]
    env = compose["services"]["api"]["environment"]
    assert env["TESSERA_PUBLIC_BASE_URL"] == "${TESSERA_PUBLIC_BASE_URL:-https://localhost}"


@pytest.mark.skipif(shutil.which("caddy") is None, reason="caddy is not installed (Debian: apt-get install caddy)")
def test_caddy_accepts_the_caddyfile():
    result = subprocess.run(
        ["caddy", "validate", "--config", str(ROOT / "deploy" / "Caddyfile"), "--adapter", "caddyfile"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_long_running_service_has_a_healthcheck_that_means_something(compose):
    services = compose["services"]
    for name, service in services.items():
        if name == "migrate":  # one-shot: the others wait for it to complete
            assert service["restart"] == "no"
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    # the api's is readiness (database, key check, broker, S3), not mere liveness
    assert any("/readyz" in part for part in services["api"]["healthcheck"]["test"])
    parser = build_parser()
    for name, role in (("worker", "worker"), ("reactors", "worker"), ("beat", "beat")):
        test = services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "tessera"], name
        args = parser.parse_args(test[2:])
        assert (args.command, args.role) == ("alive", role), name
    assert any("/healthcheck" in part for part in services["flower"]["healthcheck"]["test"])
    assert any("/health'" in part for part in services["sandbox"]["healthcheck"]["test"])
    for name in ("api", "worker", "reactors"):  # they start children: an init reaps them
        assert services[name]["init"] is True, name


def test_no_literal_secret_in_any_environment(compose):
    # The platform's own secrets are FILE_SETTINGS; its other settings are not secrets whatever their
    # names hold (TESSERA_REDIS_KEY_PREFIX, TESSERA_NETWORK_TOKEN_WAIT_SECONDS...).
    secrets = {f"TESSERA_{name.upper()}" for name in FILE_SETTINGS}
    plain = {f"TESSERA_{name.upper()}" for name in Settings.model_fields} - secrets
    for name, service in compose["services"].items():
        for variable, value in (service.get("environment") or {}).items():
            assert variable not in secrets, f"{name}: {variable} in the environment, not from a file"
            if variable in plain:
                assert value is None or not str(value).startswith("/run/secrets/"), (name, variable)
            elif re.search(r"PASSWORD|SECRET|_KEY\b|_KEY_(?!ID)|TOKEN|CREDENTIALS", variable):
                assert variable.endswith("_FILE") and str(value).startswith("/run/secrets/"), (name, variable)
            assert not re.search(r"://[^/@\s]*:[^/@\s$]+@", str(value)), f"{name}: {variable} carries a password"


def _variables_read(compose: dict) -> set[str]:
    """Every variable docker-compose.yml reads: interpolated (``${NAME...}``) or passed through (a
    service's environment entry without a value)."""
    text = "\n".join(
        line for line in (ROOT / "docker-compose.yml").read_text().splitlines() if not line.lstrip().startswith("#")
    )
    names = set(re.findall(r"\$\{(\w+)", text))
    for service in compose["services"].values():
        names |= {name for name, value in (service.get("environment") or {}).items() if value is None}
    return names


def test_every_variable_compose_reads_is_in_env_example(compose):
    example = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^#? ?(\w+)=", example, re.M))
    read = _variables_read(compose)
    assert read - listed == set(), "missing from .env.example"
    assert listed - read - {"COMPOSE_PROFILES"} == set(), "listed in .env.example but never read"
    # what an operator must be able to set without editing the file
    assert {
        "TESSERA_PUBLIC_BASE_URL",
        "TESSERA_CARD_NETWORK_URL",
        "TESSERA_VIC_URL",
        "TESSERA_AGENTPAY_URL",
        "TESSERA_PSP_URL",
        "TESSERA_KMS_KEY_ID",
        "TESSERA_API_WORKERS",
        "TESSERA_WORKER_CONCURRENCY",
        "TESSERA_S3_PUBLIC_ENDPOINT_URL",
    } <= read
    for name in read & set(re.findall(r"^(\w+)=", example, re.M)):
        assert not re.search(r"PASSWORD|SECRET", name), name  # secrets are files, never in .env
    known = {f"TESSERA_{name.upper()}" for name in Settings.model_fields}
    assert {name for name in read if name.startswith("TESSERA_")} <= known


def test_the_api_processes_default_to_several(compose):
    env = compose["services"]["api"]["environment"]
    default = re.fullmatch(r"\$\{TESSERA_API_WORKERS:-(\d+)\}", env["TESSERA_API_WORKERS"])
    assert default and int(default.group(1)) >= 2
    assert "--workers" not in compose["services"]["api"]["command"]  # the variable decides


def test_the_image_is_reproducible_and_slim():
    dockerfile = (ROOT / "Dockerfile").read_text()
    [base] = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    # FROM ${PYTHON_IMAGE}: the argument's default, declared before FROM, is the base (tests/deploy
    # builds on a Debian-made stand-in through it; nothing else sets it)
    argument = re.fullmatch(r"\$\{(\w+)\}", base)
    if argument:
        [base] = re.findall(rf"^ARG {argument.group(1)}=(\S+)\nFROM ", dockerfile, re.M)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base) or "@sha256:" in base, base  # an exact version
    # dependencies from the lock file, hashes checked, before any code is copied
    lock = (ROOT / "requirements.lock").read_text()
    install = dockerfile.index("--require-hashes -r requirements.lock")
    assert dockerfile.index("COPY requirements.lock") < install < dockerfile.index("COPY app app")
    assert "pip install --no-cache-dir --no-deps ." in dockerfile
    locked = {m.lower().replace("_", "-") for m in re.findall(r"^([A-Za-z0-9_.-]+)==", lock, re.M)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev_only = {"moto"}  # `pip install .` then `tessera dev` needs it; the image installs the lock
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
        assert name in locked or name in dev_only or ";" in requirement, f"{name} is not locked"
    assert "--hash=sha256:" in lock
    # moto, Flask and the test tools stay out of the runtime image
    for name in ("moto", "flask", "pytest", "cfn-lint", "sympy", "ruff", "hypothesis"):
        assert name not in locked, f"{name} is in the runtime lock"
    assert any(r.startswith("moto") for r in project["optional-dependencies"]["dev"])
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "secrets", ".env", "tests"} <= set(ignored)
    # the tessera user has a home, npm a writable cache
    assert "--create-home" in dockerfile and "npm_config_cache=/home/tessera/.npm" in dockerfile
    assert "HOME=/home/tessera" in dockerfile and "USER tessera" in dockerfile


def test_the_metrics_folder_is_a_tmpfs_owned_by_the_image_user(compose):
    options = compose["volumes"]["metrics"]["driver_opts"]
    assert options["type"] == "tmpfs"
    uid = re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1)
    assert f"uid={uid}" in options["o"]
