"""Peak memory of the api process while a large document is uploaded and downloaded.

A real ``tessera api`` child process (PostgreSQL, Redis, moto's S3 server on loopback in this process)
receives ``POST /documents`` uploads of each ``--sizes`` (MB; default 5, 20 and 50), sent with chunked
transfer from a generator (so the client never holds the file either), then ``GET /documents/{id}/data``
streams each back and its SHA-256 is checked. A sampler reads the api process's resident set size
(RSS, psutil) every 5 ms. Reported per size: the RSS just before, the peak during upload and during
download, and the peak growth over the RSS before; plus throughput.

The claim checked: the api streams (1 MiB plaintext chunks sealed one at a time, S3 multipart parts of
5 sealed chunks), so the peak growth does not grow with the document and stays under ``--bound`` MiB
(default 32) for every size, far below one copy of a 20 MB file plus its ciphertext. The script exits
1 when a size breaks the bound. Run from the repository root::

    .venv/bin/python benchmarks/documents.py [--sizes 5,20,50] [--bound 32]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the repository root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass

import psutil

from benchmarks import common

MB = 1000 * 1000
MiB = 1024 * 1024
PIECE = 256 * 1024


@dataclass
class Figures:
    """One size's measurements."""

    size_mb: int
    rss_before_mib: float
    upload_peak_mib: float
    download_peak_mib: float
    upload_seconds: float
    download_seconds: float

    @property
    def upload_growth(self) -> float:
        """Peak RSS during the upload over the RSS before it, MiB."""
        return self.upload_peak_mib - self.rss_before_mib

    @property
    def download_growth(self) -> float:
        """Peak RSS during the download over the RSS before the upload, MiB."""
        return self.download_peak_mib - self.rss_before_mib


