"""README keeps its promises: the two set-up commands first, and every setting documented."""

from __future__ import annotations

from pathlib import Path

from config.settings import Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_documented_with_its_variable():
    missing = [f"TESSERA_{name.upper()}" for name in Settings.model_fields if f"`TESSERA_{name.upper()}" not in README]
    assert missing == []


def test_the_two_setup_commands_come_first():
    first_commands = [line.strip() for line in README.splitlines()[:10] if line.startswith("    ")]
    assert first_commands == ["make dev", "make test"]
