"""The ``tessera`` command as a person uses it, run as real subprocesses: ``--version``, ``tenants
create`` refusing a malformed owner email in one line, ``tenants list``, ``migrate`` naming a missing
database, ``tessera dev`` stopping at once on a taken port, ``api --workers``, and the console of a
real worker and beat: one line per unit of work, no periodic no-op lines, no payload dumps."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import urllib3
from sqlalchemy.engine import make_url

from config import __version__
from infra import job_admin, ops
from tests.conftest import free_port
from tests.helpers import ApiClient, wait_until
from tests.ops.conftest import TESSERA

pytestmark = pytest.mark.timeout(180)
CARD = {"type": "card", "data": {"number": "4242424242424242", "expiration_month": 12, "expiration_year": 2031}}


def tessera(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*TESSERA, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_version():
    done = tessera("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"tessera {__version__}"


def test_tenants_create_refuses_a_malformed_owner_email_in_one_line(database):
    name = f"bad-{uuid.uuid4().hex[:8]}"
    for address in ("not-an-address", "you@", "a b@example.com"):
        done = tessera("tenants", "create", "--name", name, "--owner-email", address)
        assert done.returncode == 2, done
        assert done.stdout == ""
        services, line = done.stderr.splitlines()  # which database and broker, then one line of refusal
        assert services.startswith("tessera: database ") and " broker " in services, services
        assert line.startswith("error: owner email") and repr(address) in line, line
    listed = json.loads(tessera("tenants", "list", "--json").stdout)
    assert name not in {row["name"] for row in listed}  # nothing was created


def test_tenants_list_as_a_table_and_as_json(database):
    name = f"listed-{uuid.uuid4().hex[:8]}"
    owner = f"{name}@example.com"
    created = tessera("tenants", "create", "--name", name, "--owner-email", owner, "--json")
    assert created.returncode == 0, created.stderr
    tenant_id = json.loads(created.stdout)["tenant_id"]

    rows = json.loads(tessera("tenants", "list", "--json").stdout)
    [row] = [r for r in rows if r["id"] == tenant_id]
    assert (row["name"], row["type"], row["owner_email"], row["members"]) == (name, "test", owner, 1)

    table = tessera("tenants", "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "TYPE", "OWNER", "MEMBERS", "CREATED"]
    [line] = [line for line in lines if line.startswith(tenant_id)]
    assert line.split()[1:5] == [name, "test", owner, "1"]


def test_migrate_names_a_missing_database_and_how_to_create_it(database):
    missing = make_url(database).set(database=f"tessera_missing_{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "TESSERA_DATABASE_URL": missing.render_as_string(hide_password=False)}
    done = tessera("migrate", env=env)
    assert done.returncode == 1
    services, line = done.stderr.splitlines()  # the database looked at, then one line, no traceback
    assert services.startswith(f"tessera: database {missing.render_as_string(hide_password=True)}, broker ")
    assert f'database "{missing.database}" does not exist' in line
    assert f"createdb -h {missing.host} -p {missing.port}" in line and missing.database in line


def test_migrate_names_an_unreachable_database_without_its_password():
    url = f"postgresql+psycopg2://tessera:s3cret-pw@127.0.0.1:{free_port()}/tessera"
    done = tessera("migrate", env={**os.environ, "TESSERA_DATABASE_URL": url})
    assert done.returncode == 1
    services, line = done.stderr.splitlines()
    assert services.startswith("tessera: database postgresql+psycopg2://tessera:***@127.0.0.1:"), services
    assert "s3cret-pw" not in services
    assert line.startswith('error: cannot reach database "tessera"') and "s3cret-pw" not in line, line


def test_dev_stops_at_once_naming_a_taken_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "TESSERA_API_PORT": str(port), "TESSERA_DATA_DIR": str(tmp_path / "data")}
        started = time.monotonic()
        done = tessera("dev", env=env, timeout=30)
        elapsed = time.monotonic() - started
    assert done.returncode == 1
    assert f"port {port}" in done.stderr and "TESSERA_API_PORT" in done.stderr
    assert not (tmp_path / "data").exists()  # it stopped before migrating or starting anything
    assert elapsed < 15, elapsed  # not after a readiness timeout


def test_dev_readiness_reaches_its_own_api(tmp_path):
    """The api's socket is bound by ``tessera dev`` and inherited: the port answers only through it."""
    from tessera.dev import bind_api_socket

    sock = bind_api_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert sock.get_inheritable()
        with pytest.raises(OSError, match="TESSERA_API_PORT"):
            bind_api_socket("127.0.0.1", port)
    finally:
        sock.close()


