"""Proxy code transforms run by the reactor runtime in a real worker (``code_transform_runner``),
called directly as the proxy will call it: the new message, the errors in the proxy's form, a
dependency with a critical advisory blocking the invocation."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest

from config.settings import reload_settings
from domain.proxy.errors import TRANSFORM_FAILED, ProxyError
from domain.proxy.transforms import CodeTransform, Message
from domain.reactors.transforms import INVOCATION_BLOCKED, code_transform_runner
from domain.tenancy.auth import authenticate
from storage.db import session_scope


@pytest.fixture
def caller(tenant):
    with session_scope() as session:
        return authenticate(session, tenant.api_key)


def run(caller, code: str, message: Message, side: str = "request", **kw) -> Message:
    kw.setdefault("proxy_id", uuid.uuid4())
    runner = code_transform_runner(caller, **kw)
    return asyncio.run(runner(CodeTransform(type="code", code=code, runtime={"image": "node22"}), message, side))


JSON_REQUEST = Message(
    [("Content-Type", "application/json"), ("X-In", "1")], b'{"card": "4242", "n": 2}', "application/json"
)


def test_a_request_transform_rewrites_body_and_headers(caller):
    code = """module.exports = async (req) => ({
        body: { ...req.args.body, n: req.args.body.n * 10, key: req.configuration.KEY },
        headers: { ...req.args.headers, 'X-Out': 'yes' } });"""
    out = run(caller, code, JSON_REQUEST, configuration={"KEY": "k"})
    assert json.loads(out.body) == {"card": "4242", "n": 20, "key": "k"}
    assert ("X-Out", "yes") in out.headers and ("X-In", "1") in out.headers
    assert out.content_type == "application/json"


def test_a_response_transform_on_text_and_one_returning_nothing(caller):
    text = Message([], b"plain answer", "text/plain")
    out = run(caller, "module.exports = async (r) => ({ body: r.args.body.toUpperCase() });", text, "response")
    assert (out.body, out.headers) == (b"PLAIN ANSWER", [])
    assert run(caller, "module.exports = async () => {};", text, "response") == text


def test_a_thrown_error_is_a_proxy_error_with_its_status(caller):
    code = (
        "const { BadRequestError } = require('@tessera/reactor');"
        "module.exports = async () => { throw new BadRequestError('no card'); };"
    )
    with pytest.raises(ProxyError) as caught:
        run(caller, code, JSON_REQUEST)
    assert caught.value.body()["proxy_error"]["status"] == 400
    assert caught.value.body()["proxy_error"]["title"] == TRANSFORM_FAILED
    assert caught.value.body()["proxy_error"]["errors"]["request_transforms"] == ["no card"]
    with pytest.raises(ProxyError) as caught:
        run(caller, "module.exports = async (", JSON_REQUEST)
    assert caught.value.status == 422


def test_a_critical_advisory_on_a_dependency_blocks_the_invocation(caller, tmp_path):
    advisories = tmp_path / "advisories.json"
    advisories.write_text(
        json.dumps([{"name": "is-number", "version": "7.0.0", "severity": "CRITICAL", "id": "CVE-2099-0007"}])
    )
    os.environ["TESSERA_REACTOR_ADVISORIES"] = str(advisories)
    reload_settings()
    try:
        transform = CodeTransform(
            type="code",
            code="module.exports = async () => ({ body: 'ran' });",
            runtime={"image": "node22", "dependencies": {"is-number": "7.0.0"}},
        )
        with pytest.raises(ProxyError) as caught:
            asyncio.run(code_transform_runner(caller, proxy_id=uuid.uuid4())(transform, JSON_REQUEST, "request"))
    finally:
        del os.environ["TESSERA_REACTOR_ADVISORIES"]
        reload_settings()
    assert (caught.value.status, caught.value.title) == (403, INVOCATION_BLOCKED)
    assert "CVE-2099-0007" in caught.value.detail


def test_no_answer_within_the_wait_is_the_503_of_an_initializing_runtime(caller):
    from domain.proxy.errors import TRANSFORM_INITIALIZING

    slow = "module.exports = async () => { await new Promise((r) => setTimeout(r, 3000)); return {}; };"
    with pytest.raises(ProxyError) as caught:
        run(caller, slow, JSON_REQUEST, timeout=0.2)
    assert (caught.value.status, caught.value.title) == (503, TRANSFORM_INITIALIZING)
