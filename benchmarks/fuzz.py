"""The long schemathesis run on demand: ``tests/app/test_schemathesis.py`` with at least
``--requests`` generated requests (default 5,000) against the live API, with a management key, on the
test fixtures (a database, Redis prefix, worker and sandbox of the run's own). Every failing operation is
reported (a server error, or an answer that breaks the OpenAPI description). Not part of CI: the test
command runs the same test with 8 requests per operation.

    .venv/bin/python benchmarks/fuzz.py                 # 5,000 requests, a quarter of an hour or so
    .venv/bin/python benchmarks/fuzz.py --requests 20000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="generated requests in all (default %(default)s)")
    args = parser.parse_args()
    env = {**os.environ, "TESSERA_FUZZ_REQUESTS": str(args.requests), "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/app/test_schemathesis.py",
        "-q",
        "-s",
        "-p",
        "no:randomly",
        "-o",
        "timeout=0",
    ]
    code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
    if code == 0:
        if str(REPO) not in sys.path:  # run as a file: ``benchmarks`` is importable from the repository root
            sys.path.insert(0, str(REPO))
        from benchmarks import common

        common.publish(
            "fuzz",
            [
                common.Figure(
                    "fuzz",
                    "generated requests (at least), no operation failing",
                    args.requests,
                    "",
                    goal="none failing",
                )
            ],
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
