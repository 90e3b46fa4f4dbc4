"""Detokenization against stored tokens, network tokens, token intents and client-encrypted
payloads in the real database (core document section 4, Proxy rules 1, 7, 8; sections 5, 7, 8)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import uuid

import pytest
from joserfc import jwe
from joserfc.jwk import OKPKey
from sqlmodel import select

from domain.client_keys import service as client_keys
from domain.network_tokens import token_intents
from domain.network_tokens import views as network_tokens
from domain.proxy.detokenize import MAX_TOKENS, body_kind, detokenize, parse_expression
from domain.proxy.errors import ProxyError
from domain.proxy.values import SqlValueLoader
from domain.tokens import service as tokens
from domain.tokens.expressions import evaluate
from storage.crypto import get_keyring
from storage.db import session_scope
from storage.models_network_tokens import NetworkToken
from storage.models_tenancy import TokenActivity

PAN = "4242424242424242"
CARD = {"number": PAN, "expiration_month": 12, "expiration_year": 2030, "cvc": "123"}
JSON = "application/json"


def _token(vault, body: dict) -> str:
    with session_scope() as session:
        return tokens.create_token(session, vault.caller(), body)["id"]


def _card(vault, **extra) -> str:
    return _token(vault, {"type": "card", "data": CARD, **extra})


def _run(vault, caller, body: bytes | None, *, headers=(), content_type=JSON, encrypted=None):
    with session_scope() as session:
        return detokenize(
            caller,
            SqlValueLoader(session),
            headers=list(headers),
            body=body,
            content_type=content_type,
            encrypted_header=encrypted,
        )


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _refused(vault, caller, body: bytes, **kw) -> ProxyError:
    with pytest.raises(ProxyError) as caught:
        _run(vault, caller, body, **kw)
    error = caught.value
    shape = error.body()
    assert list(shape) == ["proxy_error"]
    assert set(shape["proxy_error"]) == {"errors", "title", "status", "detail"}
    # the cvc is looked for outside the ids a detail names (a random UUID may hold "123")
    detail = _UUID.sub("<id>", json.dumps(shape["proxy_error"]["detail"]))
    assert PAN not in json.dumps(shape) and "123" not in detail
    return error


def test_json_body_forms(vault):
    card = _card(vault, metadata={"ref": "order-1"})
    secret = _token(vault, {"type": "token", "data": 's3cr"et'})
    body = (
        (
            '{"number": "{{ C | json: \\"$.number\\" }}", "month": {{ C | json: "$.expiration_month" }},'
            ' "exp": "{{ C | card_exp: \'MM/YY\' }}", "card": {{ C }}, "ref": "{{ token: C | json: '
            '\'$.metadata.ref\' }}", "text": "x{{ S }}y", "plain": {{ S }}, "cvc": "{{ C, json: '
            "'$.cvc', pad_left: 4, '0' }}\"}"
        )
        .replace("C", card)
        .replace("S", secret)
    )
    out = _run(vault, vault.caller("proxy:invoke", "token:pci:use:proxy", "token:general:use:proxy"), body.encode())
    assert json.loads(out.body) == {
        "number": PAN,
        "month": 12,
        "exp": "12/30",
        "card": CARD,
        "ref": "order-1",
        "text": 'xs3cr"ety',
        "plain": 's3cr"et',
        "cvc": "0123",
    }
    assert {ref.id for ref in out.refs} == {card, secret}


def test_usage_counts_detokenized_tokens(vault):
    card = _card(vault)
    with session_scope() as session:
        session.exec(select(TokenActivity).where(TokenActivity.tenant_id == vault.tenant_id)).all()
        for row in session.exec(select(TokenActivity).where(TokenActivity.tenant_id == vault.tenant_id)):
            session.delete(row)
    _run(vault, vault.caller(), f'"{{{{ {card} | json: "$.number" | last4 }}}}"'.encode(), content_type="text/plain")
    with session_scope() as session:
        ids = [
            row.token_id
            for row in session.exec(select(TokenActivity).where(TokenActivity.tenant_id == vault.tenant_id))
        ]
    assert ids == [card]


def test_form_xml_text_and_headers(vault):
    card = _card(vault)
    caller = vault.caller("proxy:invoke", "token:pci:use:proxy")
    form = f"amount=10&card%5Bnumber%5D=%7B%7B+{card}+%7C+json%3A+%22%24.number%22+%7D%7D&note=a+b%26c".encode()
    out = _run(vault, caller, form, content_type="application/x-www-form-urlencoded")
    assert out.body == f"amount=10&card%5Bnumber%5D={PAN}&note=a+b%26c".encode()

    xml = f"<card n=\"{{{{ {card} | to_string }}}}\"><pan>{{{{ {card} | json: '$.number' }}}}</pan></card>"
    out = _run(vault, caller, xml.encode(), content_type="application/xml; charset=utf-8")
    assert out.body.decode().startswith('<card n="{&quot;cvc&quot;:&quot;123&quot;')
    assert f"<pan>{PAN}</pan>" in out.body.decode()

    out = _run(
        vault,
        caller,
        f"pan={{{{ {card} | json: '$.number' | reveal_last: 4 }}}}".encode(),
        content_type="text/plain",
        headers=[("Authorization", f"Basic {{{{ {card} | json: '$.number' | to_base64 }}}}"), ("Accept", "*/*")],
    )
    assert out.body == b"pan=XXXXXXXXXXXX4242"
    assert out.headers == [("Authorization", "Basic " + base64.b64encode(PAN.encode()).decode()), ("Accept", "*/*")]


def test_a_body_without_expressions_is_untouched_and_needs_no_right(vault):
    body = b'{"a": "{ not an expression }"}'
    out = _run(vault, vault.caller("token:pci:create"), body)
    assert out.body is body and out.refs == ()
    binary = b"\xff\xfe{{ x }}"
    assert _run(vault, vault.caller(), binary, content_type="application/octet-stream").body is binary


def test_rights(vault):
    card = _card(vault)
    general = _token(vault, {"type": "token", "data": "g", "containers": ["/general/low/"]})
    body = f'{{"n": "{{{{ {card} | json: \'$.number\' }}}}"}}'.encode()
    error = _refused(vault, vault.caller("token:pci:use:proxy"), body)
    assert (error.status, error.detail) == (403, "The API key lacks the permission proxy:invoke.")
    error = _refused(vault, vault.caller("proxy:invoke", "token:general:use:proxy"), body)
    assert error.status == 403 and "token:pci:use:proxy" in error.detail
    # the legacy token:use is the general classification's proxy use
    from domain.tenancy.permissions import effective_permissions

    legacy = vault.caller(*effective_permissions(["proxy:invoke", "token:use"]))
    assert _run(vault, legacy, f'"{{{{ {general} }}}}"'.encode()).body == b'"g"'
    error = _refused(vault, legacy, body)
    assert error.status == 403


def test_unknown_and_other_tenants_ids(vault, other_vault):
    foreign = _card(other_vault)
    error = _refused(vault, vault.caller(), f'["{{{{ {foreign} }}}}", "{{{{ nope-xyz }}}}"]'.encode())
    assert error.status == 400 and foreign in error.detail and "nope-xyz" in error.detail
    intent = str(uuid.uuid4())
    error = _refused(vault, vault.caller(), f'"{{{{ token_intent: {intent} | json: "$.data.number" }}}}"'.encode())
    assert error.status == 400 and intent in error.detail


def test_at_most_twenty_distinct_tokens(vault):
    ids = [_token(vault, {"type": "token", "data": str(i)}) for i in range(MAX_TOKENS + 1)]
    twenty = " ".join(f"{{{{ {i} }}}}" for i in ids[:MAX_TOKENS]) + f" {{{{ {ids[0]} | to_string }}}}"
    out = _run(vault, vault.caller(), twenty.encode(), content_type="text/plain")
    assert out.body.decode().split(" ") == [str(i) for i in range(MAX_TOKENS)] + ["0"]
    error = _refused(vault, vault.caller(), (twenty + f" {{{{ {ids[-1]} }}}}").encode(), content_type="text/plain")
    assert error.status == 400 and str(MAX_TOKENS) in error.detail


def test_render_errors_never_quote_values(vault):
    card = _card(vault)
    for source in (
        f"{{{{ {card} | json: '$.number' | divided_by: 0 }}}}",
        f"{{{{ {card} | json: '$.number' | map: 'a' }}}}",
        f"{{{{ {card} | json: '$.number' | slice: 'x' }}}}",
        f"{{{{ {card} | json: '$.number' | card_exp }}}}",
        f"{{{{ {card} | nosuchfilter }}}}",
        f"{{{{ {card} | json: '$..x' }}}}",
        f"{{{{ {card} garbage }}}}",
    ):
        error = _refused(vault, vault.caller(), source.encode(), content_type="text/plain")
        assert error.status == 400


def test_network_tokens(vault):
    with session_scope() as session:
        row = NetworkToken(tenant_id=vault.tenant_id, status="active", card={"last4": "4242"})
        dpan = {"number": "4895370012003478", "expiration_month": 11, "expiration_year": 2031}
        row.data_ct = get_keyring().encrypt(
            session, vault.tenant_id, network_tokens.DATA_PURPOSE, str(row.id), json.dumps(dpan).encode()
        )
        session.add(row)
        inactive = NetworkToken(tenant_id=vault.tenant_id, status="inactive")
        session.add(inactive)
    source = f'{{"n": "{{{{ network_token: {row.id} | json: "$.data.number" }}}}", "c": "{{{{ network_token: '
    source += f'{row.id} | json: "$.cryptogram" }}}}"}}'
    out = _run(vault, vault.caller("proxy:invoke"), source.encode(), content_type="text/plain")
    assert out.body.decode() == '{"n": "4895370012003478", "c": ""}'  # no cryptogram, ever
    error = _refused(vault, vault.caller(), f"{{{{ network_token: {inactive.id} }}}}".encode())
    assert error.status == 422
    error = _refused(vault, vault.caller(), b"{{ network_token: not-a-uuid }}")
    assert error.status == 400


def test_token_intents(vault):
    with session_scope() as session:
        intent = token_intents.create_intent(session, vault.caller(), type="card", data=CARD)
    source = f'{{{{ token_intent: {intent["id"]} | json: "$.data.number" }}}}'.encode()
    assert (
        _run(vault, vault.caller("proxy:invoke", "token:pci:use:proxy"), source, content_type="text/plain").body
        == PAN.encode()
    )
    assert _refused(vault, vault.caller("proxy:invoke"), source).status == 403


def _encrypted(vault, entries: dict) -> str:
    with session_scope() as session:
        key = client_keys.create_key(session, vault.caller(), expires_at=None, default_days=30)
    public = OKPKey.import_key(key["public_key_pem"])
    registry = jwe.JWERegistry(algorithms=["ECDH-ES", "A256GCM"])

    def seal(payload):
        protected = {"alg": "ECDH-ES", "enc": "A256GCM", "kid": key["key_id"]}
        return jwe.encrypt_compact(protected, json.dumps(payload).encode(), public, registry=registry)

    if "type" in entries:
        envelope = {"type": entries["type"], "encrypted": seal({"data": entries["data"]})}
    else:
        envelope = {name: {"type": e["type"], "encrypted": seal({"data": e["data"]})} for name, e in entries.items()}
    return base64.b64encode(json.dumps(envelope).encode()).decode()


def test_encrypted_single_and_multiple_forms(vault):
    caller = vault.caller("proxy:invoke")
    single = _encrypted(vault, {"type": "card", "data": CARD})
    body = b'{"pan": "{{ encrypted | json: \\"$.data.number\\" }}", "exp": "{{ encrypted | card_exp }}"}'
    out = _run(vault, caller, body, encrypted=single)
    assert json.loads(out.body) == {"pan": PAN, "exp": "12/30"}

    multiple = _encrypted(
        vault,
        {
            "card": {"type": "card", "data": CARD},
            "bank": {"type": "bank", "data": {"routing_number": "110000000", "account_number": "000123456789"}},
        },
    )
    body = (
        b"[\"{{ encrypted | json: '$.card.data.number' }}\", \"{{ encrypted | json: '$.bank.data.account_number' }}\"]"
    )
    out = _run(vault, caller, body, encrypted=multiple)
    assert json.loads(out.body) == [PAN, "000123456789"]

    error = _refused(vault, caller, body)
    assert error.status == 400 and "encrypted" in error.errors
    error = _refused(vault, caller, body, encrypted="bm90IGpzb24=")
    assert error.status == 400 and error.errors
    assert _refused(vault, vault.caller("keys:read"), body, encrypted=multiple).status == 403


@pytest.mark.parametrize(
    ("inner", "kind", "ref_id", "piped"),
    [
        (" abc ", "token", "abc", "{{ value }}"),
        ("abc,json: '$.a',last4", "token", "abc", "{{ value | json: '$.a' | last4 }}"),
        ("token:abc | pad_left: 5, '0'", "token", "abc", "{{ value | pad_left: 5, '0' }}"),
        ("encrypted, json: '$.a'", None, None, "{{ value | json: '$.a' }}"),
        (
            "abc | json: '$.a', slice: 0, 2, to_number",
            "token",
            "abc",
            "{{ value | json: '$.a' | slice: 0, 2 | to_number }}",
        ),
    ],
)
def test_expression_heads_and_commas(inner, kind, ref_id, piped):
    """Commas standing for pipes are read by the expression engine's one rule (``domain.tokens.expressions``)."""
    expression = parse_expression(inner, where="body")
    assert (expression.ref.kind if expression.ref else None, expression.ref.id if expression.ref else None) == (
        kind,
        ref_id,
    )
    value = {"value": {"a": "42424242"}} if "json" in piped else {"value": "12"}
    assert evaluate(expression.source, value) == evaluate(piped, value)


