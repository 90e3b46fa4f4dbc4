"""docker-compose.yml run for real, with Podman and podman-compose and no container registry: the image
is built from the Dockerfile (requirements.lock, hashes checked) on a Python base made from Debian's
packages (debootstrap, ``podman import``: tests/deploy/podman/python-base.Containerfile); PostgreSQL
and Redis are Debian's packages and S3 is moto's server (tests/deploy/podman/compose.podman.yml lays
them over the real file, with a webhook receiver). The stack comes up, a tenant tokenizes a card, the
receiver on the stack's own network gets the signed ``token.created`` delivery, and the stack goes
down with its volumes.

Slow (the first run builds images for ten minutes; then a few minutes). Skipped, with the reason, when
podman, podman-compose (``TESSERA_PODMAN_COMPOSE`` names the command, else ``podman-compose`` on
PATH) or the way to a base image (``debian:bookworm-local``, else debootstrap as root) is missing.

What this host needs, and the test sets in a containers.conf of its own (``CONTAINERS_CONF``): the
open-files and processes limits no higher than this process's hard limits (podman asks for more by
default and, without CAP_SYS_RESOURCE, the runtime's setrlimit fails); runc when the cgroups are in
hybrid mode (crun refuses them); cgroupfs when systemd does not run. Without systemd Podman 4.3 runs
no health checks on its own and podman-compose ignores ``condition: service_healthy`` below Podman
4.6: the test runs the checks (``podman healthcheck run``) and starts the services in the order the
file's conditions say (stores healthy, then ``migrate`` completed, then the roles), each stage with
``--no-deps`` (Podman 4.3 cannot start a container whose dependency has dependencies of its own).
Not started: the TLS proxy (no Caddy image; it would bind the host's ports 80 and 443).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import urllib3

from infra.signing import verify
from tests.helpers import ApiClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # image builds: minutes, ten on the first run

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).with_name("podman")
BASE = "debian:bookworm-local"
PYTHON_BASE = "localhost/tessera-python:bookworm"
CARD = {"number": "4000000000001018", "expiration_month": 12, "expiration_year": 2031}


def _podman_compose() -> list[str] | None:
    given = os.environ.get("TESSERA_PODMAN_COMPOSE")
    if given:
        return shlex.split(given)
    found = shutil.which("podman-compose")
    return [found] if found else None


def _skip_reason() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install podman)"
    if _podman_compose() is None:
        return "podman-compose not found (pip install podman-compose in a venv; TESSERA_PODMAN_COMPOSE=its path)"
    return None


def _containers_conf(folder: Path) -> Path:
    """A containers.conf for this host: limits within ours, runc on hybrid cgroups, cgroupfs without systemd."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else min(nofile, 1048576)
    nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)  # podman lowers its own to 32768
    lines = ["[containers]", f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]', "[engine]"]
    hybrid = Path("/sys/fs/cgroup/unified").is_dir()
    if hybrid and shutil.which("runc"):
        lines.append('runtime = "runc"')
    if not Path("/run/systemd/system").is_dir():
        lines.append('cgroup_manager = "cgroupfs"')
    path = folder / "containers.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Podman:
    env: dict[str, str]
    work: Path

    def run(self, *args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check:
            assert result.returncode == 0, f"podman {' '.join(args[:3])}: {result.stderr[-3000:]}"
        return result

    def has_image(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def build(self, tag: str, containerfile: Path | None, context: Path, *extra: str) -> None:
        file = ["-f", str(containerfile)] if containerfile else []
        # host network: package indexes through the host's resolver (a build container's DNS here is flaky)
        self.run("build", "--network", "host", "-t", tag, *file, *extra, str(context), timeout=1800)


def _base_image(podman: Podman) -> None:
    """``debian:bookworm-local``: debootstrap's minimal bookworm imported, unless it exists already."""
    if podman.has_image(BASE):
        return
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(f"no {BASE} image, and no debootstrap as root to make one (apt-get install debootstrap)")
    rootfs = podman.work / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], check=True, capture_output=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    podman.run("import", "-", BASE, stdin=tar.stdout, timeout=600)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def _images(podman: Podman) -> None:
    _base_image(podman)
    if not podman.has_image(PYTHON_BASE):
        context = podman.work / "python-base"
        context.mkdir()
        shutil.copy(HERE / "python-base.Containerfile", context / "Containerfile")
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", context / "host-ca-bundle.crt")
        podman.build(PYTHON_BASE, None, context)
    # the image under test: always rebuilt from this checkout (cached layers make it quick)
    podman.build("localhost/tessera:latest", None, ROOT, "--build-arg", f"PYTHON_IMAGE={PYTHON_BASE}")
    podman.build("localhost/tessera-stores:bookworm", HERE / "stores.Containerfile", HERE)
    podman.build("localhost/tessera-moto:latest", HERE / "moto.Containerfile", HERE)


@dataclass
class Stack:
    podman: Podman
    compose: list[str]
    project: Path
    name: str

    def compose_run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """``podman-compose`` on the real file with the stand-ins laid over it, in the project folder."""
        files = ["-p", self.name, "-f", "docker-compose.yml", "-f", str(HERE / "compose.podman.yml")]
        result = subprocess.run(
            [*self.compose, *files, *args],
            cwd=self.project,
            env=self.podman.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert not check or result.returncode == 0, f"podman-compose {args}: {(result.stdout + result.stderr)[-4000:]}"
        return result

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def wait_healthy(self, services: list[str], timeout: float = 180) -> None:
        """Run each service's health check until every one passes (no systemd runs them here)."""
        deadline = time.monotonic() + timeout
        waiting = list(services)
        while waiting and time.monotonic() < deadline:
            for service in list(waiting):
                check = self.podman.run("healthcheck", "run", self.container(service), check=False)
                if check.returncode == 0:
                    waiting.remove(service)
            if waiting:
                time.sleep(2)
        logs = {s: self.podman.run("logs", "--tail", "20", self.container(s), check=False).stderr for s in waiting}
        assert not waiting, f"not healthy: {waiting}\n{logs}"

    def address(self, service: str, network: str = "front") -> str:
        """The service's address on one of the stack's networks."""
        inspect = self.podman.run("inspect", self.container(service), "--format", "{{json .NetworkSettings.Networks}}")
        return json.loads(inspect.stdout)[f"{self.name}_{network}"]["IPAddress"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("podman")
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(_containers_conf(work)))
    podman = Podman(env, work)
    _images(podman)

    # The project folder: the real compose file and Caddyfile, secrets made by the script, a .env.
    project = work / "project"
    (project / "deploy").mkdir(parents=True)
    shutil.copy(ROOT / "docker-compose.yml", project / "docker-compose.yml")
    shutil.copy(ROOT / "deploy" / "Caddyfile", project / "deploy" / "Caddyfile")
    subprocess.run(["sh", str(ROOT / "scripts" / "make-secrets.sh"), str(project / "secrets")], check=True)
    # settings through .env (the pass-through): the receiver is on a private network
    (project / ".env").write_text("TESSERA_ALLOW_PRIVATE_DESTINATIONS=true\nTESSERA_API_WORKERS=1\n")
    stack = Stack(podman, _podman_compose() or [], project, f"tesseratest{os.getpid()}")
    try:
        stack.compose_run("up", "-d", "--no-deps", "postgres", "redis", "s3")
        stack.wait_healthy(["postgres", "redis", "s3"])
        stack.compose_run("up", "-d", "--no-deps", "migrate")
        exit_code = podman.run("wait", stack.container("migrate"), timeout=300).stdout.strip()
        assert exit_code == "0", podman.run("logs", stack.container("migrate"), check=False).stderr
        roles = ["api", "worker", "reactors", "beat", "sandbox", "flower"]
        stack.compose_run("up", "-d", "--no-deps", *roles, "receiver")
        stack.wait_healthy(roles)
        yield stack
    finally:
        stack.compose_run("down", "-v", "-t", "10", check=False)


def _deliveries(stack: Stack) -> list[dict]:
    logs = stack.podman.run("logs", stack.container("receiver"), check=False)
    return [json.loads(line) for line in (logs.stdout + logs.stderr).splitlines() if line.startswith("{")]


def test_customer_code_can_be_confined_in_the_reactors_service(stack):
    # its security options (no capability, seccomp/apparmor/systempaths unconfined for bubblewrap's
    # namespaces) are the file's; the worker says at start when bubblewrap cannot confine code
    logs = stack.podman.run("logs", stack.container("reactors"), check=False)
    assert "customer code cannot run" not in logs.stdout + logs.stderr
    inspect = stack.podman.run("inspect", stack.container("reactors"), "--format", "{{json .EffectiveCaps}}")
    assert json.loads(inspect.stdout) in (None, [])


def test_the_stack_tokenizes_and_delivers_a_signed_webhook_on_its_own_network(stack):
    created = stack.podman.run(
        "exec", stack.container("api"), "tessera", "tenants", "create", "--name", "podman", "--owner-email",
        "ops@example.com", "--json",
    )  # fmt: skip
    key = json.loads(created.stdout)["api_key"]
    client = ApiClient(f"http://{stack.address('api')}:8080", key)
    assert urllib3.request("GET", client.base_url + "/readyz", timeout=10).status == 200

    hook = client.post("/webhooks", {"name": "stack", "url": "http://receiver:9000/hook", "events": ["token.created"]})
    assert hook.status == 201, hook
    secret = client.get("/webhooks/signing-key").json["key"]
    token = client.post("/tokenize", {"type": "card", "data": CARD})
    assert token.status == 201, token
    assert client.get(f"/tokens/{token.json['id']}").json["data"] == CARD

    deadline = time.monotonic() + 60
    while not _deliveries(stack) and time.monotonic() < deadline:
        time.sleep(1)
    [delivery] = _deliveries(stack)
    body = delivery["body"].encode()
    verify(secret, delivery["headers"], body)  # signed with the tenant's key
    event = json.loads(body)
    assert event["event"]["type"] == "token.created"
    assert CARD["number"] not in delivery["body"]
