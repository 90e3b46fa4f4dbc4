"""Account updater: a 300,000-row request file from upload to ``completed``.

Services: PostgreSQL (``--database-url``, recreated), Redis (``--redis-url``, under a key prefix of this run,
removed at the end; nothing is flushed) as broker, moto's S3
server, the sandbox card network, ``tessera api`` and ``tessera worker --concurrency 2`` (``--concurrency``),
each a child process. Setup (not timed): a test tenant with a webhook for ``account-updater.job.completed``
and one card token per row, bulk inserted (sealed under the tenant key as the platform does); a warm-up job.

The file: ``--rows`` (300,000) rows, 10% with updates (the four ``UPD_*`` cards), the rest spread over the
other result codes (the six warnings, ``ERR_UNDEFINED``, ``ERR_INVALID_PAN``, ``ERR_INVALID_TOKEN``,
``ERR_INVALID_EXP_DATE``, ``ERR_INVALID_CONFIG``: 5% each) and rows without an update (35%); half the rows
carry an expiration, the others rely on the token's.

Timed, in each of ``--rounds`` rounds (one batch each, 1 by default): from the start of the ``PUT`` to the
pre-signed URL (a plain HTTP client) until a poll of ``GET /account-updater/jobs/{id}`` answers
``completed``; an S3 ObjectCreated notification is posted right after the upload, as a configured bucket
would. Sampled every 0.1 s: the RSS of every worker process (psutil), and the CPU seconds of each group of
processes. Checked in every round: the result file's row count and codes, the number of new tokens, the
webhook. Published: the median wall time and rows per second over the rounds, and the highest peak RSS
of a worker process in any round; the goals are 300,000 rows in at most 15 s and at most 300 MB per worker
process (issue 25). ``--profile`` then runs one chunk in this process under cProfile and prints where its
time goes.

Run from the repository root::

    .venv/bin/python benchmarks/account_updater.py [--rows 300000] [--concurrency 2] [--rounds 3] [--profile]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import collections
import csv
import datetime as dt
import io
import json
import threading
import time
import uuid

import psutil

from benchmarks import common
from benchmarks.receiver import Receiver

DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/tessera_bench_account_updater"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/14"
TARGET_SECONDS = 15.0
TARGET_RSS_MB = 300.0
NUMBERS = {  # card number -> the code the sandbox answers
    "4000000000001018": "UPD_PAN",
    "4000000000001026": "UPD_EXP_DATE",
    "4000000000001034": "UPD_BRAND_CONV",
    "4000000000001042": "UPD_CORRECTED",
    "4000000000001059": "WRN_CLOSED_ACCOUNT",
    "4000000000001067": "WRN_CONTACT_CARDHOLDER",
    "4000000000001075": "WRN_ISSUER_NOT_ENROLLED",
    "4000000000001083": "WRN_ISSUER_NO_DATA",
    "4000000000001091": "WRN_OPT_OUT",
    "3566002020360505": "WRN_UNSUPPORTED_NETWORK",
    "4000000000001117": "ERR_UNDEFINED",
    "4000000000001010": "ERR_INVALID_PAN",  # a legacy token that fails the Luhn check
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000, help="rows in the request file")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes of the worker")
    parser.add_argument("--rounds", type=int, default=1, help="batches measured one after the other (medians)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the job may take")
    parser.add_argument("--profile", action="store_true", help="profile one chunk in this process afterwards")
    common.add_service_options(parser)
    # Its own database, and its own key prefix in Redis (nothing is flushed): benchmarks running side by side
    # must not wipe each other's queues.
    parser.set_defaults(database_url=DEFAULT_DATABASE_URL, redis_url=DEFAULT_REDIS_URL)
    return parser.parse_args(argv)


# ---- the data ------------------------------------------------------------------------------------


def plan_rows(count: int) -> list[tuple[str | None, str]]:
    """``(card number or None for no token, kind)`` per row: 10% updates, 5% each other code, 35% none."""
    weights = [(n, c, 2.5) for n, c in NUMBERS.items() if c.startswith("UPD")]
    weights += [(n, c, 5.0) for n, c in NUMBERS.items() if not c.startswith("UPD")]
    weights += [
        (None, "ERR_INVALID_TOKEN", 5.0),
        ("4242424242424242", "ERR_INVALID_EXP_DATE", 5.0),
        ("5555555555554444", "ERR_INVALID_CONFIG", 5.0),
        ("4242424242424242", "", 35.0),
    ]
    cycle = []
    for number, kind, weight in weights:
        cycle += [(number, kind)] * int(weight * 2)  # 200 entries per cycle
    return [cycle[i % len(cycle)] for i in range(count)]


def insert_tokens(tenant_id: uuid.UUID, numbers: list[str | None], year: int) -> list[str]:
    """One card token per row (bulk inserted, sealed like the platform seals token data); returns the ids
    (``no-such-token-<i>`` for rows without a token)."""
    from sqlalchemy import insert

    from config.settings import get_settings
    from domain.tokens.cards import DEFAULT_FINGERPRINT_EXPRESSIONS, default_card_mask
    from storage.crypto import get_keyring
    from storage.db import session_scope
    from storage.models import Token

    keyring = get_keyring()
    ids, batch = [], []
    now = dt.datetime.now(dt.UTC)
    with session_scope() as session:
        for index, number in enumerate(numbers):
            if number is None:
                ids.append(f"no-such-token-{index}")
                continue
            token_id = str(uuid.uuid4())
            ids.append(token_id)
            data = {"number": number, "expiration_month": 1 + index % 12, "expiration_year": year}
            batch.append(
                {
                    "tenant_id": tenant_id,
                    "id": token_id,
                    "type": "card",
                    "data_ct": keyring.encrypt(session, tenant_id, "token", token_id, json.dumps(data).encode()),
                    "mask": default_card_mask(),
                    "containers": ["/pci/high/"],
                    "metadata": {},
                    "search_indexes": [],
                    "fingerprint": keyring.fingerprint(session, tenant_id, number),
                    "fingerprint_expression": DEFAULT_FINGERPRINT_EXPRESSIONS["card"],
                    "created_at": now,
                }
            )
            if len(batch) == 5000:
                session.execute(insert(Token.__table__), batch)
                batch.clear()
        if batch:
            session.execute(insert(Token.__table__), batch)
    # as autovacuum does after a bulk load: a vault's tokens are not read for the first time by the job (a
    # first read of fresh rows writes hint bits), and the planner has statistics
    common.vacuum_analyze(get_settings().database_url, "tokens")
    return ids


def request_file(plan: list[tuple[str | None, str]], ids: list[str], year: int) -> bytes:
    """The request CSV: half the rows with an expiration, the others relying on the token's."""
    out = io.StringIO()
    out.write("token,expiration_year,expiration_month,merchant_id\n")
    yy = f"{year % 100:02d}"
    for index, ((_number, kind), token_id) in enumerate(zip(plan, ids, strict=True)):
        month = f"{1 + index % 12:02d}" if index % 2 else ""
        year_cell = yy if month else ""
        merchant = "SANDBOX" if index % 3 == 0 else ""
        if kind == "ERR_INVALID_EXP_DATE":
            year_cell, month = yy, "13"
        elif kind == "ERR_INVALID_CONFIG":
            merchant = "ACME"
        out.write(f"{token_id},{year_cell},{month},{merchant}\n")
    return out.getvalue().encode()


