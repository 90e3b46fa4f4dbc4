"""S3 access through boto3 (documents, account-updater files).

One client per process for ``TESSERA_S3_ENDPOINT_URL`` / ``TESSERA_S3_REGION``; the bucket
(``TESSERA_S3_BUCKET``) is created on first use when missing. Pre-signed URLs are signed for
``TESSERA_S3_PUBLIC_ENDPOINT_URL`` when set (the address clients outside the platform's network use,
e.g. ``http://localhost:9000`` for a compose service the containers call ``http://s3:9000``): a
pre-signed URL's signature covers its host, so it is signed by a client of that endpoint. Objects are
written with server-side encryption (``AES256``). Credentials come from the usual AWS variables or instance roles.
"""

from __future__ import annotations

import functools
import threading

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from config.settings import get_settings

_bucket_ready: set[str] = set()
_lock = threading.Lock()


def _client(endpoint_url: str | None):
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=get_settings().s3_region,
        config=Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"max_attempts": 3}),
    )


@functools.cache
def get_client():
    """The process's S3 client (path-style addressing, so loopback endpoints work)."""
    return _client(get_settings().s3_endpoint_url)


@functools.cache
def get_presigning_client():
    """The client that signs pre-signed URLs: for ``TESSERA_S3_PUBLIC_ENDPOINT_URL`` when set, else
    :func:`get_client` (signing makes no request, so this client never connects anywhere)."""
    public = get_settings().s3_public_endpoint_url
    return _client(public) if public else get_client()


def bucket() -> str:
    """The configured bucket, created when missing (once per process)."""
    name = get_settings().s3_bucket
    if name not in _bucket_ready:
        with _lock:
            if name not in _bucket_ready:
                client = get_client()
                try:
                    client.head_bucket(Bucket=name)
                except ClientError:
                    client.create_bucket(Bucket=name)
                _bucket_ready.add(name)
    return name


def presigned_url(method: str, key: str, *, expires_in: int, content_type: str | None = None) -> str:
    """A pre-signed URL for ``get_object`` or ``put_object`` on ``key``, valid ``expires_in`` seconds."""
    operation = {"GET": "get_object", "PUT": "put_object"}[method]
    params = {"Bucket": bucket(), "Key": key}
    if content_type and method == "PUT":
        params["ContentType"] = content_type
    return get_presigning_client().generate_presigned_url(operation, Params=params, ExpiresIn=expires_in)


def reset_client() -> None:
    """Forget the client and the known buckets (tests that change the settings)."""
    get_client.cache_clear()
    get_presigning_client.cache_clear()
    _bucket_ready.clear()


#: The first segment of every key under which a tenant's objects live (``<prefix>/<tenant id>/...``):
#: documents and account-updater files.
TENANT_PREFIXES = ("documents", "account-updater")


def delete_prefixes(prefixes: list[str]) -> int:
    """Delete every object whose key starts with one of ``prefixes`` (1,000 a request); how many."""
    client, name = get_client(), bucket()
    removed = 0
    for prefix in prefixes:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=prefix):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
                removed += len(keys)
    return removed