def test_api_workers_share_one_port_and_stop_together(platform):
    process = platform.start("api", "api", "--workers", "2")
    url = platform.api_url + "/healthz"

    def up():
        assert process.alive(), process.output()
        try:
            return urllib3.request("GET", url, timeout=2, retries=False).status == 200
        except urllib3.exceptions.HTTPError:
            return False

    wait_until(up, timeout=60, interval=0.2)
    children = psutil.Process(process.popen.pid).children()
    assert len(children) == 2
    assert all(c.cmdline()[-1] == "--reuse-port" for c in children)
    port = int(platform.env["TESSERA_API_PORT"])

    def listening(child):
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp"))

    wait_until(lambda: all(listening(c) for c in children), timeout=60, interval=0.2)  # both bound the port
    process.signal(signal.SIGTERM)
    assert process.popen.wait(40) == 0
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def test_the_console_shows_units_of_work_not_periodic_noise(platform, receiver):
    console = {"TESSERA_LOG_FORMAT": "console"}
    worker = platform.start_worker("--concurrency", "1", extra_env=console)
    beat = platform.start("beat", "beat", "--schedule", str(platform.tmp_path / "schedule"), extra_env=console)
    platform.start_api()
    settings = platform.settings()
    # The beat heartbeat comes from its own thread, not from publishing tasks.
    wait_until(lambda: "beat" in ops.heartbeats(settings), timeout=30)
    first = ops.heartbeats(settings)["beat"]
    assert first.pid == beat.popen.pid and first.every == ops.HEARTBEAT_SECONDS

    created = json.loads(
        platform.run("tenants", "create", "--name", "console", "--owner-email", "console@example.com", "--json").stdout
    )
    client = ApiClient(platform.api_url, created["api_key"])
    hook = client.post("/webhooks", {"name": "c", "url": receiver.url, "events": ["token.created"]})
    assert hook.status == 201, hook
    token = client.post("/tokenize", CARD)
    assert token.status == 201, token
    receiver.wait_for(lambda r: token.json["id"].encode() in r.body)
    time.sleep(12)  # past two runs of the 5 s sweeps and the relay
    assert ops.heartbeats(settings)["beat"].at > first.at  # refreshed while beat runs

    lines = worker.stderr_lines() + beat.stderr_lines()
    assert not [line for line in lines if "Sending due task" in line]
    assert not [line for line in lines if "] received" in line]
    # Sweeps that found nothing write nothing (a relay run that re-sent work, e.g. another test's
    # backlog in the shared database, is a unit of work and shows).
    periodic = [line for line in lines if "detect_uploads[" in line or "relay_outbox[" in line]
    assert [line for line in periodic if re.search(r"succeeded in \S+: 0 ", line)] == [], periodic[:3]
    # A delivery task shows as its outcome only: this test's delivery succeeded; a batch of another
    # test's backlog in the shared database (re-sent by the relay) is a unit of work too, shown as its
    # outcome (succeeded, retry or failure), never as a received or started line.
    delivered = [line for line in lines if "webhooks.deliver[" in line]
    assert any("succeeded" in line for line in delivered), delivered
    outcomes = [line for line in delivered if re.search(r"\] (succeeded in|retry:|raised (un)?expected:)", line)]
    assert outcomes == delivered, [line for line in delivered if line not in outcomes]
    assert not [line for line in lines if "data=" in line]


