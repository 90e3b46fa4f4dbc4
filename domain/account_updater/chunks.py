"""Chunks of account updater jobs (second document, section 4 "Account updater jobs"; ``spec/SANDBOX.md``,
account updater table), processed in parallel on the workers.

A chunk's slow part (:func:`process_chunk`, no transaction held while calling out): a ranged GET of its
bytes, one query loading its tokens, data decrypted in the worker, one batch call to the card network,
and the chunk's result rows and new card tokens built in memory. Then **one transaction**
(:func:`apply_chunk`) claims the chunk (``pending`` -> ``done``), bulk inserts the new tokens (ids
derived from the job's random seed and the row number, inserted with ON CONFLICT DO NOTHING), their
log rows and ``token.created`` events, stores the chunk's result rows and adds the chunk to the job's
counters. A chunk run twice (worker killed, message redelivered) finds itself claimed and writes
nothing. The chunk that brings ``chunks_done`` to ``chunks_total`` records the final step in that same
transaction: this counter on the job row replaces a Celery chord (whose state would live in Redis only).

``UPD_*`` rows create a new card token (the old token is untouched); a ``token`` cell that names no
live card token of the tenant is ``ERR_INVALID_TOKEN``; an expiration cell that is not two digits (or
only one of the two given) is ``ERR_INVALID_EXP_DATE``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import Select, update
from sqlalchemy.orm import Mapped
from sqlmodel import Session, col

from domain.account_updater.csv_files import Row, read_rows
from domain.account_updater.results import (
    INVALID_EXP_DATE,
    INVALID_TOKEN,
    UNDEFINED,
    UPDATE_PREFIX,
    NewCard,
    Outcome,
    chunk_result,
)
from domain.account_updater.s3_files import get_blocks
from domain.account_updater.steps import FINISH_TASK, record_step
from domain.tokens.cards import DEFAULT_FINGERPRINT_EXPRESSIONS, default_card_mask, validate_card
from domain.tokens.store import DATA_PURPOSE, NewToken
from domain.webhooks.events import emit
from providers.account_updates import AccountUpdatesClient, UpdateItem, UpdateResult
from storage.crypto import Keyring, get_keyring
from storage.db import Rows, insert_rows, rowcount, session_scope
from storage.models import AuditLog, Tenant, Token, TokenMetadata
from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob
from storage.sql import select_by_keys
from storage.states import AccountUpdaterStatus, ChunkStatus
from storage.types import table_of, utcnow

log = logging.getLogger("tessera.account_updater")

CARD_CONTAINERS = ["/pci/high/"]


def _two_digits(cell: str) -> int | None:
    return int(cell) if len(cell) == 2 and cell.isascii() and cell.isdigit() else None


def new_token_id(seed: str, row_number: int) -> str:
    """The id of the token created for a row: a version-4-shaped uuid from SHA-256 of the job's secret
    seed and the row number, so a chunk run twice names the same tokens and nobody can guess them."""
    digest = bytearray(hashlib.sha256(f"{seed}:{row_number}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x40
    digest[8] = (digest[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(digest)))


@dataclass
class ChunkOutcome:
    """What processing one chunk produced, written by :func:`apply_chunk`: the result rows as CSV text,
    the ``tokens`` rows of the new tokens (``domain.tokens.store.NewToken.row``, ready for
    ``storage.db.insert_rows``), and counts."""

    rows: int
    result: bytes
    result_rows: int
    tokens: list[dict]
    skipped: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each stage (``read``, ``load``, ``network``, ``build``), kept in the job's result."""


@dataclass
class _Card:
    """A loaded card token: its plain data (its containers and metadata are read only for updates)."""

    data: dict
    containers: list = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


def _tokens_by_ids(session: Session, tenant_id: uuid.UUID, ids: list[str], *columns: Mapped[Any]) -> Select[Any]:
    """``SELECT columns`` of the tenant's tokens among ``ids``, by primary key (``storage.sql.select_by_keys``)."""
    return select_by_keys(session, Token, col(Token.id), ids, *columns, where=col(Token.tenant_id) == tenant_id)


