"""Every setting README's "Settings" table lists can be given to the services of docker-compose.yml
without editing it, or is one of a short list that the file fixes on purpose or reads from a secret
file; the reasons are in :data:`FIXED` and README "Operating Tessera" names each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from config.settings import FILE_SETTINGS, file_variable

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: Settings docker-compose.yml sets itself, and why an operator does not.
FIXED = {
    "TESSERA_DATA_DIR": "the image's /var/lib/tessera",
    "TESSERA_METRICS_DIR": "the metrics volume the api and the workers share",
    "TESSERA_S3_ENDPOINT_URL": "the s3 service (clients use TESSERA_S3_PUBLIC_ENDPOINT_URL)",
    "TESSERA_SANDBOX_URL": "the sandbox service",
    "TESSERA_API_HOST": "the api command's --host 0.0.0.0 (published on loopback, fronted by Caddy)",
    "TESSERA_API_PORT": "the api command's --port 8080",
}
#: The services each setting is for: the api and the worker, unless the setting is another role's.
FOR = {"TESSERA_FLOWER_USER": ("flower",), "TESSERA_FLOWER_PASSWORD": ("flower",)}
#: A secret file's setting goes to the roles that use it (the SMTP URL: the worker, which sends mail).
SECRET_FOR = {
    "TESSERA_SMTP_URL": ("worker",),
    "TESSERA_DATABASE_URL": ("api", "worker", "beat", "migrate"),
    "TESSERA_MASTER_KEY": ("api", "worker", "beat"),
}


def _documented() -> list[str]:
    section = (ROOT / "README.md").read_text().split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `TESSERA_"):
            names += re.findall(r"`(TESSERA_\w+)`", line.split("|")[1])
    return names


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def _settable(value: object, variable: str) -> bool:
    """Passed through (no value: the operator's when set) or interpolated from the operator's variable."""
    return value is None or bool(re.fullmatch(rf"\$\{{{variable}(:?-[^}}]*)?\}}", str(value)))


def test_the_table_is_read():
    documented = _documented()
    assert len(documented) > 80 and "TESSERA_WEBHOOK_RETRY_SCHEDULE" in documented


def test_every_documented_setting_reaches_its_services_or_is_fixed_on_purpose(services):
    secret_files = {f"TESSERA_{name.upper()}" for name in FILE_SETTINGS}
    for variable in _documented():
        targets = FOR.get(variable, SECRET_FOR.get(variable, ("api", "worker")))
        for name in targets:
            env = services[name]["environment"]
            if variable in secret_files:
                assert variable not in env, f"{name}: {variable} is a secret, given as a file"
                setting = variable.removeprefix("TESSERA_").lower()
                assert env.get(file_variable(setting), "").startswith("/run/secrets/"), (name, variable)
            elif variable in FIXED:
                if variable in ("TESSERA_API_HOST", "TESSERA_API_PORT"):
                    assert variable not in env and "--host" in services["api"]["command"], variable
                else:
                    assert env[variable] and not _settable(env[variable], variable), (name, variable)
            else:
                assert variable in env, f"{name} does not pass {variable} through"
                assert _settable(env[variable], variable), f"{name} fixes {variable} to {env[variable]!r}"


def test_every_exception_is_explained_in_the_operator_page():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Operating Tessera", 1)[1].split("\n## ", 1)[0]
    for variable in FIXED:
        assert f"`{variable}`" in section, variable
    for name in FILE_SETTINGS:
        if f"TESSERA_{name.upper()}" in _documented():
            assert f"secrets/{name}" in section or name == "master_key_previous", name
