"""Backup and restore as README "Operating Tessera" tells the operator: ``scripts/backup.sh`` takes the
test database (pg_dump), the test bucket (moto's S3 server) and the master key; the originals are then
out of reach (a new database, a new bucket, the key file gone); ``scripts/restore.sh`` puts the backup
into them, and a ``tessera api`` started on the restored pieces alone detokenizes a card tokenized
before the backup and serves a document stored before it. A wrong key is caught by the restore's key
check, never served."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import urllib3
from sqlalchemy.engine import make_url
from urllib3.fields import RequestField

from tests.conftest import TEST_DATABASE_URL, _drop_database, _recreate_database, free_port
from tests.helpers import ApiClient

pytestmark = pytest.mark.api

ROOT = Path(__file__).resolve().parents[2]
CARD = {"number": "4111111111111111", "expiration_month": 11, "expiration_year": 2032}


def _run(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True, timeout=300
    )


def _environment(tmp_path: Path, **settings: str) -> dict[str, str]:
    """This run's environment (its S3 server, credentials, Redis) with ``settings`` over it, the master
    key only as the file ``settings`` names, and the project's Python for the scripts."""
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_MASTER_KEY"}
    env.update(settings)
    env["PYTHON"] = sys.executable
    env["TESSERA"] = f"{sys.executable} -m tessera.cli"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _upload_document(client: ApiClient, content: bytes) -> str:
    request = RequestField("request", '{"metadata": {"kind": "backup-test"}}')
    request.make_multipart(content_type="application/json")
    body, content_type = urllib3.encode_multipart_formdata(
        [request, ("document", ("file.pdf", content, "application/pdf"))]
    )
    answer = client.post("/documents", raw=body, content_type=content_type)
    assert answer.status == 201, answer
    return answer.json["id"]


def _start_api(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (tmp_path / "restored-api.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "api", "--port", str(port), "--workers", "1"],
        env={**env, "TESSERA_API_PORT": str(port)},
        cwd=tmp_path,  # no .env of the checkout
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "restored-api.log").read_text()[-3000:]
        try:
            if urllib3.request("GET", url + "/healthz", timeout=2, retries=False).status == 200:
                return process, url
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the restored api did not start\n" + (tmp_path / "restored-api.log").read_text()[-3000:])


@pytest.fixture
def fresh_databases():
    """``fresh()``: the URL of a new empty database beside the test one, dropped at the end."""
    made: list[str] = []

    def fresh() -> str:
        url = make_url(TEST_DATABASE_URL)
        name = f"{url.database}_restored_{uuid.uuid4().hex[:8]}"
        target = url.set(database=name).render_as_string(hide_password=False)
        _recreate_database(target)
        made.append(target)
        return target

    yield fresh
    for url in made:
        _drop_database(url)


def test_a_backup_restores_into_new_stores_and_opens_with_its_key(api, tenant, tmp_path, fresh_databases):
    token = tenant.client.post("/tokenize", {"type": "card", "data": CARD})
    assert token.status == 201, token
    token_id = token.json["id"]
    content = b"%PDF-1.7 kept across a restore " + os.urandom(2048)
    document_id = _upload_document(tenant.client, content)

    # The deployment's key file, as secrets/master_key would be.
    key_file = tmp_path / "master_key"
    key_file.write_text(os.environ["TESSERA_MASTER_KEY"] + "\n")
    backup, keys = tmp_path / "backup", tmp_path / "keys"
    done = _run("backup.sh", str(backup), str(keys), env=_environment(tmp_path, TESSERA_MASTER_KEY_FILE=str(key_file)))
    assert done.returncode == 0, done.stderr
    assert {p.name for p in backup.iterdir()} == {"database.dump", "s3.tar", "SHA256SUMS"}
    assert {p.name for p in keys.iterdir()} == {"master_key"}  # the key apart from the backup
    assert (keys / "master_key").stat().st_mode & 0o777 == 0o400
    assert os.environ["TESSERA_MASTER_KEY"] not in (backup / "database.dump").read_bytes().decode("latin-1")
    assert CARD["number"].encode() not in (backup / "database.dump").read_bytes()  # sealed in the dump
    assert content not in (backup / "s3.tar").read_bytes()  # documents stay sealed in the archive

    # Destroy: the restore gets a new database, a new bucket, and only the backup's key.
    key_file.unlink()
    restored_db = fresh_databases()
    bucket = f"{os.environ['TESSERA_S3_BUCKET']}-restored-{uuid.uuid4().hex[:6]}"
    env = _environment(
        tmp_path,
        TESSERA_DATABASE_URL=restored_db,
        TESSERA_S3_BUCKET=bucket,
        TESSERA_MASTER_KEY_FILE=str(keys / "master_key"),
    )
    restored = _run("restore.sh", str(backup), env=env)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert "key check: ok" in restored.stdout

    process, url = _start_api(env, tmp_path)
    try:
        client = ApiClient(url, tenant.api_key)
        answer = client.get(f"/tokens/{token_id}")
        assert answer.status == 200, answer
        assert answer.json["data"]["number"] == CARD["number"]
        data = client.get(f"/documents/{document_id}/data")
        assert data.status == 200, data
        assert data.raw == content
    finally:
        process.terminate()
        process.wait(30)


def test_a_restore_under_a_wrong_key_stops_at_the_key_check(api, tenant, tmp_path, fresh_databases):
    assert tenant.client.post("/tokenize", {"type": "card", "data": CARD}).status == 201
    key_file = tmp_path / "master_key"
    key_file.write_text(os.environ["TESSERA_MASTER_KEY"])
    backup, keys = tmp_path / "backup", tmp_path / "keys"
    env = _environment(tmp_path, TESSERA_MASTER_KEY_FILE=str(key_file))
    # A deployment's database holds its key check from the first start of a role on (the in-process
    # test api records none): record it as that start would.
    status = subprocess.run([*env["TESSERA"].split(), "keys", "status"], env=env, capture_output=True, text=True)
    assert "key check: ok" in status.stdout, status.stdout + status.stderr
    assert _run("backup.sh", str(backup), str(keys), env=env).returncode == 0
    # a second backup never overwrites the first
    again = _run("backup.sh", str(backup), str(tmp_path / "keys2"), env=env)
    assert again.returncode == 2 and "exists" in again.stderr

    wrong = tmp_path / "wrong_key"
    wrong.write_text(base64.b64encode(os.urandom(32)).decode())
    env = _environment(
        tmp_path,
        TESSERA_DATABASE_URL=fresh_databases(),
        TESSERA_S3_BUCKET=f"{os.environ['TESSERA_S3_BUCKET']}-wrong-{uuid.uuid4().hex[:6]}",
        TESSERA_MASTER_KEY_FILE=str(wrong),
    )
    restored = _run("restore.sh", str(backup), env=env)
    assert restored.returncode == 1, restored.stdout + restored.stderr
    assert "does not open this database" in restored.stderr

    # a damaged backup is refused before anything is written
    with (backup / "s3.tar").open("ab") as archive:
        archive.write(b"tampered")
    env["TESSERA_DATABASE_URL"] = fresh_databases()
    refused = _run("restore.sh", str(backup), env=env)
    assert refused.returncode == 1 and "SHA256SUMS" in refused.stderr
