"""README keeps its promises: the two set-up commands first, every setting documented, the sandbox's test
cards one link away, and no link to a file the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

from config.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


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
