"""Every object of Tessera's S3 bucket as one tar stream, and back: the S3 half of ``scripts/backup.sh``
and ``scripts/restore.sh``.

    python3 scripts/s3_archive.py dump > s3.tar     # the bucket's objects, in key order
    python3 scripts/s3_archive.py load < s3.tar     # put them back (the bucket is made when missing)

The bucket and the server are the platform's own settings: ``TESSERA_S3_ENDPOINT_URL`` (unset: AWS),
``TESSERA_S3_BUCKET`` (``tessera``), ``TESSERA_S3_REGION`` (``us-east-1``); credentials come from
boto3's own sources (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_SHARED_CREDENTIALS_FILE``).
Needs boto3 (the platform's own dependency: the project's ``.venv/bin/python`` has it).

The stream: for each object, a member ``meta/<key>.json`` (``{"key", "content_type", "metadata",
"server_side_encryption"}``) followed by ``objects/<key>`` (its bytes). The objects are what the
platform sealed (documents) or wrote (account-updater files): copied as they are, never opened.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import time


def _client():
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=os.environ.get("TESSERA_S3_ENDPOINT_URL") or None,
        region_name=os.environ.get("TESSERA_S3_REGION") or "us-east-1",
    )


def _bucket() -> str:
    return os.environ.get("TESSERA_S3_BUCKET") or "tessera"


def _add(archive: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    info.mode = 0o600
    archive.addfile(info, io.BytesIO(data))


def _exists(client, bucket: str) -> bool:
    return bucket in {b["Name"] for b in client.list_buckets().get("Buckets", ())}


def dump(out) -> int:
    """Write every object of the bucket to ``out`` (a binary stream) as a tar stream; returns how many.
    A bucket not made yet (the platform makes it on first use) gives an empty archive."""
    client, bucket = _client(), _bucket()
    count = 0
    with tarfile.open(fileobj=out, mode="w|") as archive:
        if not _exists(client, bucket):
            return 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for entry in page.get("Contents", ()):
                key = entry["Key"]
                answer = client.get_object(Bucket=bucket, Key=key)
                body = answer["Body"].read()
                meta = {
                    "key": key,
                    "content_type": answer.get("ContentType"),
                    "metadata": answer.get("Metadata") or {},
                    "server_side_encryption": answer.get("ServerSideEncryption"),
                }
                mtime = entry["LastModified"].timestamp() if entry.get("LastModified") else time.time()
                _add(archive, f"meta/{key}.json", json.dumps(meta).encode(), mtime)
                _add(archive, f"objects/{key}", body, mtime)
                count += 1
    return count


def load(source) -> int:
    """Put every object of the tar stream ``source`` into the bucket (made when missing); returns how
    many. An object of the same key is replaced."""
    client, bucket = _client(), _bucket()
    if not _exists(client, bucket):
        client.create_bucket(Bucket=bucket)
    count = 0
    meta: dict | None = None
    with tarfile.open(fileobj=source, mode="r|") as archive:
        for member in archive:
            handle = archive.extractfile(member)
            if handle is None:
                continue
            data = handle.read()
            if member.name.startswith("meta/"):
                meta = json.loads(data)
                continue
            if meta is None or member.name != f"objects/{meta['key']}":
                raise SystemExit(f"s3_archive: {member.name} has no description before it: not an s3.tar")
            extra: dict[str, object] = {"Metadata": meta["metadata"]}
            if meta.get("content_type"):
                extra["ContentType"] = meta["content_type"]
            if meta.get("server_side_encryption"):
                extra["ServerSideEncryption"] = meta["server_side_encryption"]
            client.put_object(Bucket=bucket, Key=meta["key"], Body=data, **extra)
            meta = None
            count += 1
    return count


def main(argv: list[str]) -> int:
    """``dump`` (bucket -> stdout) or ``load`` (stdin -> bucket); the count goes to stderr."""
    if argv[1:] == ["dump"]:
        count = dump(sys.stdout.buffer)
        print(f"s3: {count} objects from bucket {_bucket()}", file=sys.stderr)
        return 0
    if argv[1:] == ["load"]:
        count = load(sys.stdin.buffer)
        print(f"s3: {count} objects into bucket {_bucket()}", file=sys.stderr)
        return 0
    print("usage: s3_archive.py dump > s3.tar | s3_archive.py load < s3.tar", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