# ---- measuring -----------------------------------------------------------------------------------


class RssSampler:
    """Samples the RSS of every process of a worker (main process and pool children) every 0.1 s."""

    def __init__(self, pid: int):
        self.members = common.process_tree(pid)
        self.peak: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """Peak RSS in MB per process (``main``, ``child <pid>``)."""
        self._stop.set()
        self._thread.join(5)
        return {self.names[pid]: rss / 2**20 for pid, rss in sorted(self.peak.items())}

    def _run(self) -> None:
        root = None
        while not self._stop.is_set():
            for process in self.members():
                try:
                    rss = process.memory_info().rss
                except psutil.Error:
                    continue
                root = root or process.pid
                self.names.setdefault(process.pid, "main" if process.pid == root else f"child {process.pid}")
                self.peak[process.pid] = max(self.peak.get(process.pid, 0), rss)
            time.sleep(0.1)


def put(url: str, body: bytes) -> int:
    import urllib3

    return urllib3.request(
        "PUT",
        url,
        body=body,
        headers={"Content-Type": "application/octet-stream"},
        timeout=urllib3.Timeout(120),
        retries=False,
    ).status


def api_call(base: str, key: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib3

    headers = {"TS-API-KEY": key}
    data = None
    if body is not None:
        headers["content-type"] = "application/json"
        data = json.dumps(body).encode()
    answer = urllib3.request(method, base + path, body=data, headers=headers, retries=False)
    return answer.status, (json.loads(answer.data) if answer.data else {})


def run_job(base: str, key: str, body: bytes, *, timeout: float, watched, poll: float = 0.25) -> dict:
    """Create a job, upload ``body``, notify, poll until it ends; returns timings and the final job."""
    from config.settings import get_settings

    status, job = api_call(base, key, "POST", "/account-updater/jobs")
    assert status == 201, job
    started, started_at = time.monotonic(), dt.datetime.now(dt.UTC)
    assert put(job["upload_url"], body) == 200
    uploaded = time.monotonic()
    note = {
        "Records": [
            {
                "eventName": "ObjectCreated:Put",
                "s3": {
                    "bucket": {"name": get_settings().s3_bucket},
                    "object": {"key": f"account-updater/{job['tenant_id']}/{job['id']}/request.csv"},
                },
            }
        ]
    }
    api_call(base, key, "POST", "/account-updater/notifications/s3", note)
    seen: dict[str, float] = {}
    last: dict = {}

    def ended():
        _status, current = api_call(base, key, "GET", f"/account-updater/jobs/{job['id']}")
        last.update(current)
        seen.setdefault(current["status"], time.monotonic())
        return current if current["status"] in ("completed", "failed") else None

    try:
        final = common.wait_until(ended, timeout=timeout, what="the job to end", interval=poll, children=watched)
    except TimeoutError:
        print(f"the job did not end; last seen: {json.dumps(last)[:1000]}", file=sys.stderr)
        raise
    finished = time.monotonic()
    return {
        "job": final,
        "seconds": finished - started,
        "upload": uploaded - started,
        "started_at": started_at,
        "processing_seen": seen.get("processing", finished) - started,
    }


def check(final: dict, plan: list[tuple[str | None, str]]) -> list[tuple[str, bool]]:
    import urllib3

    body = urllib3.request("GET", final["download_url"], timeout=urllib3.Timeout(120)).data.decode()
    rows = list(csv.reader(io.StringIO(body)))
    codes = collections.Counter(row[6] for row in rows[1:])
    expected = collections.Counter(kind for _number, kind in plan if kind)
    new_tokens = sum(1 for row in rows[1:] if row[3])
    updates = sum(n for c, n in expected.items() if c.startswith("UPD"))
    return [
        (f"status completed ({final['status']})", final["status"] == "completed"),
        (
            f"result header and {len(rows) - 1:,} rows, codes as planned",
            codes == expected and rows[0][-1] == "result_code",
        ),
        (f"{new_tokens:,} new tokens, one per UPD row ({updates:,})", new_tokens == updates),
    ]


def timeline(job_id: str, started_at: dt.datetime) -> list[tuple[str, float]]:
    """Seconds from the upload start to each stage, from the rows the platform wrote."""
    from sqlalchemy import func, select

    from storage.db import session_scope
    from storage.models import Job
    from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob

    with session_scope() as session:
        job = session.get(AccountUpdaterJob, uuid.UUID(job_id))
        prepared = session.scalar(select(Job.updated_at).where(Job.subject_id == job_id, Job.kind.like("%prepare")))
        done_at = AccountUpdaterChunk.done_at
        first, last = session.execute(
            select(func.min(done_at), func.max(done_at)).where(AccountUpdaterChunk.job_id == job.id)
        ).one()
        marks = [
            ("job processing (file detected)", job.started_at),
            ("file read and cut into chunks", prepared),
            ("first chunk committed", first),
            ("last chunk committed", last),
            ("result file written, job completed", job.completed_at),
        ]
        results = session.scalars(
            select(Job.result).where(Job.subject_id == job_id, Job.subject_number.is_not(None))
        ).all()
    stages = [(f"at s: {name}", (moment - started_at).total_seconds()) for name, moment in marks if moment]
    totals: dict[str, float] = collections.Counter()
    for result in results:
        for stage, seconds in (result or {}).get("seconds", {}).items():
            totals[stage] += seconds
    stages += [
        (f"chunk stage {stage}: s summed over {len(results)} chunks", seconds) for stage, seconds in totals.items()
    ]
    return stages


def profile_one_chunk(job_id: str) -> None:
    """Re-run chunk 0 of the job in this process under cProfile (its outcome is not applied)."""
    import cProfile
    import pstats

    from domain.account_updater import chunks as au
    from storage.db import session_scope
    from storage.models_account_updater import AccountUpdaterChunk, AccountUpdaterJob

    with session_scope() as session:  # let chunk 0 run again without touching the finished job's data
        job = session.get(AccountUpdaterJob, uuid.UUID(job_id))
        job.status = "processing"
        session.get(AccountUpdaterChunk, (job.id, 0)).status = "pending"
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    outcome = au.process_chunk(uuid.UUID(job_id), 0)
    profiler.disable()
    perform = time.perf_counter() - started
    with session_scope() as session:
        job = session.get(AccountUpdaterJob, uuid.UUID(job_id))
        job.status = "completed"
        session.get(AccountUpdaterChunk, (job.id, 0)).status = "done"
    print(
        f"\nchunk 0 ({outcome.rows:,} rows, {len(outcome.tokens):,} new tokens): perform {perform:.3f} s "
        f"= {outcome.rows / perform:,.0f} rows/s in one process",
        flush=True,
    )
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(25)


def remove_keys(url: str, prefix: str) -> None:
    """Delete this run's Redis keys."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


# ---- the run -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with common.scratch_dir("tessera-bench-au-") as scratch:
        s3_port, sandbox_port, api_port = common.free_port(), common.free_port(), common.free_port()
        prefix = f"bench-au-{os.getpid()}:"
        common.adopt_env(
            {
                **common.platform_env(
                    args.database_url,
                    args.redis_url,
                    scratch / "data",
                    TESSERA_ALLOW_PRIVATE_DESTINATIONS="true",
                    TESSERA_REDIS_KEY_PREFIX=prefix,
                ),
                "TESSERA_S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
                "TESSERA_S3_BUCKET": "tessera-bench",
                "TESSERA_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
                "TESSERA_API_PORT": str(api_port),
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        print(f"database {args.database_url} (recreated), redis {args.redis_url} (keys {prefix}*)", flush=True)
        common.recreate_database(args.database_url)
        tenant = common.make_tenant("bench-account-updater")
        year = dt.datetime.now(dt.UTC).year + 2
        plan = plan_rows(args.rows)
        started = time.monotonic()
        ids = insert_tokens(tenant.tenant_id, [n for n, _k in plan], year)
        body = request_file(plan, ids, year)
        rounds: list[dict] = []
        print(
            f"setup: {len(ids):,} rows, {sum(1 for n, _ in plan if n):,} tokens inserted, file "
            f"{len(body) / 2**20:.1f} MiB, in {time.monotonic() - started:.1f} s",
            flush=True,
        )
        try:
            with common.Children(scratch) as children:
                s3 = children.start("s3", common.python_module("moto.server", "-H", "127.0.0.1", "-p", str(s3_port)))
                common.wait_http(f"http://127.0.0.1:{s3_port}/", s3)
                sandbox = children.start(
                    "sandbox", [common.executable("tessera"), "sandbox", "--port", str(sandbox_port)]
                )
                common.wait_http(f"http://127.0.0.1:{sandbox_port}/health", sandbox)
                api = children.start("api", [common.executable("tessera"), "api", "--port", str(api_port)])
                base = f"http://127.0.0.1:{api_port}"
                common.wait_http(base + "/status", api)
                worker = common.start_platform_worker(children, args.concurrency)
                watched = [s3, sandbox, api, worker]
                receiver = Receiver(children)
                common.subscribe_webhook(tenant.tenant_id, receiver.url, ["account-updater.job.completed"])
                print("warming up the worker", flush=True)
                warm = run_job(
                    base, tenant.api_key, body[: body.index(b"\n", 50_000) + 1], timeout=180, watched=watched
                )
                assert warm["job"]["status"] == "completed", warm
                receiver.wait_for(1, timeout=30, children=watched)  # the warm-up's webhook, before the reset
                receiver.reset()
                load_at_start = os.getloadavg()[0]
                for number in range(1, args.rounds + 1):
                    sampler = RssSampler(worker.pid).start()
                    meter = common.CpuMeter(
                        {
                            "worker": common.process_tree(worker.pid),
                            "api": common.process_tree(api.pid),
                            "s3 (moto)": common.process_tree(s3.pid),
                            "sandbox": common.process_tree(sandbox.pid),
                            "postgres": common.processes_named("postgres"),
                            "redis": common.processes_named("redis-server"),
                        }
                    )
                    meter.start()
                    load = os.getloadavg()[0]
                    run = run_job(base, tenant.api_key, body, timeout=args.timeout, watched=watched)
                    cores = meter.stop()
                    peaks = sampler.stop()
                    checks = check(run["job"], plan)
                    hook = receiver.wait_for(1, timeout=30)
                    receiver.reset()
                    checks.append(
                        (
                            f"webhook account-updater.job.completed delivered ({hook['distinct']})",
                            hook["distinct"] == 1,
                        )
                    )
                    rounds.append({**run, "peaks": peaks, "cores": cores, "checks": checks, "load": load})
                    print(
                        f"round {number}: {run['seconds']:.2f} s, load {load:.2f} at its start, peak RSS "
                        f"{max(peaks.values(), default=float('nan')):.0f} MB, checks "
                        f"{'ok' if all(ok for _t, ok in checks) else 'FAILED'}",
                        flush=True,
                    )
                stages = timeline(run["job"]["id"], run["started_at"])
                if args.profile:
                    profile_one_chunk(run["job"]["id"])
        except KeyboardInterrupt:
            print("interrupted; children stopped", file=sys.stderr)
            return 130
        finally:
            remove_keys(args.redis_url, prefix)
    seconds = common.median(r["seconds"] for r in rounds)
    worst = max((mb for r in rounds for mb in r["peaks"].values()), default=float("nan"))
    last = rounds[-1]
    if len(rounds) > 1:
        common.print_table(
            "Rounds",
            ("round", "wall s", "rows/s", "load at start", "peak RSS MB", "worker cores", "postgres cores"),
            [
                (
                    number,
                    r["seconds"],
                    common.ratio(args.rows, r["seconds"]),
                    r["load"],
                    max(r["peaks"].values(), default=float("nan")),
                    r["cores"]["worker"],
                    r["cores"]["postgres"],
                )
                for number, r in enumerate(rounds, 1)
            ],
        )
    common.print_table(
        f"Account updater, {args.rows:,} rows, worker --concurrency {args.concurrency}, "
        f"{len(rounds)} round(s), load {load_at_start:.2f} at the start",
        ("figure", "value"),
        [
            (f"wall seconds, upload start -> completed (median of {len(rounds)})", seconds),
            ("rows per second (median)", common.ratio(args.rows, seconds)),
            ("worker CPU seconds, last round", last["cores"]["worker"] * last["seconds"]),
            ("postgres CPU seconds, last round (every postgres process)", last["cores"]["postgres"] * last["seconds"]),
            ("last round: upload seconds (PUT of the file)", last["upload"]),
            ("last round: first poll seeing processing (s)", last["processing_seen"]),
            *stages,
            *((f"last round: peak RSS MB, worker {name}", mb) for name, mb in last["peaks"].items()),
            *((f"last round: cores used: {name}", value) for name, value in last["cores"].items()),
        ],
    )
    checks = [(f"round {n}: {text}", ok) for n, r in enumerate(rounds, 1) for text, ok in r["checks"]]
    correct = all(ok for _text, ok in checks)
    checks += [
        (f"whole file in at most {TARGET_SECONDS:.0f} s (median {seconds:.1f} s)", seconds <= TARGET_SECONDS),
        (f"each worker process at most {TARGET_RSS_MB:.0f} MB ({worst:.0f} MB)", worst <= TARGET_RSS_MB),
    ]
    common.print_table("Checks", ("check", "result"), [(text, "ok" if ok else "FAILED") for text, ok in checks])
    if correct:  # the goals' figures are published whether they are met or not
        median_of = f"median of {len(rounds)}" if len(rounds) > 1 else "one round"
        common.publish(
            "account_updater",
            [
                common.Figure(
                    "account_updater",
                    f"{args.rows:,} rows, upload to completed (--concurrency {args.concurrency}, {median_of})",
                    seconds,
                    "s",
                    goal=f"≤ {TARGET_SECONDS:.0f} s",
                ),
                common.Figure(
                    "account_updater", f"rows per second ({median_of})", common.ratio(args.rows, seconds), "/s"
                ),
                common.Figure(
                    "account_updater",
                    "peak RSS of a worker process (highest of the rounds)",
                    worst,
                    "MB",
                    goal=f"≤ {TARGET_RSS_MB:.0f} MB",
                ),
            ],
        )
    return 0 if all(ok for _text, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
