"""The operator's scripts on their own: the database URL reaches pg_dump and pg_restore as ``PG*``
variables (never as an argument ``ps`` would show); the S3 archive round-trips objects with their
content type and metadata."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_database_url_becomes_pg_variables_never_arguments():
    code = "import sys; sys.path.insert(0, 'scripts'); import pg_env; print(pg_env.assignments(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "postgresql+psycopg2://tess%40ra:p%27w%24rd@db.internal:6543/tessera"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shell = subprocess.run(
        ["sh", "-c", out + '\nprintf "%s|%s|%s|%s|%s" "$PGHOST" "$PGPORT" "$PGUSER" "$PGPASSWORD" "$PGDATABASE"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shell == "db.internal|6543|tess@ra|p'w$rd|tessera"
    refused = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pg_env.py")],
        env={"TESSERA_URL": "sqlite:///x.db", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "not a PostgreSQL URL" in refused.stderr


def _s3_archive():
    spec = importlib.util.spec_from_file_location("s3_archive", ROOT / "scripts" / "s3_archive.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_s3_archive_keeps_each_object_with_its_content_type_and_metadata(monkeypatch, s3_server):
    """On the run's moto S3 server, with buckets of this test's own (``mock_aws`` in this process would
    reset the server's buckets too: moto keeps one state per process)."""
    import boto3

    archive = _s3_archive()
    run = uuid.uuid4().hex[:8]
    never_made, source, restored = f"never-made-{run}", f"source-{run}", f"restored-{run}"
    monkeypatch.setenv("TESSERA_S3_ENDPOINT_URL", s3_server)
    objects = {
        "documents/t1/d1": (b"\x00sealed\xff" * 100, "application/octet-stream", {"tessera-key-version": "3"}),
        "account-updater/t1/job/request.csv": (b"token,expiration_year\n", "text/csv", {}),
        "empty": (b"", "binary/octet-stream", {}),
    }
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    monkeypatch.setenv("TESSERA_S3_BUCKET", never_made)
    stream = io.BytesIO()
    assert archive.dump(stream) == 0  # the platform makes its bucket on first use: nothing yet
    client.create_bucket(Bucket=source)
    for key, (body, content_type, metadata) in objects.items():
        client.put_object(Bucket=source, Key=key, Body=body, ContentType=content_type, Metadata=metadata)
    monkeypatch.setenv("TESSERA_S3_BUCKET", source)
    stream = io.BytesIO()
    assert archive.dump(stream) == 3
    monkeypatch.setenv("TESSERA_S3_BUCKET", restored)
    stream.seek(0)
    assert archive.load(stream) == 3  # the bucket is made
    for key, (body, content_type, metadata) in objects.items():
        answer = client.get_object(Bucket=restored, Key=key)
        assert (answer["Body"].read(), answer["ContentType"], answer["Metadata"]) == (body, content_type, metadata)
    # a stream that is not an s3.tar is refused, not half-loaded under wrong keys
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as tar:
        info = tarfile.TarInfo("objects/stray")
        tar.addfile(info, io.BytesIO(b""))
    bad.seek(0)
    with pytest.raises(SystemExit, match=r"not an s3\.tar"):
        archive.load(bad)