def load_cards(session: Session, tenant_id: uuid.UUID, ids: Iterable[str], now: dt.datetime) -> dict[str, _Card]:
    """The live card tokens of the tenant among ``ids``, decrypted: one query for the whole chunk.

    Tokens of another type, expired ones and ones whose data does not open are left out (their rows are
    ``ERR_INVALID_TOKEN``).
    """
    wanted = [i for i in set(ids) if i and len(i) <= 400]
    if not wanted:
        return {}
    found: dict[str, _Card] = {}
    rows = session.execute(
        _tokens_by_ids(session, tenant_id, wanted, col(Token.id), col(Token.data_ct), col(Token.expires_at)).where(
            col(Token.type) == "card"
        )
    ).all()
    live = [(token_id, data_ct) for token_id, data_ct, expires_at in rows if expires_at is None or expires_at > now]
    opened = get_keyring().decrypt_many(session, tenant_id, DATA_PURPOSE, live)
    for token_id, _data_ct in live:
        plain = opened.get(token_id)
        try:
            if plain is None:
                raise ValueError("does not open")
            data = _json(plain)
        except ValueError:
            log.warning("token %s of tenant %s does not open; reported as ERR_INVALID_TOKEN", token_id, tenant_id)
            continue
        if isinstance(data, dict) and isinstance(data.get("number"), str):
            found[token_id] = _Card(data)
    return found


def _json(plain: bytes) -> Any:
    """A token's plain data parsed: orjson, or the standard library for what orjson refuses (such as
    ``NaN``). Raises ValueError when it is not JSON."""
    try:
        return orjson.loads(plain)
    except orjson.JSONDecodeError:
        return json.loads(plain)


def load_placements(session: Session, tenant_id: uuid.UUID, cards: dict[str, _Card]) -> None:
    """Fill in the containers and metadata of ``cards`` (the tokens that get a successor): one query."""
    if not cards:
        return
    for token_id, containers, metadata in session.execute(
        _tokens_by_ids(session, tenant_id, list(cards), col(Token.id), col(Token.containers), col(Token.meta))
    ).all():
        cards[token_id].containers = list(containers or [])
        cards[token_id].metadata = dict(metadata or {})


@dataclass
class _Pending:
    row: Row
    card: _Card
    month: int | None
    year: int | None


