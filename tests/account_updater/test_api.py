"""Account updater jobs end to end over HTTP: the API, a real worker, moto's S3 server over real HTTP
(pre-signed URLs fetched with a plain HTTP client), the sandbox card network and a webhook receiver."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import uuid

import pytest
import urllib3

from storage.db import session_scope
from tests.conftest import make_tenant
from tests.helpers import wait_until

JOBS = "/account-updater/jobs"
HEADER = "token,expiration_year,expiration_month,merchant_id"
RESULT_HEADER = [
    "token",
    "expiration_year",
    "expiration_month",
    "new_token",
    "new_expiration_year",
    "new_expiration_month",
    "result_code",
]
NOW = dt.datetime.now(dt.UTC)
YEAR = NOW.year + 2
YY = f"{YEAR % 100:02d}"
_HTTP = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(60))
pytestmark = pytest.mark.api


def put_file(url: str, data: bytes) -> int:
    """PUT ``data`` to a pre-signed URL like any client would (octet-stream: moto stalls on form data)."""
    return _HTTP.request("PUT", url, body=data, headers={"Content-Type": "application/octet-stream"}).status


def fetch(url: str) -> tuple[int, bytes]:
    answer = _HTTP.request("GET", url)
    return answer.status, answer.data


def card(client, number: str, month: int | None = None, year: int | None = None, **extra) -> str:
    data = {"number": number}
    if month is not None:
        data |= {"expiration_month": month, "expiration_year": year}
    answer = client.post("/tokens", {"type": "card", "data": data, **extra})
    assert answer.status == 201, answer
    return answer.json["id"]


def legacy_card(tenant_id, number: str) -> str:
    """A card token stored before numbers were Luhn-checked (written straight to the database)."""
    from domain.tokens.cards import default_card_mask
    from storage.crypto import get_keyring
    from storage.models import Token

    token_id = str(uuid.uuid4())
    with session_scope() as session:
        data = json.dumps({"number": number, "expiration_month": 5, "expiration_year": YEAR}).encode()
        session.add(
            Token(
                tenant_id=tenant_id,
                id=token_id,
                type="card",
                containers=["/pci/high/"],
                mask=default_card_mask(),
                data_ct=get_keyring().encrypt(session, tenant_id, "token", token_id, data),
            )
        )
    return token_id


def csv_bytes(rows: list[tuple[str, str, str, str]], header: str = HEADER) -> bytes:
    out = io.StringIO()
    out.write(header + "\r\n")
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    return out.getvalue().encode()


def create_job(client) -> dict:
    answer = client.post(JOBS)
    assert answer.status == 201, answer
    return answer.json


def settle(client, job_id: str, timeout: float = 60) -> dict:
    """Poll the job until it is completed or failed."""

    def done():
        answer = client.get(f"{JOBS}/{job_id}")
        assert answer.status == 200, answer
        return answer.json if answer.json["status"] in ("completed", "failed") else None

    return wait_until(done, timeout=timeout, interval=0.2)


def stored_status(job_id: str) -> str | None:
    from storage.models_account_updater import AccountUpdaterJob

    with session_scope() as session:
        job = session.get(AccountUpdaterJob, uuid.UUID(job_id))
        return job.status if job else None


def subscribe(client, receiver, events: list[str]) -> None:
    answer = client.post("/webhooks", {"name": "au", "url": receiver.url, "events": events})
    assert answer.status == 201, answer


# ---- the resource --------------------------------------------------------------------------------


def test_create_answers_a_pending_job_with_a_one_hour_upload_url(tenant):
    job = create_job(tenant.client)

    assert job["status"] == "pending"
    assert job["tenant_id"] == str(tenant.id)
    assert job["created_by"] == str(tenant.application_id)
    assert job["errors"] == []
    assert "download_url" not in job and "progress" not in job
    created = dt.datetime.fromisoformat(job["created_at"])
    expires = dt.datetime.fromisoformat(job["expires_at"])
    assert expires - created == dt.timedelta(hours=1)
    assert "X-Amz-Expires=" in job["upload_url"]
    expires_in = int(job["upload_url"].split("X-Amz-Expires=")[1].split("&")[0])
    assert 3590 <= expires_in <= 3600
    read = tenant.client.get(f"{JOBS}/{job['id']}")
    assert read.status == 200
    assert read.json["status"] == "pending" and read.json["expires_at"] == job["expires_at"]
    assert read.json["upload_url"]


def test_jobs_are_listed_newest_first_with_a_cursor(tenant):
    ids = [create_job(tenant.client)["id"] for _ in range(3)]

    first = tenant.client.get(f"{JOBS}?size=2")
    assert first.status == 200
    assert [j["id"] for j in first.json["data"]] == ids[::-1][:2]
    assert first.json["pagination"]["page_size"] == 2
    second = tenant.client.get(f"{JOBS}?size=2&start={first.json['pagination']['next']}")
    assert [j["id"] for j in second.json["data"]] == [ids[0]]
    assert "next" not in second.json["pagination"]
    default = tenant.client.get(JOBS)
    assert default.json["pagination"]["page_size"] == 20
    assert tenant.client.get(f"{JOBS}?size=0").status == 400
    assert tenant.client.get(f"{JOBS}?start=garbage").status == 400


def test_permissions_and_tenant_isolation(tenant, other_tenant, limited):
    job = create_job(tenant.client)
    reader = limited(tenant, ["account-updater:job:read"])
    creator = limited(tenant, ["account-updater:job:create"])

    assert reader.post(JOBS).status == 403
    assert reader.get(f"{JOBS}/{job['id']}").status == 200
    assert reader.get(JOBS).status == 200
    assert creator.post(JOBS).status == 201
    assert creator.get(f"{JOBS}/{job['id']}").status == 403
    assert creator.get(JOBS).status == 403
    assert tenant.client.with_key(None).post(JOBS).status == 401
    assert other_tenant.client.get(f"{JOBS}/{job['id']}").status == 404
    assert job["id"] not in [j["id"] for j in other_tenant.client.get(JOBS).json["data"]]
    assert tenant.client.get(f"{JOBS}/{uuid.uuid4()}").status == 404
    assert tenant.client.get(f"{JOBS}/not-a-uuid").status == 404


# ---- the whole flow ------------------------------------------------------------------------------


def test_every_sandbox_row_kind_end_to_end(tenant, other_tenant, receiver):
    client = tenant.client
    subscribe(client, receiver, ["account-updater.job.completed", "token.created"])
    pan = card(client, "4000000000001018", 5, YEAR, metadata={"customer": "c-1"}, containers=["/pci/moderate/"])
    pan_no_exp = card(client, "4000000000001018")
    exp = card(client, "4000000000001026", 11, YEAR)
    brand = card(client, "4000000000001034", 5, YEAR)
    corrected = card(client, "4000000000001042")
    notices = {
        code: card(client, number, 5, YEAR)
        for number, code in [
            ("4000000000001059", "WRN_CLOSED_ACCOUNT"),
            ("4000000000001067", "WRN_CONTACT_CARDHOLDER"),
            ("4000000000001075", "WRN_ISSUER_NOT_ENROLLED"),
            ("4000000000001083", "WRN_ISSUER_NO_DATA"),
            ("4000000000001091", "WRN_OPT_OUT"),
            ("3566002020360505", "WRN_UNSUPPORTED_NETWORK"),
            ("4000000000001117", "ERR_UNDEFINED"),
        ]
    }
    invalid_pan = legacy_card(tenant.id, "4000000000001010")
    plain = card(client, "4242424242424242", 5, YEAR)
    plain_mc = card(client, "5555555555554444")
    not_a_card = client.post("/tokens", {"type": "token", "data": "hello"}).json["id"]
    foreign = card(other_tenant.client, "4000000000001018", 5, YEAR)

    rows = [
        (pan, YY, "05", ""),  # 1 UPD_PAN: the row's expiration + 3 years
        (exp, "", "", ""),  # 2 UPD_EXP_DATE: the token's expiration + 3 years
        (brand, YY, "05", "SANDBOX"),  # 3 UPD_BRAND_CONV
        (corrected, "", "", ""),  # 4 UPD_CORRECTED, no expiration anywhere
        (pan_no_exp, "", "", ""),  # 5 UPD_PAN without expiration: this month + 3 years
        *[(token, YY, "05", "") for token in notices.values()],  # 6-12
        (invalid_pan, "", "", ""),  # 13 ERR_INVALID_PAN
        ("no-such-token", YY, "05", ""),  # 14 ERR_INVALID_TOKEN
        (foreign, YY, "05", ""),  # 15 another tenant's token
        (not_a_card, YY, "05", ""),  # 16 not a card
        ("", "", "", ""),  # 17 empty cell
        (plain, YY, "13", ""),  # 18 ERR_INVALID_EXP_DATE: month 13
        (plain, "20", "01", ""),  # 19 in the past
        (plain, YY, "5", ""),  # 20 not two digits
        (plain, YY, "", ""),  # 21 only one of the two
        (plain, YY, "05", "ACME, Inc."),  # 22 ERR_INVALID_CONFIG (quoted comma)
        (plain, YY, "05", ""),  # 23 no update: omitted
        (plain_mc, "", "", "SANDBOX"),  # 24 no update: omitted
    ]
    job = create_job(client)
    assert put_file(job["upload_url"], csv_bytes(rows)) == 200

    done = settle(client, job["id"])
    assert done["status"] == "completed", done
    assert done["errors"] == []
    assert done["progress"] == {"rows_done": len(rows), "rows_total": len(rows)}
    assert "upload_url" not in done and "expires_at" not in done
    status, body = fetch(done["download_url"])
    assert status == 200
    lines = list(csv.reader(io.StringIO(body.decode())))
    assert lines[0] == RESULT_HEADER
    got = [dict(zip(RESULT_HEADER, line, strict=True)) for line in lines[1:]]

    this_month = dt.datetime.now(dt.UTC)
    later = f"{(this_month.year + 3) % 100:02d}"
    new = {}

    def updated(row: dict, token: str, year: str, month: str, new_year: str, new_month: str, code: str) -> None:
        assert (row["token"], row["expiration_year"], row["expiration_month"]) == (token, year, month), row
        assert (row["new_expiration_year"], row["new_expiration_month"], row["result_code"]) == (
            new_year,
            new_month,
            code,
        ), row
        uuid.UUID(row["new_token"])
        new[code + ":" + token] = row["new_token"]

    nn = f"{(YEAR + 3) % 100:02d}"
    updated(got[0], pan, YY, "05", nn, "05", "UPD_PAN")
    updated(got[1], exp, YY, "11", nn, "11", "UPD_EXP_DATE")
    updated(got[2], brand, YY, "05", YY, "05", "UPD_BRAND_CONV")
    updated(got[3], corrected, "", "", "", "", "UPD_CORRECTED")
    updated(got[4], pan_no_exp, "", "", later, f"{this_month.month:02d}", "UPD_PAN")
    expected_rest = [
        *[(token, YY, "05", "", "", "", code) for code, token in notices.items()],
        (invalid_pan, YY, "05", "", "", "", "ERR_INVALID_PAN"),
        ("no-such-token", YY, "05", "", "", "", "ERR_INVALID_TOKEN"),
        (foreign, YY, "05", "", "", "", "ERR_INVALID_TOKEN"),
        (not_a_card, YY, "05", "", "", "", "ERR_INVALID_TOKEN"),
        ("", "", "", "", "", "", "ERR_INVALID_TOKEN"),
        (plain, YY, "13", "", "", "", "ERR_INVALID_EXP_DATE"),
        (plain, "20", "01", "", "", "", "ERR_INVALID_EXP_DATE"),
        (plain, YY, "5", "", "", "", "ERR_INVALID_EXP_DATE"),
        (plain, YY, "", "", "", "", "ERR_INVALID_EXP_DATE"),
        (plain, YY, "05", "", "", "", "ERR_INVALID_CONFIG"),
    ]
    assert [tuple(row.values()) for row in got[5:]] == expected_rest
    assert len(got) == len(rows) - 2  # the two rows without an update are omitted
    assert len(set(new.values())) == 5

    # The new tokens are ordinary card tokens of the tenant; the old ones are untouched.
    def data_of(token_id: str) -> dict:
        answer = client.get(f"/tokens/{token_id}")
        assert answer.status == 200, answer
        return answer.json

    first = data_of(new["UPD_PAN:" + pan])
    assert first["type"] == "card"
    assert first["data"] == {"number": "4012888888881881", "expiration_month": 5, "expiration_year": YEAR + 3}
    assert first["containers"] == ["/pci/moderate/"] and first["metadata"] == {"customer": "c-1"}
    reference = client.post("/tokens", {"type": "card", "data": {"number": "4012888888881881"}}).json
    assert first["fingerprint"] == reference["fingerprint"]
    assert first["mask"] == reference["mask"]
    assert first["fingerprint_expression"] == reference["fingerprint_expression"]
    assert data_of(new["UPD_EXP_DATE:" + exp])["data"] == {
        "number": "4000000000001026",
        "expiration_month": 11,
        "expiration_year": YEAR + 3,
    }
    assert data_of(new["UPD_BRAND_CONV:" + brand])["data"] == {
        "number": "5555550000001018",
        "expiration_month": 5,
        "expiration_year": YEAR,
    }
    assert data_of(new["UPD_CORRECTED:" + corrected])["data"] == {"number": "4000000000001109"}
    assert data_of(new["UPD_PAN:" + pan_no_exp])["data"] == {
        "number": "4012888888881881",
        "expiration_month": this_month.month,
        "expiration_year": this_month.year + 3,
    }
    assert data_of(pan)["data"] == {"number": "4000000000001018", "expiration_month": 5, "expiration_year": YEAR}
    assert data_of(pan)["modified_at"] is None
    listed = client.get("/v2/tokens?type=card&size=100").json["data"]
    assert set(new.values()) <= {t["id"] for t in listed}

    # Webhooks: the job's outcome, and token.created for each new token.
    hits = receiver.wait_for(lambda r: r.json["event"]["type"] == "account-updater.job.completed")
    assert [h.json["event"]["data"] for h in hits] == [{"job": {"id": job["id"], "status": "completed"}}]
    assert hits[0].json["event"]["tenant_id"] == str(tenant.id)

    def created_ids():
        ids = {
            r.json["event"]["data"]["token"]["id"]
            for r in list(receiver.received)
            if r.json["event"]["type"] == "token.created"
        }
        return ids if set(new.values()) <= ids else None

    wait_until(created_ids, timeout=20)


def test_a_header_only_file_completes_with_an_empty_result(tenant):
    job = create_job(tenant.client)
    assert put_file(job["upload_url"], (HEADER + "\n").encode()) == 200

    done = settle(tenant.client, job["id"])
    assert done["status"] == "completed"
    assert done["progress"] == {"rows_done": 0, "rows_total": 0}
    assert fetch(done["download_url"]) == (200, (",".join(RESULT_HEADER) + "\r\n").encode())


def test_columns_in_another_order_with_a_bom_and_lf_endings(tenant):
    token = card(tenant.client, "4000000000001026", 11, YEAR)
    job = create_job(tenant.client)
    body = "\ufeffToken, merchant_id ,expiration_month,expiration_year\n\n" + f"{token},,11,{YY}\n"
    assert put_file(job["upload_url"], body.encode()) == 200

    done = settle(tenant.client, job["id"])
    assert done["status"] == "completed", done
    lines = list(csv.reader(io.StringIO(fetch(done["download_url"])[1].decode())))
    assert lines[1][:3] == [token, YY, "11"] and lines[1][6] == "UPD_EXP_DATE"


# ---- failures ------------------------------------------------------------------------------------


def failed_with(client, receiver, body: bytes) -> list[str]:
    job = create_job(client)
    assert put_file(job["upload_url"], body) == 200
    done = settle(client, job["id"])
    assert done["status"] == "failed", done
    assert "download_url" not in done
    hits = receiver.wait_for(lambda r: r.json["event"]["data"].get("job", {}).get("id") == job["id"])
    assert hits[0].json["event"]["type"] == "account-updater.job.completed"
    assert hits[0].json["event"]["data"] == {"job": {"id": job["id"], "status": "failed"}}
    return done["errors"]


def test_malformed_files_fail_the_job_with_messages(tenant, receiver):
    subscribe(tenant.client, receiver, ["account-updater.job.completed"])
    client = tenant.client

    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01"
    assert any("not a CSV text file" in e for e in failed_with(client, receiver, png))
    latin = "token,expiration_year,expiration_month,merchant_id\ncaf\xe9,,,\n".encode("latin-1")
    assert any("not UTF-8" in e for e in failed_with(client, receiver, latin))
    assert any("empty" in e for e in failed_with(client, receiver, b""))
    errors = failed_with(client, receiver, b"id,expiry\nabc,12\n")
    assert any("must name the column token" in e for e in errors)
    assert any("unknown columns" in e for e in errors)
    errors = failed_with(client, receiver, (HEADER + "\nabc,,,\nabc,1\ndef,,,,,\n").encode())
    assert errors == [
        "Row 2 (line 3) has 2 fields; the header has 4.",
        "Row 3 (line 4) has 6 fields; the header has 4.",
    ]
    assert any("not valid CSV" in e for e in failed_with(client, receiver, (HEADER + '\n"abc,,,\n').encode()))


def test_a_file_sent_as_a_form_arrives_empty_and_the_errors_say_why(tenant):
    # `curl -X PUT --data-binary @file URL` labels the body application/x-www-form-urlencoded; moto's
    # server (tessera dev's S3) reads it as a form and stores an empty object.
    job = create_job(tenant.client)
    body = (HEADER + "\nabc,,,\n").encode()
    answer = _HTTP.request(
        "PUT", job["upload_url"], body=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert answer.status == 200
    done = settle(tenant.client, job["id"])
    assert done["status"] == "failed", done
    [error] = done["errors"]
    assert "arrived empty" in error and "application/x-www-form-urlencoded" in error and "curl -T" in error


def test_a_file_over_30_mb_fails_the_job(tenant, receiver):
    subscribe(tenant.client, receiver, ["account-updater.job.completed"])
    row = b"00000000-0000-0000-0000-000000000000,30,01,\n"
    body = HEADER.encode() + b"\n" + row * (30 * 1024 * 1024 // len(row) + 1)
    assert len(body) > 30 * 1024 * 1024

    errors = failed_with(tenant.client, receiver, body)
    assert errors == [f"The file is {len(body):,} bytes, over the limit of {30 * 1024 * 1024:,} bytes (30 MB)."]


def test_a_production_tenant_without_a_card_network_fails_clearly(api, receiver):
    production = make_tenant(api, type="production", name="live")
    subscribe(production.client, receiver, ["account-updater.job.completed"])
    token = card(production.client, "4000000000001018", 5, YEAR)

    errors = failed_with(production.client, receiver, csv_bytes([(token, YY, "05", "")]))
    assert errors == [
        "The card network's account updater is not configured for production tenants on this "
        "deployment (TESSERA_CARD_NETWORK_URL is unset)."
    ]


# ---- detection and expiry ------------------------------------------------------------------------


def test_an_s3_notification_starts_the_job_without_polling(api, tenant):
    from config.settings import get_settings

    token = card(tenant.client, "4000000000001018", 5, YEAR)
    job = create_job(tenant.client)
    assert put_file(job["upload_url"], csv_bytes([(token, YY, "05", "")])) == 200
    key = f"account-updater/{tenant.id}/{job['id']}/request.csv"
    note = {
        "Records": [
            {
                "eventName": "ObjectCreated:Put",
                "s3": {"bucket": {"name": get_settings().s3_bucket}, "object": {"key": key}},
            }
        ]
    }

    answer = tenant.client.with_key(None).post("/account-updater/notifications/s3", note)
    assert answer.status == 204
    assert wait_until(lambda: stored_status(job["id"]) == "completed", timeout=30)
    sns = {"Type": "Notification", "Message": json.dumps(note)}
    assert (
        tenant.client.with_key(None)
        .post("/account-updater/notifications/s3", raw=json.dumps(sns).encode(), content_type="text/plain")
        .status
        == 204
    )
    assert tenant.client.with_key(None).post("/account-updater/notifications/s3", raw=b"nope").status == 400


def test_the_sweep_finds_uploaded_files(tenant):
    from tasks.account_updater import detect_uploads

    job = create_job(tenant.client)
    detect_uploads()
    assert stored_status(job["id"]) == "pending"  # nothing uploaded yet
    assert put_file(job["upload_url"], csv_bytes([("no-such-token", "", "", "")])) == 200

    assert detect_uploads() >= 1
    assert stored_status(job["id"]) != "pending"
    assert wait_until(lambda: stored_status(job["id"]) == "completed", timeout=30)


def test_a_pending_job_past_its_hour_reads_404_at_once_and_the_sweep_removes_it(tenant):
    from storage import s3
    from storage.models_account_updater import AccountUpdaterJob
    from tasks.account_updater import detect_uploads, remove_expired_jobs

    job = create_job(tenant.client)
    assert put_file(job["upload_url"], csv_bytes([("x", "", "", "")])) == 200
    with session_scope() as session:  # the hour has passed (without the job being noticed)
        row = session.get(AccountUpdaterJob, uuid.UUID(job["id"]))
        row.expires_at = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        key = row.request_key

    assert tenant.client.get(f"{JOBS}/{job['id']}").status == 404
    assert job["id"] not in [j["id"] for j in tenant.client.get(JOBS).json["data"]]
    detect_uploads()
    assert stored_status(job["id"]) == "pending"  # too late: never started
    assert remove_expired_jobs() >= 1
    assert stored_status(job["id"]) is None
    assert tenant.client.get(f"{JOBS}/{job['id']}").status == 404
    client = s3.get_client()
    assert client.list_objects_v2(Bucket=s3.bucket(), Prefix=key).get("KeyCount") == 0


def test_the_result_file_is_encrypted_at_rest_and_holds_no_card_data(tenant):
    from storage import s3

    token = card(tenant.client, "4000000000001018", 5, YEAR)
    job = create_job(tenant.client)
    assert put_file(job["upload_url"], csv_bytes([(token, YY, "05", "")])) == 200
    done = settle(tenant.client, job["id"])
    body = fetch(done["download_url"])[1]
    assert b"4012888888881881" not in body and b"4000000000001018" not in body
    client = s3.get_client()
    for name in ("result.csv", "request.csv"):
        head = client.head_object(Bucket=s3.bucket(), Key=f"account-updater/{tenant.id}/{job['id']}/{name}")
        assert head["ServerSideEncryption"] == "AES256"
