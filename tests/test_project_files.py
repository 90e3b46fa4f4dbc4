"""The project's own files keep their promises: ``make dev`` installs the runtime alone (the test
extra only for ``make test`` and ``make lint``), and the README and ``pyproject.toml`` name only files
that exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recipe(makefile: str, target: str) -> tuple[list[str], list[str]]:
    """``(prerequisites, recipe lines)`` of ``target`` in ``makefile``."""
    match = re.search(rf"^{re.escape(target)}:([^\n#]*)(?:##[^\n]*)?\n((?:\t[^\n]*\n)*)", makefile, re.M)
    assert match, target
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_make_dev_installs_the_runtime_and_make_test_the_test_extra():
    makefile = (ROOT / "Makefile").read_text()
    dev, _ = _recipe(makefile, "dev")
    [dev_stamp] = [p for p in dev if p.startswith("$(BIN)/")]
    runtime, dev_install = _recipe(makefile, dev_stamp)
    # the dev extra (moto's S3 server for `tessera dev`) on top of the runtime, never the test extra
    assert any(line.endswith('pip install -q -e ".[dev]"') for line in dev_install), dev_install
    [stamp] = [p for p in runtime if p.startswith("$(BIN)/")]
    _, install = _recipe(makefile, stamp)
    # the runtime exactly as locked (hashes checked, as the image installs it), then the project itself
    assert any(line.endswith("pip install -q --require-hashes -r requirements.lock") for line in install), install
    assert any(line.endswith("pip install -q --no-deps -e .") for line in install), install
    assert not any("[test]" in line for line in install + dev_install)
    for target in ("test", "lint"):
        prerequisites, _ = _recipe(makefile, target)
        [test_stamp] = [p for p in prerequisites if p.startswith("$(BIN)/")]
        _, recipe = _recipe(makefile, test_stamp)
        assert any('-e ".[test]"' in line for line in recipe), (target, recipe)


def test_pyproject_names_only_files_that_exist():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / project["project"]["readme"]).is_file()
    for module in project["tool"]["setuptools"]["py-modules"]:
        assert (ROOT / f"{module}.py").is_file(), module
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        folder = ROOT / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file"
    named = re.findall(r"[\w./-]+\.(?:md|py|toml|ya?ml|sh|txt)\b", (ROOT / "pyproject.toml").read_text())
    assert [name for name in named if not (ROOT / name).exists()] == []


def test_the_readme_names_only_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:[\w.-]+/)*[\w.-]+\.(?:md|py|toml|ya?ml|sh|txt|json|js))`", readme))
    named |= set(re.findall(r"\]\((?!https?:|#)([^)#\s]+)", readme))
    assert named and [name for name in named if not (ROOT / name).exists()] == []
