"""``/reactors`` over real HTTP with a real worker and real Node.js 22: CRUD and validation, builds as
jobs (a real npm install scanned against an offline advisory file), ``react`` and ``react-async``,
the error classes, the timeout, tokenizing, detokenized arguments and the shut-down formulas."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid

import pytest
from sqlmodel import select

from config.settings import reload_settings
from storage.db import session_scope
from storage.models import Event, Job
from storage.models_reactors import Reactor

ECHO = "module.exports = async (req) => ({ raw: { args: req.args, configuration: req.configuration } });"
NODE22 = {"image": "node22"}
# is-odd 3.0.1 depends on is-number 6.0.0, which the advisory file marks HIGH.
VULNERABLE = {"is-odd": "3.0.1"}


@pytest.fixture(scope="module", autouse=True)
def advisories(tmp_path_factory):
    """Builds scan against an offline advisory file (``TESSERA_REACTOR_ADVISORIES``)."""
    import os

    path = tmp_path_factory.mktemp("advisories") / "advisories.json"
    path.write_text(json.dumps([{"name": "is-number", "version": "6.0.0", "severity": "HIGH", "id": "CVE-2099-0001"}]))
    os.environ["TESSERA_REACTOR_ADVISORIES"] = str(path)
    reload_settings()
    yield path
    del os.environ["TESSERA_REACTOR_ADVISORIES"]
    reload_settings()


def body(code: str = ECHO, **fields) -> dict:
    return {"name": fields.pop("name", "echo"), "code": code, "runtime": fields.pop("runtime", NODE22), **fields}


def settled(client, reactor_id: str, *, states=("active", "failed", "outdated"), deadline: float = 240) -> dict:
    """The reactor once its build ended (polled; the build installs with npm)."""
    end = time.monotonic() + deadline
    while True:
        answer = client.get(f"/reactors/{reactor_id}")
        assert answer.status == 200, answer
        if answer.json["state"] in states or time.monotonic() > end:
            return answer.json
        time.sleep(0.2)


def active(client, code: str = ECHO, **fields) -> dict:
    created = client.post("/reactors", body(code, **fields))
    assert created.status == 201, created
    reactor = settled(client, created.json["id"])
    assert reactor["state"] == "active", reactor
    return reactor


def react(client, reactor_id: str, args=None, **kw):
    return client.post(f"/reactors/{reactor_id}/react", {"args": args} if args is not None else {}, **kw)


# ---- CRUD and validation -------------------------------------------------------------------------


def test_create_builds_to_active_then_read_list_update_delete(tenant):
    c = tenant.client
    created = c.post("/reactors", body(configuration={"KEY": "v"}))
    assert created.status == 201, created
    assert created.json["state"] == "creating"
    assert created.json["requested"]["reactor"] == {
        "code": ECHO,
        "configuration": {"KEY": "v"},
        "runtime": {
            "image": "node22",
            "dependencies": {},
            "resolutions": {},
            "timeout": 10,
            "resources": "standard",
            "warm_concurrency": 0,
            "permissions": [],
        },
    }
    reactor = settled(c, created.json["id"])
    assert reactor["state"] == "active"
    assert "requested" not in reactor
    assert reactor["configuration"] == {"KEY": "v"}

    listed = c.get("/reactors?name=ech")
    assert [r["id"] for r in listed.json["data"]] == [reactor["id"]]
    assert c.get("/reactors?name=e*o").json["pagination"]["total_items"] == 1
    assert c.get("/reactors?name=other").json["data"] == []
    assert c.get(f"/reactors?id={reactor['id']}").json["data"][0]["id"] == reactor["id"]

    new_code = "module.exports = async () => ({ raw: 'v2' });"
    updated = c.put(f"/reactors/{reactor['id']}", body(new_code, name="renamed"))
    assert updated.status == 200, updated
    assert (updated.json["state"], updated.json["name"], updated.json["code"]) == ("updating", "renamed", ECHO)
    assert updated.json["requested"]["reactor"]["code"] == new_code
    after = settled(c, reactor["id"])
    assert (after["state"], after["code"], after["configuration"]) == ("active", new_code, {})
    assert react(c, reactor["id"]).json == {"raw": "v2"}

    assert c.delete(f"/reactors/{reactor['id']}").status == 204
    assert c.get(f"/reactors/{reactor['id']}").status == 404


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"runtime": {"image": "node-svc"}}, "runtime.image"),
        ({"runtime": {}}, "runtime.image"),
        ({"runtime": None}, "runtime.image"),
        ({"runtime": {"image": "node20"}}, "runtime.image"),
        ({"application": {"id": str(uuid.uuid4())}}, "application.id"),
        ({"runtime": {"image": "node22", "timeout": 31}}, "runtime.timeout"),
        ({"runtime": {"image": "node22", "timeout": 0}}, "runtime.timeout"),
        ({"runtime": {"image": "node22", "resources": "huge"}}, "runtime.resources"),
        ({"runtime": {"image": "node22", "warm_concurrency": -1}}, "runtime.warm_concurrency"),
        ({"runtime": {"image": "node22", "dependencies": {"is-odd": "^3.0.1"}}}, "runtime.dependencies"),
        ({"runtime": {"image": "node22", "resolutions": {"is-number": "latest"}}}, "runtime.resolutions"),
        ({"runtime": {"image": "node22", "permissions": ["nope:nothing"]}}, "runtime.permissions"),
        ({"runtime": {"image": "node22", "cpu": 2}}, "runtime.cpu"),
        ({"name": "n" * 201}, "name"),
        ({"code": "x" * 50_001}, "code"),
        ({"code": ""}, "code"),
        ({"configuration": {"a": 1}}, "configuration.a"),
    ],
)
def test_invalid_bodies_answer_400_naming_the_field(tenant, fields, path):
    answer = tenant.client.post("/reactors", {**body(), **fields})
    assert answer.status == 400, answer
    assert path in answer.json["errors"], answer.json
    assert tenant.client.get("/reactors").json["data"] == []


def test_the_node_svc_refusal_names_the_deprecation(tenant):
    answer = tenant.client.post("/reactors", {**body(), "runtime": {"image": "node-svc"}})
    assert "October 5, 2026" in answer.json["errors"]["runtime.image"][0]


def test_code_of_50000_characters_and_a_name_of_200_are_taken(tenant):
    code = ECHO + " " * (50_000 - len(ECHO))
    answer = tenant.client.post("/reactors", body(code, name="n" * 200))
    assert answer.status == 201, answer


def test_legacy_permission_names_in_the_runtime_are_mapped(tenant):
    answer = tenant.client.post("/reactors", body(runtime={"image": "node22", "permissions": ["token:create"]}))
    assert answer.status == 201, answer
    assert answer.json["requested"]["reactor"]["runtime"]["permissions"] == ["token:general:create"]


def test_patch_needs_merge_patch_json_and_answers_204(tenant):
    c = tenant.client
    reactor = active(c, configuration={"A": "1", "B": "2"})
    assert c.patch(f"/reactors/{reactor['id']}", {"name": "x"}).status == 415
    assert c.get(f"/reactors/{reactor['id']}").json["state"] == "active"
    bad = c.patch(
        f"/reactors/{reactor['id']}", {"runtime": {"timeout": 99}}, content_type="application/merge-patch+json"
    )
    assert bad.status == 400 and "runtime.timeout" in bad.json["errors"], bad
    answer = c.patch(
        f"/reactors/{reactor['id']}",
        {"configuration": {"A": None, "C": "3"}, "name": "patched"},
        content_type="application/merge-patch+json",
    )
    assert answer.status == 204, answer
    after = settled(c, reactor["id"])
    assert (after["state"], after["name"], after["configuration"]) == ("active", "patched", {"B": "2", "C": "3"})
    renamed = c.patch(f"/reactors/{reactor['id']}", {"name": "renamed"}, content_type="application/merge-patch+json")
    assert renamed.status == 204
    now = c.get(f"/reactors/{reactor['id']}").json
    assert (now["state"], now["name"]) == ("active", "renamed")  # the version is the same: nothing to build


def test_update_and_delete_answer_409_while_a_build_runs(tenant):
    c = tenant.client
    reactor = active(c)
    with session_scope() as session:  # a build in flight, held still for the test (no task is sent)
        build = Job(
            kind="reactors.build",
            tenant_id=tenant.id,
            subject_type="reactor",
            subject_id=reactor["id"],
            status="running",
        )
        session.add(build)
        row = session.get(Reactor, uuid.UUID(reactor["id"]))
        row.state, row.build_job_id = "updating", build.id
    assert c.put(f"/reactors/{reactor['id']}", body()).status == 409
    patched = c.patch(f"/reactors/{reactor['id']}", {"name": "n"}, content_type="application/merge-patch+json")
    assert patched.status == 409
    assert c.delete(f"/reactors/{reactor['id']}").status == 409
    assert react(c, reactor["id"], {"still": "serving"}).json["raw"]["args"] == {"still": "serving"}
    with session_scope() as session:  # an operator cancels the build: it no longer holds the reactor
        session.get(Job, build.id).status = "cancelled"
    assert c.delete(f"/reactors/{reactor['id']}").status == 204


def test_permissions_and_tenants(tenant, other_tenant, limited):
    reader = limited(tenant, ["reactor:read"])
    assert reader.post("/reactors", body()).status == 403
    reactor = active(tenant.client)
    assert reader.get(f"/reactors/{reactor['id']}").status == 200
    assert react(reader, reactor["id"]).status == 403
    assert reader.delete(f"/reactors/{reactor['id']}").status == 403
    assert other_tenant.client.get(f"/reactors/{reactor['id']}").status == 404
    assert react(other_tenant.client, reactor["id"]).status == 404
    assert tenant.client.get("/reactors/not-a-uuid").status == 404


# ---- builds --------------------------------------------------------------------------------------


def test_vulnerable_dependencies_fail_a_create_and_outdate_an_update(tenant):
    c = tenant.client
    created = c.post("/reactors", body(runtime={"image": "node22", "dependencies": VULNERABLE}))
    assert created.status == 201, created
    failed = settled(c, created.json["id"])
    assert failed["state"] == "failed"
    assert failed["requested"]["error_code"] == "vulnerabilities_detected"
    assert failed["requested"]["error_details"]["vulnerabilities"] == [
        {
            "name": "is-number",
            "version": "6.0.0",
            "severity": "HIGH",
            "id": "CVE-2099-0001",
            "dependency_path": ["is-odd", "is-number"],
        }
    ]
    assert react(c, failed["id"]).status == 409

    serving = active(c)
    new_code = "const isOdd = require('is-odd'); module.exports = async () => ({ raw: isOdd(3) });"
    answer = c.put(
        f"/reactors/{serving['id']}", body(new_code, runtime={"image": "node22", "dependencies": VULNERABLE})
    )
    assert answer.status == 200, answer
    outdated = settled(c, serving["id"])
    assert outdated["state"] == "outdated"
    assert outdated["code"] == ECHO
    assert outdated["requested"]["reactor"]["code"] == new_code
    assert outdated["requested"]["error_code"] == "vulnerabilities_detected"
    assert react(c, serving["id"], {"old": True}).json["raw"]["args"] == {"old": True}

    # back to the serving version: active at once, nothing built
    back = c.put(f"/reactors/{serving['id']}", body())
    assert (back.json["state"], "requested" in back.json) == ("active", False)
    c.put(f"/reactors/{serving['id']}", body(new_code, runtime={"image": "node22", "dependencies": VULNERABLE}))
    assert settled(c, serving["id"])["state"] == "outdated"

    # a remediated version (no vulnerable package) builds and serves
    fixed = "const isNumber = require('is-number'); module.exports = async () => ({ raw: isNumber(3) });"
    c.put(
        f"/reactors/{serving['id']}", body(fixed, runtime={"image": "node22", "dependencies": {"is-number": "7.0.0"}})
    )
    assert settled(c, serving["id"])["state"] == "active"
    assert react(c, serving["id"]).json == {"raw": True}


# ---- invocation ----------------------------------------------------------------------------------


def test_react_detokenizes_the_arguments_and_passes_the_configuration(tenant):
    c = tenant.client
    token = c.post("/tokens", {"type": "token", "data": {"number": "4242424242424242"}})
    assert token.status == 201, token
    reactor = active(c, configuration={"SECRET": "s"})
    answer = react(c, reactor["id"], {"card": f'{{{{ {token.json["id"]} | json: "$.number" }}}}', "n": 1})
    assert answer.status == 200, answer
    assert answer.json == {"raw": {"args": {"card": "4242424242424242", "n": 1}, "configuration": {"SECRET": "s"}}}
    unknown = react(c, reactor["id"], {"card": "{{ 00000000-0000-0000-0000-000000000000 }}"})
    assert unknown.status == 400, unknown


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("BadRequestError", 400),
        ("InvalidReactorConfigurationError", 400),
        ("AuthenticationError", 401),
        ("InvalidPaymentMethodError", 402),
        ("RateLimitError", 429),
        ("VendorError", 500),
    ],
)
def test_thrown_error_classes_answer_their_status(tenant, name, status):
    code = (
        f"const {{ {name} }} = require('@tessera/reactor');"
        f"module.exports = async () => {{ throw new {name}('vendor said no', {{ 'args.x': 'bad' }}); }};"
    )
    reactor = active(tenant.client, code)
    answer = react(tenant.client, reactor["id"])
    assert answer.status == status, answer
    assert answer.json["detail"] == "vendor said no"
    assert answer.json["errors"] == {"args.x": ["bad"]}


def test_code_that_does_not_load_fails_its_build_and_an_unhandled_error_answers_500_with_its_message(tenant):
    """Replaces the test that such code became active and answered 422 at each invocation: the build
    now loads the code once in the sandbox and refuses it (``invalid_code``), and an unhandled error's
    name and message reach the caller, without the request data it quotes."""
    c = tenant.client
    for code, why in [
        ("module.exports = 42;", "not_a_function"),
        ("module.exports = async (", "syntax at line 1: SyntaxError"),
    ]:
        created = c.post("/reactors", body(code))
        assert created.status == 201, created
        failed = settled(c, created.json["id"])
        assert (failed["state"], failed["requested"]["error_code"]) == ("failed", "invalid_code"), failed
        assert why in failed["requested"]["error_message"]
        assert react(c, failed["id"]).status == 409
    serving = active(c)
    assert c.put(f"/reactors/{serving['id']}", body("module.exports = async (")).status == 200
    outdated = settled(c, serving["id"])
    assert (outdated["state"], outdated["requested"]["error_code"]) == ("outdated", "invalid_code")
    assert react(c, serving["id"], {"still": 1}).json["raw"]["args"] == {"still": 1}

    throwing = active(c, "module.exports = async (r) => { throw new Error('no brand for ' + r.args.n); };")
    thrown = react(c, throwing["id"], {"n": "4242424242424242"})
    assert thrown.status == 500
    assert thrown.json["detail"] == "The reactor code threw an unhandled Error: no brand for [redacted]"
    assert "4242424242424242" not in thrown.raw.decode()


def test_a_scan_the_registry_refuses_fails_the_build_at_once_naming_the_setting(tenant, monkeypatch):
    import tasks.reactors
    from infra.node_runtime.packages import AuditRefused

    class Refusing:
        def build(self, runtime, **_):
            raise AuditRefused(
                "405 Method Not Allowed - POST https://registry.example/-/npm/v1/security/audits/quick", 405
            )

    monkeypatch.setattr(tasks.reactors, "reactor_runtime", Refusing)
    created = tenant.client.post("/reactors", body())
    assert created.status == 201, created
    failed = settled(tenant.client, created.json["id"], deadline=30)
    assert (failed["state"], failed["requested"]["error_code"]) == ("failed", "build_failed"), failed
    assert "TESSERA_REACTOR_ADVISORIES" in failed["requested"]["error_message"]
    assert "HTTP 405" in failed["requested"]["error_message"]
    with session_scope() as session:
        build = session.exec(
            select(Job).where(Job.kind == "reactors.build", Job.subject_id == created.json["id"])
        ).one()
        assert build.attempts == 1


def test_a_reactor_looping_forever_is_killed_at_its_timeout_and_the_worker_goes_on(tenant):
    looping = active(
        tenant.client, "module.exports = async () => { for (;;) {} };", runtime={"image": "node22", "timeout": 1}
    )
    answer = react(tenant.client, looping["id"])
    assert answer.status == 500, answer
    assert answer.json["title"] == "Reactor Timeout"
    echo = active(tenant.client)
    assert react(tenant.client, echo["id"], {"after": 1}).json["raw"]["args"] == {"after": 1}


def test_the_code_cannot_read_the_platform_files_or_environment(tenant):
    code = """
        const fs = require('fs');
        const attempt = (f) => { try { f(); return 'read'; } catch (e) { return e.code || e.name; } };
        module.exports = async () => ({ raw: {
          passwd: attempt(() => fs.readFileSync('/etc/passwd')),
          env: Object.keys(process.env).filter((k) => k.startsWith('TESSERA_') || k.startsWith('AWS_')),
        } });
    """
    answer = react(tenant.client, active(tenant.client, code)["id"])
    assert answer.json["raw"] == {"passwd": "ERR_ACCESS_DENIED", "env": []}


def test_a_tokenize_block_creates_tokens_with_the_permissions_granted_to_the_code(tenant):
    code = """module.exports = async (req) => ({
        raw: { ok: true }, tokenize: { card: { type: 'token', data: req.args.secret }, plain: req.args.secret } });"""
    granted = active(tenant.client, code, runtime={"image": "node22", "permissions": ["token:general:create"]})
    answer = react(tenant.client, granted["id"], {"secret": "s3cr3t-value"})
    assert answer.status == 200, answer
    assert answer.json["raw"] == {"ok": True}
    made = answer.json["tokens"]
    assert made["card"]["type"] == "token"
    read = tenant.client.get(f"/tokens/{made['card']['id']}")
    assert read.json["data"] == "s3cr3t-value"
    assert tenant.client.get(f"/tokens/{made['plain']}").json["data"] == "s3cr3t-value"

    ungranted = active(tenant.client, code)
    refused = react(tenant.client, ungranted["id"], {"secret": "x"})
    assert refused.status == 403, refused


def test_callback_url_is_shut_down(tenant):
    reactor = active(tenant.client)
    answer = tenant.client.post(f"/reactors/{reactor['id']}/react", {"args": {}, "callback_url": "https://x.example"})
    assert answer.status == 400
    assert "January 15, 2025" in answer.json["errors"]["callback_url"][0]


def test_a_payload_over_1_mb_answers_413(tenant):
    reactor = active(tenant.client)
    answer = react(tenant.client, reactor["id"], {"blob": "x" * (1024 * 1024)})
    assert answer.status == 413


def test_react_async_then_the_result_and_the_event(tenant):
    c = tenant.client
    reactor = active(c, "module.exports = async (r) => ({ raw: r.args.n * 2 });")
    assert c.get(f"/reactors/{reactor['id']}/results/{uuid.uuid4()}").status == 404
    started = c.post(f"/reactors/{reactor['id']}/react-async", {"args": {"n": 21}})
    assert started.status == 202, started
    request_id = started.json["async_reactor_request_id"]
    end = time.monotonic() + 60
    while (result := c.get(f"/reactors/{reactor['id']}/results/{request_id}")).status == 404 and time.monotonic() < end:
        time.sleep(0.1)
    assert (result.status, result.json) == (200, {"raw": 42})
    with session_scope() as session:
        found = session.exec(select(Event).where(Event.tenant_id == tenant.id)).all()
    assert [(e.type, e.data["request_id"]) for e in found if e.type.startswith("reactor.")] == [
        ("reactor.invocation.completed", request_id)
    ]

    failing = active(
        c,
        "const { RateLimitError } = require('@tessera/reactor');"
        "module.exports = async () => { throw new RateLimitError('slow down'); };",
    )
    started = c.post(f"/reactors/{failing['id']}/react-async", {"args": {}})
    request_id = started.json["async_reactor_request_id"]
    end = time.monotonic() + 60
    while (result := c.get(f"/reactors/{failing['id']}/results/{request_id}")).status == 404 and time.monotonic() < end:
        time.sleep(0.1)
    assert (result.status, result.json["detail"]) == (429, "slow down")
    with session_scope() as session:
        types = [
            e.type
            for e in session.exec(select(Event).where(Event.tenant_id == tenant.id)).all()
            if e.data.get("request_id") == request_id
        ]
    assert types == ["reactor.invocation.failed"]


# ---- reactor formulas ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/reactor-formulas"),
        ("GET", "/reactor-formulas"),
        ("GET", "/reactor-formulas/abc"),
        ("PUT", "/reactor-formulas/abc"),
    ],
)
def test_reactor_formulas_are_gone(tenant, method, path):
    answer = tenant.client.request(method, path, {"name": "f"} if method in ("POST", "PUT") else None)
    assert answer.status == 410, answer
    assert "reactors" in answer.json["detail"]


def test_results_are_purged_after_their_retention(tenant):
    from domain.reactors.runs import purge_results
    from storage.types import utcnow

    c = tenant.client
    reactor = active(c)
    started = c.post(f"/reactors/{reactor['id']}/react-async", {"args": {"n": 1}})
    path = f"/reactors/{reactor['id']}/results/{started.json['async_reactor_request_id']}"
    end = time.monotonic() + 60
    while c.get(path).status == 404 and time.monotonic() < end:
        time.sleep(0.1)
    assert c.get(path).status == 200
    with session_scope() as session:
        assert purge_results(session, before=utcnow() - dt.timedelta(hours=1)) == 0
    assert c.get(path).status == 200
    with session_scope() as session:
        assert purge_results(session, before=utcnow() + dt.timedelta(seconds=1), batch=10_000) >= 1
    assert c.get(path).status == 404
