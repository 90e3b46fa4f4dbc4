#!/usr/bin/env bash
# Make sure a headless-capable Chromium is installed (Debian's `chromium` package); the Flower test
# (tests/ops/test_flower.py) drives it. Does nothing when one is already on the PATH. Safe to run again.
set -euo pipefail

found() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
if found; then
  echo "chromium: $(command -v chromium || command -v chromium-browser)"
  exit 0
fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
as_root apt-get update -qq
DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium >/dev/null
found || { echo "chromium did not install" >&2; exit 1; }
echo "chromium: $(command -v chromium || command -v chromium-browser)"