def process_chunk(
    job_id: uuid.UUID, number: int, *, now: dt.datetime | None = None, client: AccountUpdatesClient | None = None
) -> ChunkOutcome:
    """A chunk's slow part (no transaction held while calling out): read its bytes from S3, load its
    tokens, ask the card network once, build its result rows and its new tokens (sealed under the
    tenant key). Returns a skipped outcome when the job has ended or the chunk is done already.

    Raises TransientError (S3 or network unavailable: retried) or PermanentError (file changed or gone,
    the network refusing the call, production without a network: the job fails).
    """
    now = now or utcnow()
    clock = _Clock()
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        chunk = session.get(AccountUpdaterChunk, (job_id, number))
        if (
            job is None
            or chunk is None
            or job.status != AccountUpdaterStatus.PROCESSING
            or chunk.status != ChunkStatus.PENDING
        ):
            return ChunkOutcome(0, b"", 0, [], skipped=True)
        tenant = session.get(Tenant, job.tenant_id)
        tenant_type = tenant.type if tenant else "test"
        job_info = (
            job.tenant_id,
            job.request_key,
            job.request_etag,
            list(job.columns or []),
            job.id_seed,
            job.created_by,
        )
        span = (chunk.start_byte, chunk.end_byte, chunk.first_row)
    tenant_id, key, etag, columns, seed, created_by = job_info
    start, end, first_row = span
    rows = list(
        read_rows(get_blocks(key, etag=etag, byte_range=(start, end)), columns, start=start, first_row=first_row)
    )
    clock.lap("read")
    with session_scope() as session:
        cards = load_cards(session, tenant_id, (row.token for row in rows), now)
    clock.lap("load")

    results: dict[int, Outcome] = {}  # row number -> (row, code, year, month); rows without an update left out
    pending: list[_Pending] = []
    for row in rows:
        year_cell, month_cell = _two_digits(row.expiration_year), _two_digits(row.expiration_month)
        card = cards.get(row.token)
        if card is None:
            results[row.number] = (row, INVALID_TOKEN, None, None)
            continue
        year: int | None
        month: int | None
        if row.expiration_year or row.expiration_month:
            if year_cell is None or month_cell is None:
                results[row.number] = (row, INVALID_EXP_DATE, None, None)
                continue
            year, month = 2000 + year_cell, month_cell
        else:
            stored_year, stored_month = card.data.get("expiration_year"), card.data.get("expiration_month")
            if type(stored_year) is int and type(stored_month) is int:
                year, month = stored_year, stored_month
            else:
                year = month = None
        pending.append(_Pending(row, card, month, year))

    answers: list[UpdateResult] = []
    if pending:
        client = client or AccountUpdatesClient(tenant_type)
        items = [
            UpdateItem(str(p.row.number), p.card.data["number"], p.month, p.year, p.row.merchant_id or None)
            for p in pending
        ]
        answers = client.updates(items, idempotency_key=f"{job_id}:{number}")
    clock.lap("network")

    new_tokens: dict[int, NewCard] = {}
    token_rows: list[dict] = []
    with session_scope() as session:
        keyring = get_keyring()
        load_placements(
            session,
            tenant_id,
            {
                item.row.token: item.card
                for item, answer in zip(pending, answers, strict=True)
                if answer.code and answer.code.startswith(UPDATE_PREFIX)
            },
        )
        for item, answer in zip(pending, answers, strict=True):
            code = answer.code
            if not code:
                continue  # no update for this row: left out of the result
            results[item.row.number] = (item.row, code, item.year, item.month)
            if not code.startswith(UPDATE_PREFIX):
                continue
            new_month = answer.new_expiration_month
            new_year = answer.new_expiration_year
            pan = answer.new_pan or item.card.data["number"]
            if answer.new_pan is None and new_month is None:
                continue  # an update without anything new: reported without a new token
            data: dict[str, Any] = {"number": pan}
            if new_month is not None and new_year is not None:
                data["expiration_month"], data["expiration_year"] = new_month, new_year
            if isinstance(item.card.data.get("name"), str):
                data["name"] = item.card.data["name"]
            valid, problems = validate_card(data, today=now.date())
            if problems or valid is None:
                results[item.row.number] = (item.row, UNDEFINED, item.year, item.month)
                continue
            token_id = new_token_id(seed, item.row.number)
            token_rows.append(_token_row(session, keyring, tenant_id, token_id, valid, item.card, created_by, now))
            new_tokens[item.row.number] = (token_id, valid.get("expiration_year"), valid.get("expiration_month"))

    result, count = chunk_result(results, new_tokens)
    clock.lap("build")
    return ChunkOutcome(len(rows), result, count, token_rows, seconds=clock.laps)


