"""Account updater on the worker side: reading files in chunks, the bulk token path, and chunks that run
twice (redelivered, two workers, a worker SIGKILLed mid-chunk) writing their rows and tokens once."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3
from sqlalchemy import func, select, update

from domain.account_updater import chunks as au_chunks
from domain.account_updater import csv_files, results, s3_files, service, steps
from infra.dispatch import take_pending
from storage.db import session_scope
from storage.models import AuditLog, Event, Job, Token
from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob
from tests.helpers import wait_until

YEAR = dt.datetime.now(dt.UTC).year + 2
YY = f"{YEAR % 100:02d}"
HEADER = "token,expiration_year,expiration_month,merchant_id"
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.worker, pytest.mark.kill]


# ---- reading files -------------------------------------------------------------------------------


def blocks(data: bytes, size: int = 7):
    """The bytes in small blocks, so lines straddle block boundaries."""
    return (data[i : i + size] for i in range(0, len(data), size))


def test_scan_cuts_byte_ranges_that_reread_to_the_same_rows():
    body = (
        "\ufeff"
        + HEADER
        + "\r\n"
        + "a,29,01,\r\n"
        + "\r\n"
        + '"b\nquoted",29,02,"M,1"\r\n'
        + "c,,,\r\n"
        + "d,30,12,SANDBOX\r\n"
        + "é,,,\r\n"
        + "f,,,"
    ).encode()

    scan = csv_files.scan_request(blocks(body), max_bytes=10_000, chunk_rows=2)

    assert scan.errors == []
    assert scan.columns == ["token", "expiration_year", "expiration_month", "merchant_id"]
    assert scan.rows == 6 and scan.size == len(body)
    assert [(c.first_row, c.row_count) for c in scan.chunks] == [(1, 2), (3, 2), (5, 2)]
    assert scan.chunks[-1].end_byte == len(body)
    rows = []
    for chunk in scan.chunks:
        part = body[chunk.start_byte : chunk.end_byte]
        rows += csv_files.read_rows(blocks(part), scan.columns, start=chunk.start_byte, first_row=chunk.first_row)
    assert [(r.number, r.token, r.expiration_year, r.expiration_month, r.merchant_id) for r in rows] == [
        (1, "a", "29", "01", ""),
        (2, "b\nquoted", "29", "02", "M,1"),
        (3, "c", "", "", ""),
        (4, "d", "30", "12", "SANDBOX"),
        (5, "é", "", "", ""),
        (6, "f", "", "", ""),
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "The file is empty"),
        (b"\n\n", "The file is empty"),
        (b"token,token\n", "more than once"),
        (b"expiration_year\n29\n", "must name the column token"),
        (b"token,cvc\n", "unknown columns ('cvc')"),
        (b"token\nab\x00c\n", "contains NUL bytes"),
        (b"token\n\xff\xfe\n", "is not UTF-8 text"),
        (b'token\n"abc\n', "not valid CSV"),
        (b"token\na,b\n", "Row 1 (line 2) has 2 fields; the header has 1."),
    ],
)
def test_scan_refuses_files_that_are_not_request_csv(body, message):
    scan = csv_files.scan_request(blocks(body), max_bytes=10_000, chunk_rows=2)
    assert any(message in error for error in scan.errors), scan.errors


def test_scan_stops_past_the_size_limit_and_after_ten_errors():
    assert csv_files.scan_request([b"token\n", b"a\n" * 100], max_bytes=50, chunk_rows=5).errors == [
        "The file is over the limit of 50 bytes (30 MB)."
    ]
    errors = csv_files.scan_request([b"token\n" + b"a,b\n" * 50], max_bytes=10_000, chunk_rows=5).errors
    assert len(errors) == 11 and errors[-1] == "Reading stopped after 10 errors."


def test_new_token_ids_are_stable_uuids_per_seed_and_row():
    first = au_chunks.new_token_id("a" * 32, 7)
    assert first == au_chunks.new_token_id("a" * 32, 7)
    assert uuid.UUID(first).version == 4
    assert len({first, au_chunks.new_token_id("a" * 32, 8), au_chunks.new_token_id("b" * 32, 7)}) == 3


def test_bulk_token_rows_are_the_rows_create_tokens_writes(tenant):
    from domain.tenancy.auth import system_caller
    from domain.tokens.service import create_tokens
    from domain.tokens.validation import parse_token_request
    from storage.crypto import get_keyring
    from storage.models import Tenant

    now = dt.datetime.now(dt.UTC)
    data = {"number": "4012888888881881", "expiration_month": 5, "expiration_year": YEAR, "name": "Ada"}
    old = au_chunks._Card({}, containers=["/pci/moderate/"], metadata={"k": "v"})
    with session_scope() as session:
        caller = system_caller(session.get(Tenant, tenant.id))
        request, errors = parse_token_request(
            {
                "type": "card",
                "data": data,
                "containers": ["/pci/moderate/"],
                "metadata": {"k": "v"},
                "id": "reference-" + uuid.uuid4().hex,
            },
            caller,
            now=now,
        )
        assert errors == {}
        (made,) = create_tokens(session, caller, [request], now=now)
        bulk = au_chunks._token_row(session, get_keyring(), tenant.id, "bulk", data, old, None, now)
        opened = json.loads(get_keyring().decrypt(session, tenant.id, "token", "bulk", bulk["data_ct"]))
    reference = made.token
    for name in (
        "type",
        "mask",
        "containers",
        "search_indexes",
        "fingerprint",
        "fingerprint_expression",
        "deduplicate_token",
        "parent_id",
        "expires_at",
        "cvc_expires_at",
        "created_at",
    ):
        assert bulk[name] == getattr(reference, name), name
    assert bulk["metadata"] == reference.meta
    assert opened == data


# ---- chunks that run twice -----------------------------------------------------------------------


def _quiet(session) -> list:
    """Take the task messages this transaction would send after commit (the test sends them itself or
    not at all, so no other worker races it)."""
    return take_pending(session)


def _card(session, tenant_id, number: str) -> str:
    from domain.tokens.cards import default_card_mask
    from storage.crypto import get_keyring

    token_id = str(uuid.uuid4())
    plain = json.dumps({"number": number, "expiration_month": 5, "expiration_year": YEAR}).encode()
    session.add(
        Token(
            tenant_id=tenant_id,
            id=token_id,
            type="card",
            containers=["/pci/high/"],
            mask=default_card_mask(),
            data_ct=get_keyring().encrypt(session, tenant_id, "token", token_id, plain),
        )
    )
    return token_id


def prepared_job(tenant_id, numbers: list[str], *, chunk_rows: int) -> uuid.UUID:
    """A job in processing whose file (one row per number) is uploaded and cut into chunks, with no task
    message sent (the chunk jobs are recorded, queued)."""
    from config.settings import get_settings
    from domain.tenancy.auth import system_caller
    from storage import s3
    from storage.models import Tenant

    with session_scope() as session:
        tokens = [_card(session, tenant_id, n) for n in numbers]
        job_id = service.create_job(session, system_caller(session.get(Tenant, tenant_id)))["id"]
    body = (HEADER + "\n" + "".join(f"{t},{YY},05,\n" for t in tokens)).encode()
    s3.get_client().put_object(Bucket=s3_files.bucket(), Key=s3_files.request_key(tenant_id, job_id), Body=body)
    with session_scope() as session:
        assert service.start_processing(session, job_id)
        _quiet(session)
    scan = service.scan_job_file(job_id, get_settings().model_copy(update={"account_updater_chunk_rows": chunk_rows}))
    with session_scope() as session:
        service.apply_scan(session, job_id, scan)
        _quiet(session)
    return job_id


def counts(tenant_id, job_id) -> dict:
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, job_id)
        chunks = session.scalars(
            select(AccountUpdaterChunk).where(AccountUpdaterChunk.job_id == job_id).order_by(AccountUpdaterChunk.number)
        ).all()
        new_ids = [au_chunks.new_token_id(job.id_seed, n) for n in range(1, (job.rows_total or 0) + 1)]
        return {
            "tokens": session.scalar(
                select(func.count()).select_from(Token).where(Token.tenant_id == tenant_id, Token.id.in_(new_ids))
            ),
            "logs": session.scalar(
                select(func.count())
                .select_from(AuditLog)
                .where(AuditLog.tenant_id == tenant_id, AuditLog.entity_id.in_(new_ids))
            ),
            "events": session.scalar(
                select(func.count())
                .select_from(Event)
                .where(Event.tenant_id == tenant_id, Event.type == "token.created")
            ),
            "chunks_done": job.chunks_done,
            "rows_done": job.rows_done,
            "status": job.status,
            "results": [c.result_rows for c in chunks if c.status == "done"],
        }


def _cancel_recorded_jobs(job_id) -> None:
    with session_scope() as session:
        session.execute(
            update(Job).where(Job.subject_id == str(job_id), Job.status == "queued").values(status="cancelled")
        )


UPDATES = ["4000000000001018", "4000000000001026", "4242424242424242", "4000000000001059"]


def test_a_chunk_performed_twice_and_applied_twice_writes_once(tenant):
    job_id = prepared_job(tenant.id, UPDATES * 2, chunk_rows=4)
    try:
        first = au_chunks.process_chunk(job_id, 0)
        second = au_chunks.process_chunk(job_id, 0)  # a second worker, after the lease expired
        assert [t["id"] for t in first.tokens] == [t["id"] for t in second.tokens]  # the same ids
        assert len(first.tokens) == 2 and first.result_rows == 3
        with session_scope() as session:
            applied = au_chunks.apply_chunk(session, job_id, 0, first)
        assert {k: applied[k] for k in ("rows", "results", "new_tokens")} == {"rows": 4, "results": 3, "new_tokens": 2}
        assert set(applied["seconds"]) == {"read", "load", "network", "build", "lock", "write"}
        with session_scope() as session:
            assert au_chunks.apply_chunk(session, job_id, 0, second) == {"skipped": True}
        assert au_chunks.process_chunk(job_id, 0).skipped  # a redelivered message after the commit
        after = counts(tenant.id, job_id)
        assert after["tokens"] == 2 and after["logs"] == 2 and after["events"] == 2
        assert after["chunks_done"] == 1 and after["rows_done"] == 4 and after["results"] == [3]
    finally:
        _cancel_recorded_jobs(job_id)


def test_a_chunk_with_more_new_tokens_than_one_statement_holds_writes_every_row(tenant):
    """More new tokens than ``storage.db.insert_rows`` puts in one statement: the tokens, their metadata
    rows (written after the tokens they belong to), log rows and events are all written, once."""
    from storage.crypto import get_keyring
    from storage.db import MAX_STATEMENT_ROWS
    from storage.models import TokenMetadata

    count = MAX_STATEMENT_ROWS + 500
    job_id = prepared_job(tenant.id, UPDATES, chunk_rows=4)
    try:
        now = dt.datetime.now(dt.UTC)
        data = {"number": "4242424242424242", "expiration_month": 5, "expiration_year": YEAR}
        old = au_chunks._Card({}, containers=["/pci/high/"], metadata={"k": "v"})
        with session_scope() as session:
            seed = session.get(AccountUpdaterJob, job_id).id_seed
            keyring = get_keyring()
            tokens = [
                au_chunks._token_row(session, keyring, tenant.id, au_chunks.new_token_id(seed, n), data, old, None, now)
                for n in range(1, count + 1)
            ]
        with session_scope() as session:
            applied = au_chunks.apply_chunk(session, job_id, 0, au_chunks.ChunkOutcome(4, b"", 0, tokens))
            _quiet(session)
        assert applied["new_tokens"] == count
        ids = [t["id"] for t in tokens]
        with session_scope() as session:
            stored = session.scalar(select(func.count()).select_from(Token).where(Token.id.in_(ids)))
            metadata = session.scalar(
                select(func.count()).select_from(TokenMetadata).where(TokenMetadata.token_id.in_(ids))
            )
            logs = session.scalar(select(func.count()).select_from(AuditLog).where(AuditLog.entity_id.in_(ids)))
            events = session.scalar(
                select(func.count())
                .select_from(Event)
                .where(Event.tenant_id == tenant.id, Event.type == "token.created")
            )
        assert (stored, metadata, logs, events) == (count, count, count, count)
    finally:
        _cancel_recorded_jobs(job_id)


def test_the_chunk_task_run_twice_does_its_work_once(tenant):
    from tasks.account_updater import finish, process_chunk

    job_id = prepared_job(tenant.id, UPDATES * 2, chunk_rows=4)
    try:
        with session_scope() as session:
            chunk_jobs = session.scalars(
                select(Job.id)
                .where(Job.subject_id == str(job_id), Job.kind == steps.CHUNK_TASK)
                .order_by(Job.subject_number)
            ).all()
        assert len(chunk_jobs) == 2
        assert process_chunk.run(job_id=str(chunk_jobs[0])) == "succeeded"
        assert process_chunk.run(job_id=str(chunk_jobs[0])) == "skipped"  # the message delivered again
        assert process_chunk.run(job_id=str(chunk_jobs[1])) == "succeeded"
        with session_scope() as session:
            (finish_job,) = session.scalars(
                select(Job).where(Job.subject_id == str(job_id), Job.kind == steps.FINISH_TASK)
            ).all()
            _quiet(session)
        # The last chunk's commit sent the finish message: a live worker may win the lease before us.
        outcomes = [finish.run(job_id=str(finish_job.id)) for _ in range(2)]
        assert outcomes.count("succeeded") <= 1 and outcomes[1] == "skipped"
        wait_until(lambda: counts(tenant.id, job_id)["status"] == "completed", timeout=20)
        after = counts(tenant.id, job_id)
        assert after["status"] == "completed"
        assert after["tokens"] == 4 and after["logs"] == 4 and after["events"] == 4
        assert after["chunks_done"] == 2 and after["rows_done"] == 8
        with session_scope() as session:
            events = session.scalars(
                select(Event).where(Event.tenant_id == tenant.id, Event.type == steps.COMPLETED_EVENT)
            ).all()
        assert [e.data for e in events] == [{"job": {"id": str(job_id), "status": "completed"}}]
    finally:
        _cancel_recorded_jobs(job_id)


# ---- a worker process killed mid-chunk -----------------------------------------------------------


class Gate:
    """A card network in front of the sandbox that lets ``open_calls`` account-update calls through, then
    holds the next one until released (the worker is killed while it waits)."""

    def __init__(self, upstream: str, open_calls: int):
        self.upstream, self.open_calls = upstream, open_calls
        self.calls = 0
        self.held = threading.Event()
        self.release = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                gate.calls += 1
                if gate.calls > gate.open_calls:
                    gate.held.set()
                    gate.release.wait(60)
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                answer = urllib3.request(
                    "POST", gate.upstream + self.path, body=body, headers={"content-type": "application/json"}
                )
                self.send_response(answer.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer.data)))
                self.end_headers()
                self.wfile.write(answer.data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def start_worker(env: dict[str, str], log_path: Path, *, concurrency: int = 1) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [
                str(Path(sys.executable).parent / "tessera"),
                "worker",
                "--concurrency",
                str(concurrency),
                "--pool",
                "prefork",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
            ],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(20)


def test_a_worker_sigkilled_mid_chunk_leaves_rows_and_tokens_exactly_once(tenant, sandbox, tmp_path):
    from celery import Celery

    from config.settings import get_settings
    from infra import outbox
    from infra.celery import configure

    prefix = f"{get_settings().redis_key_prefix}kill{uuid.uuid4().hex[:6]}:"
    settings = get_settings().model_copy(update={"redis_key_prefix": prefix})
    side = Celery("tessera-kill-test")
    configure(side, settings)  # the broker namespace only the subprocess workers read

    def send(messages):
        for name, kwargs in messages:
            side.send_task(name, kwargs=kwargs)

    gate = Gate(sandbox, open_calls=1)
    env = {
        "TESSERA_REDIS_KEY_PREFIX": prefix,
        "TESSERA_JOB_LEASE_SECONDS": "3",
        "TESSERA_LOG_LEVEL": "WARNING",
        "TESSERA_SANDBOX_URL": gate.url,
    }
    log_path = tmp_path / "workers.log"
    numbers = UPDATES * 3  # three chunks of four rows: six new tokens, nine result rows
    job_id = prepared_job(tenant.id, numbers, chunk_rows=4)
    first = start_worker(env, log_path)
    second = None
    try:
        with session_scope() as session:  # hand the recorded chunk jobs to the subprocess worker only
            chunk_jobs = session.scalars(
                select(Job).where(Job.subject_id == str(job_id), Job.kind == steps.CHUNK_TASK)
            ).all()
        send([(steps.CHUNK_TASK, {"job_id": str(j.id)}) for j in chunk_jobs])
        assert gate.held.wait(60), log_path.read_text()[-3000:]  # one chunk done, the next waiting on the network
        kill_group(first)  # the whole worker (main process and pool child), as a machine dies
        gate.release.set()
        before = counts(tenant.id, job_id)
        assert before["status"] == "processing" and before["chunks_done"] == 1 and before["tokens"] == 2

        second = start_worker({**env, "TESSERA_SANDBOX_URL": sandbox}, log_path)
        time.sleep(3.5)  # the dead worker's lease runs out

        def sweep():
            with session_scope() as session:
                outbox.release_stale_leases(session)
            with session_scope() as session:
                outbox.relay(session, grace_seconds=0)
                send(_quiet(session))
            return counts(tenant.id, job_id)["status"] == "completed"

        wait_until(sweep, timeout=90, interval=2)
        after = counts(tenant.id, job_id)
        assert after["tokens"] == 6 and after["logs"] == 6 and after["events"] == 6
        assert after["chunks_done"] == 3 and after["rows_done"] == 12 and after["results"] == [3, 3, 3]
        with session_scope() as session:
            key = session.get(AccountUpdaterJob, job_id).result_key
        from storage import s3

        body = s3.get_client().get_object(Bucket=s3_files.bucket(), Key=key)["Body"].read().decode()
        rows = list(csv.reader(io.StringIO(body)))[1:]
        assert len(rows) == 9
        assert len({r[3] for r in rows if r[3]}) == 6
        assert [r[6] for r in rows] == ["UPD_PAN", "UPD_EXP_DATE", "WRN_CLOSED_ACCOUNT"] * 3
    finally:
        gate.stop()
        kill_group(first)
        if second is not None:
            kill_group(second)
        _cancel_recorded_jobs(job_id)
        import redis

        client = redis.Redis.from_url(get_settings().broker_url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        client.close()


# ---- both worker processes at once ----------------------------------------------------------------


class Meeting:
    """A card network in front of the sandbox that holds each account-update call until ``expected``
    calls are in flight together (or ``patience`` seconds pass), then lets them through: ``most`` is the
    largest number that were in flight at once."""

    def __init__(self, upstream: str, expected: int, patience: float = 30.0):
        self.upstream, self.expected, self.patience = upstream, expected, patience
        self.in_flight = self.most = 0
        self.lock = threading.Condition()
        meeting = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with meeting.lock:
                    meeting.in_flight += 1
                    meeting.most = max(meeting.most, meeting.in_flight)
                    meeting.lock.notify_all()
                    meeting.lock.wait_for(lambda: meeting.most >= meeting.expected, timeout=meeting.patience)
                try:
                    answer = urllib3.request(
                        "POST", meeting.upstream + self.path, body=body, headers={"content-type": "application/json"}
                    )
                finally:
                    with meeting.lock:
                        meeting.in_flight -= 1
                self.send_response(answer.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer.data)))
                self.end_headers()
                self.wfile.write(answer.data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def test_two_worker_processes_run_chunks_at_once_and_the_result_keeps_row_order(tenant, sandbox, tmp_path):
    """A worker of two pool processes takes two chunks at once (both wait on the card network
    together); the result file holds every chunk's rows in row order, each new token named by the row."""
    from celery import Celery

    from config.settings import get_settings
    from infra.celery import configure
    from storage import s3

    prefix = f"{get_settings().redis_key_prefix}pair{uuid.uuid4().hex[:6]}:"
    side = Celery("tessera-pair-test")
    configure(side, get_settings().model_copy(update={"redis_key_prefix": prefix}))
    meeting = Meeting(sandbox, expected=2)
    env = {"TESSERA_REDIS_KEY_PREFIX": prefix, "TESSERA_LOG_LEVEL": "WARNING", "TESSERA_SANDBOX_URL": meeting.url}
    log_path = tmp_path / "workers.log"
    numbers = UPDATES * 4  # four chunks of four rows
    job_id = prepared_job(tenant.id, numbers, chunk_rows=4)
    worker = start_worker(env, log_path, concurrency=2)
    try:
        with session_scope() as session:
            chunk_jobs = session.scalars(
                select(Job).where(Job.subject_id == str(job_id), Job.kind == steps.CHUNK_TASK)
            ).all()
        for job in chunk_jobs:
            side.send_task(steps.CHUNK_TASK, kwargs={"job_id": str(job.id)})

        def finished():  # the worker sends the final step itself after the last chunk's commit
            return counts(tenant.id, job_id)["status"] == "completed"

        wait_until(finished, timeout=90, interval=1)
        assert meeting.most == 2, log_path.read_text()[-3000:]
        after = counts(tenant.id, job_id)
        assert after["chunks_done"] == 4 and after["results"] == [3, 3, 3, 3] and after["tokens"] == 8
        with session_scope() as session:
            job = session.get(AccountUpdaterJob, job_id)
        body = s3.get_client().get_object(Bucket=s3_files.bucket(), Key=job.result_key)["Body"].read().decode()
        rows = list(csv.reader(io.StringIO(body)))
        assert ",".join(rows[0]) == csv_files.RESULT_HEADER
        row_numbers = [n for n in range(1, 17) if UPDATES[(n - 1) % 4] != "4242424242424242"]
        assert [r[6] for r in rows[1:]] == ["UPD_PAN", "UPD_EXP_DATE", "WRN_CLOSED_ACCOUNT"] * 4
        expected_new = [
            au_chunks.new_token_id(job.id_seed, n) if UPDATES[(n - 1) % 4] in UPDATES[:2] else "" for n in row_numbers
        ]
        assert [r[3] for r in rows[1:]] == expected_new
    finally:
        meeting.stop()
        kill_group(worker)
        _cancel_recorded_jobs(job_id)
        import redis

        client = redis.Redis.from_url(get_settings().broker_url)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        client.close()


