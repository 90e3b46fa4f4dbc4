"""The default scan: the real ``npm audit --json`` of a real install, read against the lockfile.

The public registry's advisory service cannot be reached from the test machines (the registry they
reach answers 405 to audit requests), so npm audit is pointed at a small advisory service on
loopback that answers npm's bulk advisory request and the package documents it then reads (built
from the installed packages' own package.json files). npm, its report and the parsing are real.
"""

from __future__ import annotations

import gzip
import http.server
import json
import random
import threading
from pathlib import Path

import pytest

from domain.reactors.runtime import ReactorRuntime, Runtime
from infra.node_runtime import packages

# npm caches what it learnt of an advisory by its number (in the user's npm cache): a fresh number
# per run keeps an earlier run's answer out of this one.
ADVISORY = {
    "id": random.randrange(10**6, 10**9),
    "url": "https://github.com/advisories/GHSA-2222-3333-4444",
    "title": "test advisory",
    "severity": "high",
    "vulnerable_versions": "<7.0.0",
    "cwe": [],
    "cvss": {},
}


class AdvisoryService(http.server.ThreadingHTTPServer):
    """npm's bulk advisory endpoint plus package documents; ``advisories`` is what the bulk request
    answers, ``refuse`` makes every request answer 405 (as the reachable registry does)."""

    def __init__(self, installed: Path):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.installed = installed
        self.advisories: dict = {}
        self.refuse = False
        self.asked: list[dict] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: AdvisoryService

    def _answer(self, status: int, body: object = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        if self.server.refuse or self.path != "/-/npm/v1/security/advisories/bulk":
            return self._answer(405)
        self.server.asked.append(json.loads(body))
        return self._answer(200, self.server.advisories)

    def do_GET(self):
        if self.server.refuse:
            return self._answer(405)
        name = self.path.lstrip("/").replace("%2f", "/").replace("%2F", "/")
        versions = {}
        for manifest in self.server.installed.glob("**/node_modules/**/package.json"):
            data = json.loads(manifest.read_text())
            if data.get("name") == name:
                versions[data["version"]] = {
                    "name": name,
                    "version": data["version"],
                    "dependencies": data.get("dependencies", {}),
                }
        if not versions:
            return self._answer(404, {"error": "not found"})
        return self._answer(200, {"name": name, "versions": versions, "dist-tags": {"latest": max(versions)}})

    def log_message(self, *args):
        pass


@pytest.fixture
def service(tmp_path):
    server = AdvisoryService(tmp_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_npm_audit_reports_a_high_advisory_on_an_indirect_dependency(tmp_path, service):
    service.advisories = {"is-number": [ADVISORY]}
    rt = ReactorRuntime(tmp_path, audit_registry=service.url)
    build = rt.build(Runtime(image="node22", dependencies={"is-odd": "3.0.1"}))
    assert service.asked == [{"is-number": ["6.0.0"], "is-odd": ["3.0.1"]}]
    assert build.state == "vulnerabilities_detected"
    assert build.error_details() == {
        "vulnerabilities": [
            {
                "name": "is-number",
                "version": "6.0.0",
                "severity": "HIGH",
                "id": "GHSA-2222-3333-4444",
                "dependency_path": ["is-odd", "is-number"],
            },
        ]
    }


def test_npm_audit_with_a_moderate_advisory_builds_ok(tmp_path, service):
    number = ADVISORY["id"] + 1
    service.advisories = {
        "is-odd": [{**ADVISORY, "id": number, "url": "", "severity": "moderate", "vulnerable_versions": "<=3.0.1"}]
    }
    rt = ReactorRuntime(tmp_path, audit_registry=service.url)
    build = rt.build(Runtime(image="node22", dependencies={"is-odd": "3.0.1"}))
    assert build.state == "ok"
    assert [v.as_dict() for v in build.vulnerabilities] == [
        {"name": "is-odd", "version": "3.0.1", "severity": "MEDIUM", "id": str(number), "dependency_path": ["is-odd"]}
    ]


def test_an_advisory_service_that_does_not_answer_fails_the_scan(tmp_path, service):
    service.refuse = True
    rt = ReactorRuntime(tmp_path, audit_registry=service.url)
    with pytest.raises(packages.AuditUnavailable) as caught:
        rt.build(Runtime(image="node22", dependencies={"is-odd": "3.0.1"}))
    assert isinstance(caught.value, packages.AuditRefused)  # a 4xx: asking again will not help
    assert caught.value.status == 405
