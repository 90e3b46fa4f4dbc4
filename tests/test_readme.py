"""README keeps its promises: the two set-up commands first, every setting documented, the sandbox's test
cards one link away, no link to a file the repository does not hold, and a Quickstart that runs: its
```sh blocks, pasted in order into bash against a ``tessera dev`` started as the Quickstart says."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config.settings import Settings
from tests.conftest import free_port

pytestmark = [pytest.mark.unit, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def test_every_setting_is_documented_with_its_variable():
    missing = [f"TESSERA_{name.upper()}" for name in Settings.model_fields if f"`TESSERA_{name.upper()}" not in README]
    assert missing == []


def test_the_two_setup_commands_come_first():
    first_commands = [line.strip() for line in README.splitlines()[:10] if line.startswith("    ")]
    assert first_commands == ["make dev", "make test"]


def test_the_sandbox_test_cards_are_one_link_from_the_readme():
    assert "[docs/sandbox.md](docs/sandbox.md)" in README
    cards = (ROOT / "docs" / "sandbox.md").read_text()
    assert cards.startswith("# Sandbox test cards")
    for number in ("4242424242424242", "4000000000002016", "4000000000003014", "4000000000004046"):
        assert f"| {number}" in cards


def test_documentation_links_only_to_files_in_the_repository():
    for page in ("README.md", "docs/sandbox.md", "sandbox/README.md"):
        text = (ROOT / page).read_text()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith(("http://", "https://")):
                assert ((ROOT / page).parent / target).exists(), f"{page} links to {target}, not in the repository"
        assert "spec/SANDBOX.md" not in text, page


# ---- the Quickstart, run ------------------------------------------------------------------------


def quickstart() -> str:
    """The README's ``## Quickstart`` section, up to the next ``## `` heading."""
    start = README.index("\n## Quickstart\n")
    return README[start : README.index("\n## ", start + 1)]


def shell_blocks(section: str) -> list[str]:
    """The bodies of the section's fenced ```sh blocks, in order (the second terminal's steps)."""
    return re.findall(r"^```sh\n(.*?)^```$", section, re.S | re.M)


def start_command_environment(section: str, folder: Path) -> dict[str, str]:
    """The settings of the first terminal's command (the indented ``NAME=value ... make dev`` line), with
    ``$PWD`` as ``folder``."""
    commands = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.endswith("make dev")]
    assert len(commands) == 1, commands
    assignments = commands[0].split()[:-2]
    return dict(assignment.replace("$PWD", str(folder)).split("=", 1) for assignment in assignments)


def _wait_for_banner(dev: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while "Tessera is running at" not in log.read_text(errors="replace"):
        assert dev.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def _stop_group(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to the process's session (its background jobs too), SIGKILL when it outlives ``timeout``."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.timeout(420)
def test_the_quickstart_runs_against_tessera_dev(tmp_path):
    assert importlib.util.find_spec("standardwebhooks"), (
        "the Quickstart's receiver verifies with the standardwebhooks package, which `make dev` installs "
        "(the dev extra) and the test extra must install too"
    )
    section = quickstart()
    blocks = shell_blocks(section)
    assert len(blocks) >= 8, blocks

    # the reader's checkout: the commands run from a folder holding .venv, here the environment running the tests
    folder = tmp_path / "checkout"
    folder.mkdir()
    (folder / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    settings = {
        "TESSERA_DATA_DIR": str(tmp_path / "data"),
        "TESSERA_API_PORT": str(free_port()),
        **start_command_environment(section, folder),
    }
    assert set(settings) == {"TESSERA_DATA_DIR", "TESSERA_API_PORT", "TESSERA_PROXY_CA_BUNDLE"}, settings
    env.update(settings)

    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen(
            [str(folder / ".venv" / "bin" / "tessera"), "dev"],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_banner(dev, log, timeout=180)
        # the second terminal: the same settings (the banner names them), free ports for the README's variables
        ports = {"HOOK_PORT": str(free_port()), "SHOP_PORT": str(free_port())}
        script = folder / "quickstart.sh"
        script.write_text("set -euo pipefail\n" + "\n".join(blocks))
        output = tmp_path / "quickstart.out"
        with output.open("wb") as out:
            steps = subprocess.Popen(
                ["bash", str(script)],
                cwd=folder,
                env={**env, **ports},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            status = steps.wait(timeout=180)
        finally:
            _stop_group(steps, timeout=5)  # the receiver and the shop, if the steps stopped before stopping them
        printed = output.read_text()
        assert status == 0, printed
    finally:
        _stop_group(dev, timeout=40)

    token = re.search(rf"^token: ({UUID})$", printed, re.M)
    assert token, printed
    token_id = token[1]
    assert re.search(rf"^id={UUID}  status=active  network_token\.last4=\d{{4}}$", printed, re.M), printed
    assert re.search(
        r"^id=pm_\w+  status=active  rails\.0\.rail=agentic-token  rails\.0\.status=enabled"
        r"  rails\.1\.rail=spt  rails\.1\.status=enabled$",
        printed,
        re.M,
    ), printed
    assert '{"bin": "424242", "last4": "4242"}' in printed.splitlines(), printed  # the reactor's answer
    assert '{"paid": true, "card_last4": "4242"}' in printed.splitlines(), printed  # the proxied answer
    assert re.search(r'^the shop received \{"card": \{"number": "4242424242424242"\}', printed, re.M), printed
    job = re.search(rf"^id=({UUID})  status=completed$", printed, re.M)
    assert job, printed
    assert re.search(rf"^{UUID},31,12,{UUID},34,12,UPD_PAN$", printed, re.M), printed

    deliveries = re.findall(
        r"^receiver got a delivery\n"
        r"  webhook-id: (msg_\w+)\n"
        r"  webhook-timestamp: (\d+)\n"
        r"  webhook-signature: (v1,\S+)\n"
        r"  (verified [\w.-]+|NOT verified[^:]*): (.*)$",
        printed,
        re.M,
    )
    assert deliveries, printed
    assert all(outcome.startswith("verified ") for *_, outcome, _ in deliveries), printed
    assert any(outcome == "verified token.created" and token_id in body for *_, outcome, body in deliveries), printed
    assert "Traceback" not in printed, printed
