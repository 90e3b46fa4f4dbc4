"""The OpenAPI description stands alone: it cites no document a user does not have, every request
example is one the running API accepts, and every answer example fits its schema with realistic values."""

from __future__ import annotations

import json
import re
import uuid

import pytest
import urllib3

pytestmark = pytest.mark.api

#: Citations of documents users do not have ("core document section 7", "spec 001", "rules 1, 7, 8" ...).
_CITATION = re.compile(
    r"core document|second document|§|\bspec\b|\bspec's\b|\bsections? \d|\breference\b"
    r"|\brules? \d|:data:`",
    re.I,
)
#: Values no real answer holds: what a generator writes when it knows nothing of the field.
_PLACEHOLDERS = {"string", "text", "..."}
#: Operations whose body is forwarded to a destination as it is (any media type): no example to send.
_PASS_THROUGH = {"/proxy", "/proxy/{tail}"}
#: Wallet operations that need what a fresh tenant lacks: key material only a wallet or a certificate
#: authority makes (signed payment data, a merchant key pair) or a domain registered first. They may answer
#: 422 (refused for content or set-up); a refusal of their shape would be 400.
_NEEDS_WALLET_SET_UP = {
    "/wallet-a",
    "/wallet-b",
    "/wallet-a/merchant-certificates",
    "/wallet-b/merchant-keys",
    "/wallet-a/session",
}
#: How a problem says that an id the request names does not exist in the tenant.
_UNKNOWN_ID = re.compile(r"unknown id|no .* with this id exists|not found", re.I)


def _strings(value, path=""):
    """Every string in ``value`` with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")
    elif isinstance(value, str):
        yield path, value


def _texts(value, path=""):
    """Every description and summary in the description, with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("description", "summary") and isinstance(item, str):
                yield f"{path}/{key}", item
            else:
                yield from _texts(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}/{index}")


def test_the_description_cites_no_outside_document(api):
    doc = api.client().get("/openapi.json").json
    cited = [
        (where, text[max(0, m.start() - 40) : m.end() + 40])
        for where, text in _texts(doc)
        for m in [_CITATION.search(text)]
        if m
    ]
    assert cited == []


def _names_an_id(path: str, body) -> bool:
    """Whether the request names a resource by id (a path parameter, a ``*_id`` member, an invitation
    link's token or a token expression): a fresh tenant owns none, so 404 is its legitimate answer."""
    if "{" in path:
        return True
    members = {key for key, _ in ((p.rsplit(".", 1)[-1], v) for p, v in _strings(body))}
    text = json.dumps(body)
    return any(m.endswith("_id") or m == "token" for m in members) or "{{" in text


def _send(client, method: str, path: str, media: str, example):
    if media.endswith("json"):
        return client.request(method, path, example, content_type=media)
    if media == "application/x-www-form-urlencoded":
        from urllib.parse import urlencode

        return client.request(method, path, raw=urlencode(example).encode(), content_type=media)
    if media == "multipart/form-data":
        fields = {
            key: (f"{key}.pdf", b"%PDF-1.4 example", "application/pdf") if value == "..." else value
            for key, value in example.items()
        }
        body, content_type = urllib3.encode_multipart_formdata(fields)
        return client.request(method, path, raw=body, content_type=content_type)
    raise AssertionError(f"{method} {path}: no way to send {media}")


def test_every_request_example_is_accepted(api, tenant):
    """Each documented request example, sent as it stands (path parameters a fresh uuid) by a fresh tenant
    whose management key holds every permission, is not refused as invalid. The rule: 2xx and 3xx are
    accepted; 404 only when the request names a resource by id (a fresh tenant owns none), and 400 too
    when its problem says only that the named id does not exist in the tenant (the agentic catalogue's
    ``INVALID_TOKEN``, an unknown id in a detokenization expression); 422 only for the wallet operations
    of ``_NEEDS_WALLET_SET_UP``. Every other 4xx means the example is wrong."""
    doc = api.client().get("/openapi.json").json
    refused = []
    sent = 0
    for template, operations in doc["paths"].items():
        if template in _PASS_THROUGH:
            continue
        for method, operation in operations.items():
            for media, content in operation.get("requestBody", {}).get("content", {}).items():
                if "example" not in content:
                    continue
                path = re.sub(r"{\w+}", lambda _: str(uuid.uuid4()), template)
                answer = _send(tenant.client, method.upper(), path, media, content["example"])
                sent += 1
                status = answer.status
                if status < 400 or (status == 404 and _names_an_id(template, content["example"])):
                    continue
                detail = (answer.json or {}).get("detail", "")
                if status == 400 and _names_an_id(template, content["example"]) and _UNKNOWN_ID.search(detail):
                    continue
                if template in _NEEDS_WALLET_SET_UP and status == 422:
                    continue
                refused.append((method.upper(), template, media, status, answer.raw[:300]))
    assert sent > 40
    assert refused == [], "\n".join(map(repr, refused))


def test_every_answer_example_fits_its_schema_with_real_values(api):
    """Each success answer's example validates against the answer's schema (so it has every required
    field) and holds no placeholder (``"string"``, ``"..."``) where a real answer has a value."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    doc = api.client().get("/openapi.json").json
    registry = Registry().with_resource("urn:tessera", Resource.opaque(doc))
    wrong = []
    checked = 0
    for template, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, answer in operation["responses"].items():
                if not status.startswith("2"):
                    continue
                for media, content in (answer.get("content") or {}).items():
                    if "example" not in content or not media.endswith("json"):
                        continue
                    checked += 1
                    pointer = "/".join(
                        (
                            "",
                            "paths",
                            template.replace("~", "~0").replace("/", "~1"),
                            method,
                            "responses",
                            status,
                            "content",
                            media.replace("/", "~1"),
                            "schema",
                        )
                    )
                    validator = Draft202012Validator({"$ref": "urn:tessera#" + pointer}, registry=registry)
                    errors = [e.message for e in validator.iter_errors(content["example"])]
                    placeholders = [where for where, value in _strings(content["example"]) if value in _PLACEHOLDERS]
                    if errors or placeholders:
                        wrong.append((method.upper(), template, status, errors[:2], placeholders[:3]))
    assert checked > 80
    assert wrong == []


def test_the_root_points_to_the_docs(api):
    answer = api.client().get("/")
    assert answer.status == 302
    assert answer.headers["Location"] == "/docs"
    assert api.client().get(answer.headers["Location"]).status == 200
