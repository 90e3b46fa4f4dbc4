#!/usr/bin/env bash
# Install a headless-capable Chromium (Debian's `chromium` package) for the browser tests
# (tests/browser.py: Flower's pages, the invitation page). Does nothing when one is already on the
# PATH. When it cannot be installed (no apt-get, no root, no package) it says so and succeeds: the
# browser tests are then skipped, each with the reason in pytest's summary. Safe to run again.
set -uo pipefail

found() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
if ! found; then
  as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }
  if command -v apt-get >/dev/null; then
    { as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium; } \
      >/dev/null 2>&1
  fi
fi
if found; then
  echo "chromium: $(command -v chromium || command -v chromium-browser)"
else
  echo "chromium: could not be installed here; the browser tests will be skipped" >&2
fi
exit 0