class _Clock:
    """Wall time of successive stages."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 4)
        self._last = now


def _token_row(
    session: Session,
    keyring: Keyring,
    tenant_id: uuid.UUID,
    token_id: str,
    data: dict,
    old: _Card,
    created_by: uuid.UUID | None,
    now: dt.datetime,
) -> dict:
    """The ``tokens`` row of a new card token (``domain.tokens.store.NewToken.row``), as
    ``domain.tokens.service.create_tokens`` writes one for the request ``{"type": "card", "data": data,
    "containers": <old>, "metadata": <old>}``: data sealed under the tenant key, default card mask,
    default fingerprint expression and its fingerprint."""
    plain = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    containers = list(dict.fromkeys(old.containers)) or list(CARD_CONTAINERS)
    if any(not str(c).startswith("/pci/") for c in containers):
        containers = list(CARD_CONTAINERS)
    return NewToken(
        tenant_id=tenant_id,
        id=token_id,
        type="card",
        data_ct=keyring.encrypt(session, tenant_id, DATA_PURPOSE, token_id, plain),
        mask=default_card_mask(),
        containers=containers,
        meta=dict(old.metadata),
        search_indexes=[],
        fingerprint=keyring.fingerprint(session, tenant_id, data["number"]),
        fingerprint_expression=DEFAULT_FINGERPRINT_EXPRESSIONS["card"],
        deduplicate_token=None,
        parent_id=None,
        created_by=created_by,
        created_at=now,
        expires_at=None,
        cvc_expires_at=None,
    ).row()


def _token_created_events(
    session: Session, tenant_id: uuid.UUID, token_ids: list[str], trace_id: str | None, now: dt.datetime
) -> None:
    """``token.created`` for each new token, in bulk (``domain.webhooks.events.emit`` of a list)."""
    emit(
        session,
        tenant_id=tenant_id,
        type="token.created",
        trace_id=trace_id,
        data=[{"token": {"id": token_id, "type": "card"}} for token_id in token_ids],
    )


def apply_chunk(
    session: Session, job_id: uuid.UUID, number: int, outcome: ChunkOutcome, *, now: dt.datetime | None = None
) -> dict:
    """A chunk's transaction: lock the job, claim the chunk, write its tokens (with their metadata
    rows, log rows and ``token.created`` events), its result rows and the job's counters; record the
    final step when this was the last chunk. A chunk already claimed, or a job that has ended, writes
    nothing (``{"skipped": True}``)."""
    now = now or utcnow()
    if outcome.skipped:
        return {"skipped": True}
    clock = _Clock()
    job = session.get(AccountUpdaterJob, job_id, with_for_update=True, populate_existing=True)
    if job is None or job.status != AccountUpdaterStatus.PROCESSING:
        return {"skipped": True}
    clock.lap("lock")
    claimed = rowcount(
        session.execute(
            update(AccountUpdaterChunk)
            .where(
                col(AccountUpdaterChunk.job_id) == job_id,
                col(AccountUpdaterChunk.number) == number,
                col(AccountUpdaterChunk.status) == ChunkStatus.PENDING,
            )
            .values(
                status=ChunkStatus.DONE,
                result=outcome.result,
                result_rows=outcome.result_rows,
                new_tokens=len(outcome.tokens),
                done_at=now,
            )
            .execution_options(synchronize_session=False)
        )
    )
    if not claimed:
        return {"skipped": True}
    tokens = outcome.tokens
    rows = Rows()  # tokens before their metadata rows; one bulk write (``storage.db.insert_rows``)
    for t in tokens:
        rows.add(_TOKENS, t, ignore_conflicts=True)
    for t in tokens:
        for k, v in t["metadata"].items():
            rows.add(
                _METADATA,
                {"tenant_id": t["tenant_id"], "token_id": t["id"], "key": k, "value": v},
                ignore_conflicts=True,
            )
    for t in tokens:
        rows.add(
            _LOGS,
            {
                "id": uuid.uuid4(),
                "tenant_id": job.tenant_id,
                "actor_id": job.created_by,
                "actor_type": "application",
                "entity_type": "card",
                "entity_id": t["id"],
                "operation": "create",
                "message": "Card created",
                "created_at": now,
            },
        )
    insert_rows(session, rows)
    _token_created_events(session, job.tenant_id, [t["id"] for t in tokens], job.trace_id, now)
    job.chunks_done += 1
    job.rows_done += outcome.rows
    job.modified_at = now
    session.add(job)
    if job.chunks_done >= (job.chunks_total or 0):
        record_step(session, job, FINISH_TASK)
    session.flush()
    clock.lap("write")
    return {
        "rows": outcome.rows,
        "results": outcome.result_rows,
        "new_tokens": len(tokens),
        "seconds": {**outcome.seconds, **clock.laps},
    }


_TOKENS, _METADATA, _LOGS = table_of(Token), table_of(TokenMetadata), table_of(AuditLog)