def test_body_kinds():
    assert [
        body_kind(t)
        for t in (
            "application/json; charset=utf-8",
            "application/vnd.api+json",
            "application/x-www-form-urlencoded",
            "text/xml",
            "application/soap+xml",
            "text/plain",
            None,
        )
    ] == ["json", "json", "form", "xml", "xml", "text", "text"]


def test_cvc_past_retention_is_not_detokenized(vault):
    card = _card(vault)
    with session_scope() as session:
        from storage.models import Token

        row = session.get(Token, (vault.tenant_id, card))
        row.cvc_expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(row)
    out = _run(vault, vault.caller(), f"{{{{ {card} | to_string }}}}".encode(), content_type="text/plain")
    assert "cvc" not in json.loads(out.body)


def test_one_query_per_kind_and_errors_name_their_place(vault):
    from sqlalchemy import event

    from storage.db import get_engine

    cards = [_card(vault) for _ in range(5)]
    with session_scope() as session:
        intent = token_intents.create_intent(session, vault.caller(), type="card", data=CARD)["id"]
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    body = " ".join(f"{{{{ {c} | json: '$.number' }}}}" for c in cards)
    body += f" {{{{ token_intent: {intent} | json: '$.data.number' }}}}"
    event.listen(get_engine(), "before_cursor_execute", record)
    try:
        out = _run(vault, vault.caller(), body.encode(), content_type="text/plain")
    finally:
        event.remove(get_engine(), "before_cursor_execute", record)
    assert out.body.decode() == " ".join([PAN] * 6)
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len([s for s in reads if "FROM tokens" in s]) == 1
    assert len([s for s in reads if "FROM token_intents" in s]) == 1

    error = _refused(
        vault, vault.caller("proxy:invoke"), b"{}", headers=[("X-Card", f"{{{{ {cards[0]} | json: '$.number' }}}}")]
    )
    assert error.status == 403 and list(error.errors) == ["headers.X-Card"]


