#!/usr/bin/env bash
# The shared-context-store tests (tests/context_store.rs) start their own redis-server: install
# Debian's package where none is on PATH. Never fails the run: without it those tests skip,
# saying why.
set -uo pipefail
if command -v redis-server >/dev/null || command -v valkey-server >/dev/null; then
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null && sudo="sudo -n" || {
        echo "install-redis: not root and no sudo: the context-store tests will skip" >&2
        exit 0
    }
fi
export DEBIAN_FRONTEND=noninteractive
# Package lists may be missing on a fresh machine: update once if the first try fails.
$sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 ||
    { $sudo apt-get update -qq >/dev/null 2>&1 &&
      $sudo apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; } ||
    echo "install-redis: apt-get could not install redis-server: the context-store tests will skip" >&2
command -v redis-server >/dev/null && redis-server --version
exit 0
