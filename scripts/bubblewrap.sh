#!/usr/bin/env bash
# Install bubblewrap (Debian's `bubblewrap` package: `bwrap`) and libseccomp, the sandbox of customer
# code (reactors, proxy code transforms; infra/node_runtime/sandbox.py). Does nothing when `bwrap` is
# already on the PATH. Without it customer code does not run (503) and its tests fail, so a machine
# where it cannot be installed is told so in one line, and this script fails.
set -uo pipefail

if ! command -v bwrap >/dev/null 2>&1; then
  as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else return 1; fi; }
  if command -v apt-get >/dev/null; then
    { as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq bubblewrap libseccomp2; } \
      >/dev/null 2>&1
  fi
fi
if command -v bwrap >/dev/null 2>&1; then
  echo "bubblewrap: $(command -v bwrap)"
else
  echo "bubblewrap: not installed and could not be installed here (install Debian's bubblewrap package as root)" >&2
  exit 1
fi