def test_dev_prints_its_banner_last_and_then_stays_quiet(tmp_path):
    """``tessera dev`` on the embedded defaults, as a newcomer runs it: the banner comes once the api,
    the worker and beat run, and no periodic line follows it while nothing happens."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "PROMETHEUS_", "AWS_"))}
    env.update({"TESSERA_API_PORT": str(port), "TESSERA_DATA_DIR": str(tmp_path / "data")})
    out = (tmp_path / "dev.out").open("wb")
    dev = subprocess.Popen([*TESSERA, "dev"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def banner_shown():
            assert dev.poll() is None, (tmp_path / "dev.out").read_text()
            return "Tessera is running at" in (tmp_path / "dev.out").read_text()

        wait_until(banner_shown, timeout=150, interval=0.5)
        time.sleep(1)
        text = (tmp_path / "dev.out").read_text()
        time.sleep(12)  # two runs of the 5 s sweeps and the relay
        later = (tmp_path / "dev.out").read_text()
        assert later == text, later[len(text) :][:2000]  # nothing printed after the banner
        banner = text[text.index("Tessera is running at") :]
        assert f"http://127.0.0.1:{port}" in banner
        assert str(tmp_path / "data") in banner and str(tmp_path / "data" / "mail") in banner
        assert "tessera flower" in banner
        assert banner.rstrip().endswith("-" * 78)  # the banner is the last thing on the console
        dev.send_signal(signal.SIGTERM)
        assert dev.wait(60) == 0
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait(10)
        out.close()


# ---- polish: help, pipes, announcements ----------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "subcommands"),
    [
        ("jobs", ["list", "show", "retry", "cancel"]),
        ("tenants", ["create", "list"]),
        (None, ["dev", "jobs"]),
    ],
)
def test_a_group_without_its_subcommand_lists_the_subcommands(group, subcommands):
    done = tessera(*([group] if group else []))
    assert done.returncode == 2 and done.stdout == ""
    assert "required" not in done.stderr and "COMMAND" in done.stderr
    assert all(re.search(rf"^\s+{name}\s", done.stderr, re.M) for name in subcommands), done.stderr


def test_every_option_has_help_text():
    from tessera.cli import build_parser

    def options(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, [*path, name])
            elif action.help != argparse.SUPPRESS:
                yield " ".join(path), action

    missing = [(path, action.dest) for path, action in options(build_parser(), ["tessera"]) if not action.help]
    assert missing == []


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (
            "worker",
            ["celery worker", "TESSERA_BROKER_URL", "TESSERA_WORKER_CONCURRENCY", "TESSERA_PROVIDER_CONCURRENCY"],
        ),
        ("beat", ["celery beat", "TESSERA_BROKER_URL", "celerybeat-schedule"]),
        ("flower", ["pass through to Flower", "TESSERA_FLOWER_PASSWORD", "TESSERA_BROKER_URL"]),
    ],
)
def test_worker_beat_and_flower_help_say_what_passes_through_and_which_settings_matter(command, words):
    done = tessera(command, "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "Options not listed here pass through" in text and all(word in text for word in words), text


def test_output_cut_short_by_its_reader_ends_quietly(database):
    code = (
        "import os, sys\nread, write = os.pipe()\nos.close(read)\nos.dup2(write, 1)\n"
        "from tessera.cli import main\nsys.exit(main(['tenants', 'list']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert [line.split(",")[0] for line in done.stderr.splitlines()] == [
        f"tessera: database {make_url(os.environ['TESSERA_DATABASE_URL']).render_as_string(hide_password=True)}"
    ]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_api_says_listening_once_it_answers(platform, workers):
    process = platform.start("api", "api", "--workers", workers)

    def announced():
        assert process.alive(), process.output()
        return "listening" in process.stdout.read_text()

    wait_until(announced, timeout=60, interval=0.05)
    assert urllib3.request("GET", platform.api_url + "/healthz", timeout=2, retries=False).status == 200
    processes = "" if workers == "1" else f" ({workers} processes)"
    assert process.stdout.read_text().strip() == f"tessera api listening on {platform.api_url}{processes}"


def test_the_banner_commands_work_as_typed_from_the_project_folder(tmp_path, monkeypatch):
    from config.settings import get_settings
    from tessera import dev

    folder = Path(sys.executable).parent.parent.parent  # the project folder holding .venv
    command = dev.typed_command(folder)
    assert command == "tessera" or (folder / command).exists() or command.endswith("-m tessera.cli"), command
    monkeypatch.setenv("TESSERA_API_PORT", "9999")
    text = dev.banner(get_settings(), "http://127.0.0.1:9999")
    assert f"{dev.typed_command()} queues" in text and f"{dev.typed_command()} tenants create" in text
    assert "another shell needs the same settings:" in text and "TESSERA_API_PORT" in text
    assert "9999" not in text.split("another shell")[1]  # names only, never values


def test_a_cancelled_delivery_reads_cancelled():
    from storage.models import Job, WebhookDelivery

    delivery = WebhookDelivery(id=uuid.uuid4(), tenant_id=uuid.uuid4(), webhook_id=uuid.uuid4(), event_id=uuid.uuid4())
    job = Job(id=delivery.id, kind="webhooks.deliver", status="cancelled", attempts=0, max_attempts=5)
    assert job_admin.delivery_view(delivery, job)["state"] == "cancelled"
    assert job_admin.delivery_state("dead") == "failed" and job_admin.delivery_state("queued") == "pending"


def test_settings_come_from_a_dot_env_file_in_the_working_folder_and_each_command_names_what_it_reads(
    database, tmp_path
):
    """``tenants list`` run in a folder whose ``.env`` names the database, with no TESSERA_DATABASE_URL in
    the environment, reaches that database and says so first (the environment still wins over .env)."""
    name = f"dotenv-{uuid.uuid4().hex[:8]}"
    assert tessera("tenants", "create", "--name", name, "--owner-email", f"{name}@example.com").returncode == 0
    (tmp_path / ".env").write_text(
        f"# the settings of this folder\nTESSERA_DATABASE_URL={database}\nTESSERA_BROKER_URL=redis://127.0.0.1:6399/3\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TESSERA_DATABASE_URL", "TESSERA_BROKER_URL")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [*TESSERA, "tenants", "list"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert name in done.stdout
    shown = make_url(database).render_as_string(hide_password=True)
    assert done.stderr.splitlines()[0] == (
        f"tessera: database {shown}, broker redis://127.0.0.1:6399/3 (settings "
        f"from the environment and {tmp_path / '.env'})"
    )
    env["TESSERA_BROKER_URL"] = "redis://127.0.0.1:6398/4"
    again = subprocess.run(
        [*TESSERA, "queues", "--json", "--timeout", "0.1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert again.stderr.splitlines()[0].startswith(f"tessera: database {shown}, broker redis://127.0.0.1:6398/4 ")


def test_the_settings_class_reads_dot_env_below_the_environment(tmp_path, monkeypatch):
    from config.settings import Settings

    (tmp_path / ".env").write_text("TESSERA_API_PORT=9123\nTESSERA_HEADER_PREFIX=zz\nOTHER=ignored\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TESSERA_API_PORT", raising=False)
    monkeypatch.setenv("TESSERA_HEADER_PREFIX", "YY")
    settings = Settings()
    assert (settings.api_port, settings.header_prefix) == (9123, "YY")


def test_a_started_api_process_freezes_its_heap_and_collects_young_objects_less_often():
    """``_freeze_heap`` (run once the api listens): what exists is frozen out of the collector's
    sight, and the youngest generation is collected every 7,000 allocations, the others as before.
    In a child interpreter, so this process's collector is left as it is."""
    script = (
        "import asyncio, gc, json\n"
        "from tessera.cli.processes import _freeze_heap, YOUNG_COLLECTION_THRESHOLD\n"
        "before = gc.get_threshold()\n"
        "asyncio.run(_freeze_heap(None))\n"
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), YOUNG_COLLECTION_THRESHOLD]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    before, after, frozen, threshold = json.loads(done.stdout.splitlines()[-1])
    assert threshold == 7_000
    assert after == [threshold, *before[1:]]
    assert frozen > 10_000  # what the child imported