# ---- the embedded database -----------------------------------------------------------------------


def test_the_whole_pipeline_runs_on_sqlite(tmp_path, s3_server, sandbox, monkeypatch):
    """The embedded default: the portable paths (IN lookups, SQLAlchemy bulk inserts) on a migrated
    SQLite file, each step run twice where a redelivery could run it twice."""
    import contextlib

    from sqlmodel import Session

    from domain.tenancy.auth import system_caller
    from domain.tenancy.tenants import create_tenant
    from storage import migrate, s3
    from storage.db import make_engine
    from storage.models import Tenant

    url = f"sqlite:///{tmp_path / 'embedded.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)

    @contextlib.contextmanager
    def lite():
        session = Session(engine, expire_on_commit=False)
        try:
            yield session
            _quiet(session)  # no task goes to the shared broker from this database
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    for module in (service, au_chunks, results):  # the steps' own units of work use the SQLite file
        monkeypatch.setattr(module, "session_scope", lite)
    try:
        with lite() as session:
            tenant_id = create_tenant(session, name="lite", owner_email="lite@example.com").tenant_id
            tokens = [_card(session, tenant_id, n) for n in UPDATES * 3]
            job_id = service.create_job(session, system_caller(session.get(Tenant, tenant_id)))["id"]
        body = (HEADER + "\n" + "".join(f"{t},{YY},05,\n" for t in [*tokens, "missing"])).encode()
        s3.get_client().put_object(Bucket=s3_files.bucket(), Key=s3_files.request_key(tenant_id, job_id), Body=body)
        assert service.detect_upload(job_id) == "started"
        assert service.detect_upload(job_id) == "skipped"
        from config.settings import get_settings

        scan = service.scan_job_file(job_id, get_settings().model_copy(update={"account_updater_chunk_rows": 5}))
        assert (scan.rows, len(scan.chunks)) == (13, 3)
        with lite() as session:
            service.apply_scan(session, job_id, scan)
        for number in range(3):
            outcome = au_chunks.process_chunk(job_id, number)
            with lite() as session:
                assert au_chunks.apply_chunk(session, job_id, number, outcome)["rows"] == outcome.rows
            with lite() as session:
                assert au_chunks.apply_chunk(session, job_id, number, outcome) == {"skipped": True}
        key = results.write_result(job_id)
        with lite() as session:
            assert service.complete_job(session, job_id, key)
            job = session.get(AccountUpdaterJob, job_id)
            new_ids = [au_chunks.new_token_id(job.id_seed, n) for n in range(1, 14)]
            made = session.scalar(select(func.count()).select_from(Token).where(Token.id.in_(new_ids)))
            events = session.scalars(select(Event.type).where(Event.tenant_id == tenant_id)).all()
        assert (job.status, job.rows_done, made) == ("completed", 13, 6)
        assert sorted(events) == [steps.COMPLETED_EVENT, *["token.created"] * 6]
        rows = list(
            csv.reader(
                io.StringIO(s3.get_client().get_object(Bucket=s3_files.bucket(), Key=key)["Body"].read().decode())
            )
        )
        assert [r[6] for r in rows[1:]] == ["UPD_PAN", "UPD_EXP_DATE", "WRN_CLOSED_ACCOUNT"] * 3 + ["ERR_INVALID_TOKEN"]
    finally:
        engine.dispose()