def test_json_string_state_follows_escapes():
    from domain.proxy.detokenize import _json_sites

    text = json.dumps({"a": 'x" {{ a }}', "c": "\\{{ c }}"})[:-1] + ', "b": {{ b }}}'
    assert [(s.expression.ref.id, s.in_json_string) for s in _json_sites(text, "body")] == [
        ("a", True),
        ("c", True),
        ("b", False),
    ]


def test_expired_tokens_are_unknown_and_the_token_object_is_json(vault):
    card, gone = _card(vault, metadata={"ref": "order-2"}), _card(vault)
    with session_scope() as session:
        from storage.models import Token

        row = session.get(Token, (vault.tenant_id, gone))
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        session.add(row)
    error = _refused(vault, vault.caller(), f'"{{{{ {card} }}}}{{{{ {gone} }}}}"'.encode())
    assert error.status == 400 and gone in error.detail and card not in error.detail
    out = _run(vault, vault.caller(), f"{{{{ token: {card} }}}}".encode())
    record = json.loads(out.body)
    assert record["id"] == card and record["tenant_id"] == str(vault.tenant_id)
    assert record["metadata"] == {"ref": "order-2"} and record["data"]["number"] == PAN
    assert dt.datetime.fromisoformat(record["created_at"]) <= dt.datetime.now(dt.UTC)
    assert record["expires_at"] is None and record["type"] == "card"