class RssSampler:
    """Samples one process's RSS every ``interval`` seconds in a thread; :meth:`peak` since a reset."""

    def __init__(self, pid: int, interval: float = 0.005):
        self._process = psutil.Process(pid)
        self._interval = interval
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        """Start sampling."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self._process.memory_info().rss
            except psutil.Error:
                return
            with self._lock:
                self._peak = max(self._peak, rss)
            time.sleep(self._interval)

    def now(self) -> int:
        """The RSS now, bytes."""
        return self._process.memory_info().rss

    def reset(self) -> None:
        """Start a new peak from the RSS now."""
        with self._lock:
            self._peak = self.now()

    def peak(self) -> int:
        """The highest RSS sampled since the last reset, bytes."""
        with self._lock:
            return self._peak

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5,20,50", help="document sizes in MB, comma-separated")
    parser.add_argument("--bound", type=float, default=32.0, help="largest allowed peak RSS growth, MiB")
    common.add_service_options(parser)
    return parser.parse_args(argv)


def _multipart_stream(size: int, boundary: str, block: bytes):
    """The multipart body of a ``size``-byte document, generated piece by piece."""
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n'
        f"{json.dumps({'metadata': {'bench': 'documents'}})}\r\n"
        f'--{boundary}\r\nContent-Disposition: form-data; name="document"; filename="bench.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    sent = 0
    while sent < size:
        piece = block[: min(len(block), size - sent)]
        sent += len(piece)
        yield piece
    yield f"\r\n--{boundary}--\r\n".encode()


def _expected_digest(size: int, block: bytes) -> str:
    digest = hashlib.sha256()
    for start in range(0, size, len(block)):
        digest.update(block[: min(len(block), size - start)])
    return digest.hexdigest()


def measure(base_url: str, api_key: str, sampler: RssSampler, size: int, block: bytes) -> Figures:
    """Upload then download one document of ``size`` bytes; the figures."""
    import urllib3

    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=5, read=300))
    boundary = "tessera-bench-" + os.urandom(8).hex()
    headers = {"TS-API-KEY": api_key, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    time.sleep(0.5)
    before = sampler.now()
    sampler.reset()
    started = time.monotonic()
    answer = http.request(
        "POST", f"{base_url}/documents", body=_multipart_stream(size, boundary, block), chunked=True, headers=headers
    )
    upload_seconds = time.monotonic() - started
    if answer.status != 201:
        raise RuntimeError(f"upload of {size} bytes answered {answer.status}: {answer.data[:500]!r}")
    upload_peak = sampler.peak()
    document_id = json.loads(answer.data)["id"]

    time.sleep(0.5)
    sampler.reset()
    started = time.monotonic()
    response = http.request(
        "GET", f"{base_url}/documents/{document_id}/data", headers={"TS-API-KEY": api_key}, preload_content=False
    )
    digest = hashlib.sha256()
    for piece in response.stream(MiB):
        digest.update(piece)
    response.release_conn()
    download_seconds = time.monotonic() - started
    if response.status != 200 or digest.hexdigest() != _expected_digest(size, block):
        raise RuntimeError(f"download of {size} bytes: status {response.status} or content mismatch")
    return Figures(
        size_mb=size // MB,
        rss_before_mib=before / MiB,
        upload_peak_mib=upload_peak / MiB,
        download_peak_mib=sampler.peak() / MiB,
        upload_seconds=upload_seconds,
        download_seconds=download_seconds,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every size stays within the bound, else 1."""
    args = parse_args(argv)
    sizes = [int(part) * MB for part in args.sizes.split(",") if part.strip()]
    with common.scratch_dir("tessera-bench-documents-") as scratch:
        s3_port, api_port = common.free_port(), common.free_port()
        env = common.platform_env(
            args.database_url,
            args.redis_url,
            scratch / "data",
            TESSERA_S3_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}",
            TESSERA_S3_BUCKET="tessera-bench-documents",
            TESSERA_DOCUMENT_MAX_BYTES=str(max(sizes) + MB),
            TESSERA_RATE_LIMIT_DOCUMENTS_PER_MINUTE="0",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",  # noqa: S106 - moto accepts any credentials
            AWS_DEFAULT_REGION="us-east-1",
        )
        common.adopt_env(env)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
        from moto.server import ThreadedMotoServer

        s3_server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
        s3_server.start()
        try:
            common.recreate_database(args.database_url)
            common.flush_redis(args.redis_url)
            tenant = common.make_tenant("bench-documents")
            with common.Children(scratch) as children:
                api = children.start("api", [common.executable("tessera"), "api", "--port", str(api_port)])
                base_url = f"http://127.0.0.1:{api_port}"
                common.wait_http(f"{base_url}/status", api)
                sampler = RssSampler(api.pid).start()
                block = os.urandom(PIECE)
                measure(base_url, tenant.api_key, sampler, 2 * MB, block)  # warm-up: imports, pools, bucket
                results = [measure(base_url, tenant.api_key, sampler, size, block) for size in sizes]
                sampler.stop()
        finally:
            s3_server.stop()
    common.print_table(
        f"api process RSS (MiB) while streaming documents; bound on peak growth: {args.bound:g} MiB",
        ["size MB", "RSS before", "upload peak", "growth", "download peak", "growth", "up MB/s", "down MB/s"],
        [
            [
                r.size_mb,
                r.rss_before_mib,
                r.upload_peak_mib,
                r.upload_growth,
                r.download_peak_mib,
                r.download_growth,
                common.ratio(r.size_mb, r.upload_seconds),
                common.ratio(r.size_mb, r.download_seconds),
            ]
            for r in results
        ],
    )
    worst = max(max(r.upload_growth, r.download_growth) for r in results)
    verdict = "within" if worst < args.bound else "OVER"
    print(f"\nlargest peak growth {worst:.1f} MiB: {verdict} the {args.bound:g} MiB bound")
    sizes_mb = ", ".join(str(r.size_mb) for r in results)
    common.publish(
        "documents",
        [
            common.Figure(
                "documents",
                f"api peak RSS growth, largest over {sizes_mb} MB up and down",
                worst,
                "MiB",
                goal=f"< {args.bound:g} MiB",
            )
        ],
    )
    return 0 if worst < args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
