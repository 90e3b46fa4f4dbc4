"""Builds of node22 reactors: a real npm install of pinned dependencies (``--ignore-scripts``) into
a directory cached by dependency set, then a scan against an offline advisory file (core spec
section 2, Requested object: ``vulnerabilities_detected``)."""

from __future__ import annotations

import json

import pytest

from config.settings import get_settings, reload_settings
from domain.reactors import runtime as runtime_module
from domain.reactors.runtime import ReactorRuntime, Runtime
from infra.node_runtime import packages

from .conftest import reactor

# is-odd 3.0.1 depends on is-number ^6.0.0: a direct and an indirect dependency.
DEPENDENCIES = {"is-odd": "3.0.1"}


@pytest.fixture(scope="module")
def advisory_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("advisories") / "advisories.json"
    path.write_text(
        json.dumps(
            [
                {"name": "is-number", "version": "6.0.0", "severity": "HIGH", "id": "CVE-2099-0001"},
                {"name": "is-number", "version": "4.0.0", "severity": "CRITICAL", "id": "CVE-2099-0002"},
                {"name": "is-odd", "version": "3.0.1", "severity": "low", "id": "GHSA-aaaa-bbbb-cccc"},
            ]
        )
    )
    return path


@pytest.fixture(scope="module")
def scanned(tmp_path_factory, advisory_file):
    rt = ReactorRuntime(tmp_path_factory.mktemp("built"), advisories=advisory_file)
    yield rt
    rt.close()


def test_a_high_advisory_on_an_installed_package_fails_the_build(scanned):
    build = scanned.build(Runtime(image="node22", dependencies=DEPENDENCIES))
    assert build.state == "vulnerabilities_detected"
    assert build.error_details() == {
        "vulnerabilities": [
            {
                "name": "is-number",
                "version": "6.0.0",
                "severity": "HIGH",
                "id": "CVE-2099-0001",
                "dependency_path": ["is-odd", "is-number"],
            },
            {
                "name": "is-odd",
                "version": "3.0.1",
                "severity": "LOW",
                "id": "GHSA-aaaa-bbbb-cccc",
                "dependency_path": ["is-odd"],
            },
        ]
    }
    installed = scanned.dependencies_dir / build.dependency_key / "node_modules"
    assert json.loads((installed / "is-number" / "package.json").read_text())["version"] == "6.0.0"


def test_resolutions_override_an_indirect_version_and_the_scan_sees_it(scanned):
    build = scanned.build(Runtime(image="node22", dependencies=DEPENDENCIES, resolutions={"is-number": "4.0.0"}))
    assert [(v["name"], v["version"], v["severity"]) for v in build.error_details()["vulnerabilities"]] == [
        ("is-number", "4.0.0", "CRITICAL"),
        ("is-odd", "3.0.1", "LOW"),
    ]


def test_only_low_findings_build_ok_and_the_code_requires_its_dependencies(scanned):
    build = scanned.build(Runtime(image="node22", dependencies={"is-number": "7.0.0"}))
    assert (build.state, build.vulnerabilities) == ("ok", [])
    r = reactor(
        """
        const isNumber = require('is-number');
        module.exports = async (req) => ({ raw: [isNumber(req.args.a), isNumber(req.args.b)] });
    """,
        dependencies={"is-number": "7.0.0"},
    )
    assert scanned.invoke(r, args={"a": "12", "b": "x"}).raw == [True, False]


def test_installs_are_cached_by_dependency_set(scanned):
    first = packages.install({"is-number": "7.0.0"}, {}, cache_dir=scanned.dependencies_dir)
    marker = (first.directory / ".installed").stat()
    again = packages.install({"is-number": "7.0.0"}, {}, cache_dir=scanned.dependencies_dir)
    assert again == first
    assert (again.directory / ".installed").stat().st_ino == marker.st_ino
    assert first.key == packages.dependency_key({"is-number": "7.0.0"}, {})
    assert first.key != packages.dependency_key({"is-number": "7.0.0"}, {"is-number": "4.0.0"})
    assert packages.dependency_key({"a": "1.0.0", "b": "2.0.0"}, {}) == packages.dependency_key(
        {"b": "2.0.0", "a": "1.0.0"}, {}
    )


def test_an_unknown_version_fails_the_install(tmp_path):
    with pytest.raises(packages.InstallFailed) as caught:
        packages.install({"is-number": "99.99.99"}, {}, cache_dir=tmp_path)
    assert "is-number" in str(caught.value)
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]


def test_unpinned_versions_are_refused_before_npm(tmp_path):
    with pytest.raises(ValueError):
        packages.install({"is-number": "^7.0.0"}, {}, cache_dir=tmp_path)
    with pytest.raises(ValueError):
        packages.install({"is-number": "7.0.0"}, {"x": "file:../../etc"}, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_no_dependencies_need_no_npm(tmp_path, advisory_file):
    rt = ReactorRuntime(tmp_path, advisories=advisory_file)
    build = rt.build(Runtime(image="node22"))
    assert (build.state, build.vulnerabilities) == ("ok", [])
    assert (rt.dependencies_dir / build.dependency_key / "node_modules").is_dir()


def test_the_process_runtime_scans_against_tessera_reactor_advisories(monkeypatch, advisory_file):
    monkeypatch.setenv("TESSERA_REACTOR_ADVISORIES", str(advisory_file))
    monkeypatch.setattr(runtime_module, "_default", None)
    reload_settings()
    rt = runtime_module.reactor_runtime()
    try:
        assert rt is runtime_module.reactor_runtime()
        assert rt.advisories == advisory_file
        assert rt.root == get_settings().data_dir / "reactors"
        assert rt.build(Runtime(image="node22", dependencies=DEPENDENCIES)).state == "vulnerabilities_detected"
    finally:
        rt.close()
        monkeypatch.delenv("TESSERA_REACTOR_ADVISORIES")
        reload_settings()


def test_code_with_a_syntax_error_fails_the_build_naming_the_line(scanned):
    broken = reactor("const a = 1;\nmodule.exports = async (req) => { return req.args.;\n};")
    build = scanned.build(broken.runtime, version=broken)
    assert build.state == "invalid_code"
    assert build.message.startswith("The reactor code is not a valid function (syntax at line 2: SyntaxError: ")
    assert str(scanned.root) not in build.message
    assert scanned.loads(broken) == 0  # the check's process is not one of the version's warm ones


@pytest.mark.parametrize(
    "code, part",
    [
        ("module.exports = 42;", "not_a_function"),
        ("throw new Error('no config');", "load: Error: no config"),
        ("const x = require('not-installed'); module.exports = async () => x;", "Cannot find module 'not-installed'"),
    ],
)
def test_code_that_does_not_load_fails_the_build(scanned, code, part):
    version = reactor(code)
    build = scanned.build(version.runtime, version=version)
    assert (build.state, part in build.message) == ("invalid_code", True), build


def test_code_that_loads_builds_ok_and_the_check_leaves_no_process(scanned):
    version = reactor("module.exports = async () => ({ raw: 1 });")
    assert scanned.build(version.runtime, version=version).state == "ok"
    assert scanned.pool.idle(version.key) == 0
    assert scanned.invoke(version, args={}).raw == 1
