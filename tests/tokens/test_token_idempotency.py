"""``<prefix>-IDEMPOTENCY-KEY`` on POST /tokens and POST /tokenize: a repeated key within the tenant
answers the original answer and creates nothing; keys kept at least 24 hours, then swept."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import func, select, update

from domain.tokens import idempotency
from storage.db import session_scope
from storage.models import Token, TokenIdempotencyKey
from tests.factories.tokens import MASTERCARD, card

pytestmark = pytest.mark.api

KEY = "TS-IDEMPOTENCY-KEY"


def _count(tenant) -> int:
    with session_scope() as session:
        return session.execute(select(func.count()).select_from(Token).where(Token.tenant_id == tenant.id)).scalar()


def test_a_repeated_key_answers_the_original_token_and_creates_nothing(tenant, other_tenant):
    first = tenant.client.post("/tokens", card(metadata={"n": "1"}), headers={KEY: "order-1"})
    assert first.status == 201, first
    again = tenant.client.post("/tokens", card(MASTERCARD, metadata={"n": "2"}), headers={KEY: "order-1"})
    assert again.status == 201 and again.json == first.json  # the key, not the body, defines sameness
    assert _count(tenant) == 1
    other = tenant.client.post("/tokens", card(), headers={KEY: "order-2"})
    assert other.status == 201 and other.json["id"] != first.json["id"]
    # another tenant's key of the same name is its own
    elsewhere = other_tenant.client.post("/tokens", card(), headers={KEY: "order-1"})
    assert elsewhere.status == 201 and elsewhere.json["id"] != first.json["id"]
    # the answer is kept sealed (it holds card data)
    with session_scope() as session:
        sealed = session.execute(
            select(TokenIdempotencyKey.answer_ct).where(
                TokenIdempotencyKey.tenant_id == tenant.id, TokenIdempotencyKey.key == "order-1"
            )
        ).scalar_one()
    assert b"4242424242424242" not in sealed
    # without a key, every request creates
    assert tenant.client.post("/tokens", card()).json["id"] != tenant.client.post("/tokens", card()).json["id"]


def test_tokenize_replays_the_whole_answer(tenant):
    body = {"card": card(), "plain": "secret", "list": ["a", None]}
    first = tenant.client.post("/tokenize", body, headers={KEY: "batch-1"})
    assert first.status == 201, first
    again = tenant.client.post("/tokenize", {"other": "x"}, headers={KEY: "batch-1"})
    assert again.status == 201 and again.json == first.json
    assert _count(tenant) == 3
    # the endpoints keep their keys apart
    token = tenant.client.post("/tokens", card(), headers={KEY: "batch-1"})
    assert token.status == 201 and "card" not in token.json and _count(tenant) == 4


def test_a_failed_request_keeps_nothing_and_bad_keys_are_refused(tenant, limited):
    bad = tenant.client.post("/tokens", {"type": "card", "data": {"number": "1"}}, headers={KEY: "k-1"})
    assert bad.status == 400
    reader = limited(tenant, ["token:pci:read:high"])
    assert reader.post("/tokens", card(), headers={KEY: "k-1"}).status == 403
    assert tenant.client.post("/tokens", card(), headers={KEY: "k-1"}).status == 201
    for key in ("x" * 256, "tab\there", "caf\u00e9"):
        answer = tenant.client.post("/tokens", card(), headers={KEY: key.encode("utf-8").decode("latin-1")})
        assert answer.status == 400 and list(answer.json["errors"]) == [KEY], answer
    assert _count(tenant) == 1


def test_concurrent_requests_with_one_key_create_once(tenant):
    answers = []

    def post():
        answers.append(tenant.client.post("/tokens", card(), headers={KEY: "race"}))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {a.status for a in answers} == {201}
    assert len({a.json["id"] for a in answers}) == 1 and _count(tenant) == 1


def test_keys_are_kept_24_hours_then_taken_over_and_swept(tenant):
    first = tenant.client.post("/tokens", card(), headers={KEY: "old"}).json
    day_ago = dt.datetime.now(dt.UTC) - idempotency.RETENTION - dt.timedelta(seconds=1)
    with session_scope() as session:
        session.execute(
            update(TokenIdempotencyKey).where(TokenIdempotencyKey.tenant_id == tenant.id).values(created_at=day_ago)
        )
    assert tenant.client.post("/tokens", card(), headers={KEY: "fresh"}).status == 201
    later = tenant.client.post("/tokens", card(), headers={KEY: "old"})
    assert later.status == 201 and later.json["id"] != first["id"]  # past 24 hours: a new creation
    with session_scope() as session:
        session.execute(
            update(TokenIdempotencyKey)
            .where(TokenIdempotencyKey.tenant_id == tenant.id, TokenIdempotencyKey.key == "fresh")
            .values(created_at=day_ago)
        )
    with session_scope() as session:
        assert idempotency.forget_old_keys(session, now=dt.datetime.now(dt.UTC)) >= 1
    with session_scope() as session:
        kept = (
            session.execute(select(TokenIdempotencyKey.key).where(TokenIdempotencyKey.tenant_id == tenant.id))
            .scalars()
            .all()
        )
    assert kept == ["old"]
