"""Non-code proxy transforms as pure functions, and tokenizing through the token domain."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import TypeAdapter, ValidationError

from domain.proxy.errors import TRANSFORM_INITIALIZING, ProxyError
from domain.proxy.models import TRANSFORM_TAGS
from domain.proxy.transforms import (
    DomainTokenizer,
    Message,
    TransformList,
    apply_request_transforms,
    apply_response_transforms,
    dump_transforms,
    load_transforms,
)
from domain.tokens import service as tokens
from infra.errors import Problem, validation_errors
from storage.db import session_scope

BODY = {"card": {"number": "4242424242424242", "cvc": "123"}, "items": [{"number": "1"}, {"number": 2}]}


class Recorder:
    """A tokenizer that records its requests and hands out ids (the pure tests' stand-in; the
    platform's own tokenizer is exercised in test_tokenize_through_the_token_domain)."""

    def __init__(self):
        self.requests: list[dict] = []

    def tokenize(self, requests):
        self.requests += requests
        return [f"tok_{len(self.requests) - len(requests) + i}" for i in range(len(requests))]


def run_request(*args, **kwargs) -> Message:
    return asyncio.run(apply_request_transforms(*args, **kwargs))


def run_response(*args, **kwargs) -> Message:
    return asyncio.run(apply_response_transforms(*args, **kwargs))


def _message(body, headers=()) -> Message:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Message(list(headers), raw, "application/json")


def test_transforms_run_in_order():
    transforms = load_transforms(
        [
            {"type": "tokenize", "location": "$.card", "token": {"type": "card", "metadata": {"from": "proxy"}}},
            {"type": "append_json", "location": "$.meta.source", "value": {"v": 1}},
            {"type": "mask", "matcher": "jsonpath", "expression": "$.items[*].number"},
            {"type": "append_header", "location": "X-Extra", "value": "1"},
        ]
    )
    recorder = Recorder()
    out = run_request(transforms, _message(BODY, [("Accept", "*/*")]), recorder)
    assert json.loads(out.body) == {
        "card": "tok_0",
        "items": [{"number": "*"}, {"number": "*"}],
        "meta": {"source": {"v": 1}},
    }
    assert recorder.requests == [{"type": "card", "metadata": {"from": "proxy"}, "data": BODY["card"]}]
    assert out.headers == [("Accept", "*/*"), ("X-Extra", "1")]


def test_mask_by_regex_and_append_text():
    transforms = load_transforms(
        [
            {"type": "mask", "matcher": "regex", "expression": r"cvc=(\d+)&pan=\d{6}(\d+)\d{4}", "replacement": "#"},
            {"type": "mask", "matcher": "regex", "expression": "secret"},
            {"type": "append_text", "value": "&end=1"},
        ]
    )
    out = run_request(transforms, Message([], b"cvc=123&pan=4242424242424242&secret", None), Recorder())
    assert out.body == b"cvc=###&pan=424242######4242&******&end=1"


def test_response_transforms_only_on_success():
    transforms = load_transforms([{"type": "tokenize", "location": "$.card.number", "token": {"type": "token"}}])
    message = _message(BODY)
    recorder = Recorder()
    assert run_response(transforms, 402, message, recorder) is message
    assert run_response(transforms, 302, message, recorder) is message
    assert recorder.requests == []
    out = run_response(transforms, 201, message, recorder)
    assert json.loads(out.body)["card"] == {"number": "tok_0", "cvc": "123"}


def test_code_transforms_are_stored_but_wait_for_their_runtime():
    transforms = load_transforms([{"type": "code", "code": "module.exports = async (req) => req;"}])
    assert dump_transforms(transforms) == [{"type": "code", "code": "module.exports = async (req) => req;"}]
    with pytest.raises(ProxyError) as caught:
        run_request(transforms, _message(BODY), Recorder())
    assert caught.value.status == 503
    assert caught.value.body()["proxy_error"]["title"] == TRANSFORM_INITIALIZING


def test_code_transforms_run_through_the_code_runner_in_order():
    transforms = load_transforms(
        [
            {"type": "append_header", "location": "X-Before", "value": "1"},
            {"type": "code", "code": "module.exports = async (req) => req;"},
            {"type": "append_text", "value": "!"},
        ]
    )
    seen = []

    async def runner(transform, message, side):
        seen.append((transform.code, message.headers, side))
        return Message([*message.headers, ("X-Code", side)], b"from code", message.content_type)

    out = run_request(transforms, _message(BODY), Recorder(), code_runner=runner)
    assert seen == [("module.exports = async (req) => req;", [("X-Before", "1")], "request")]
    assert out.headers == [("X-Before", "1"), ("X-Code", "request")] and out.body == b"from code!"
    out = run_response(transforms, 200, _message(BODY), Recorder(), code_runner=runner)
    assert seen[-1][2] == "response" and out.body == b"from code!"
    with pytest.raises(ProxyError) as caught:
        run_response(transforms, 200, _message(BODY), Recorder())
    assert caught.value.status == 503 and caught.value.errors == {"response_transforms[1]": ["runtime initializing"]}


def test_transforms_that_do_not_fit_the_body():
    for spec, body in (
        ({"type": "mask", "matcher": "jsonpath", "expression": "$.a"}, b"not json"),
        ({"type": "append_json", "location": "$.a.b", "value": 1}, b'{"a": 1}'),
        ({"type": "append_text", "value": "x"}, b"\xff"),
    ):
        with pytest.raises(ProxyError) as caught:
            run_request(load_transforms([spec]), _message(body), Recorder())
        assert caught.value.status == 400 and list(caught.value.errors) == ["request_transforms[0]"]


def test_validation_errors_per_field():
    with pytest.raises(ValidationError) as caught:
        TypeAdapter(TransformList).validate_python(
            [
                {"type": "mask", "matcher": "regex", "expression": "("},
                {"type": "mask", "matcher": "jsonpath", "expression": "a.b"},
                {"type": "append_json", "location": "$..a", "value": 1},
                {"type": "append_header", "location": "Bad Name", "value": "x"},
                {"type": "append_header", "location": "X-A", "value": "a\r\nb"},
                {"type": "tokenize", "location": "$.a", "token": {"data": 1}},
                {"type": "code", "code": "x" * 50_001, "runtime": {"image": "node22"}},
                {"type": "shell"},
                {"type": "append_text", "value": "x", "other": 1},
            ]
        )
    errors = validation_errors(caught.value, union_tags=TRANSFORM_TAGS)
    assert sorted(errors) == [
        "[0].expression",
        "[1].expression",
        "[2].location",
        "[3].location",
        "[4].value",
        "[5].token",
        "[6].code",
        "[7]",
        "[8].other",
    ]


def test_tokenize_through_the_token_domain(vault):
    transforms = load_transforms([{"type": "tokenize", "location": "$.card", "token": {"type": "card"}}])
    with session_scope() as session:
        out = run_response(transforms, 200, _message(BODY), DomainTokenizer(session, vault.caller()))
        token_id = json.loads(out.body)["card"]
        stored = tokens.read_token(session, vault.caller(), token_id)
    assert stored["type"] == "card" and stored["data"]["number"] == BODY["card"]["number"]
    with session_scope() as session, pytest.raises(Problem) as caught:
        tokenizer = DomainTokenizer(session, vault.caller("proxy:invoke"))
        run_response(transforms, 200, _message(BODY), tokenizer)
    assert caught.value.status == 403
