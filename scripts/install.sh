#!/usr/bin/env bash
# Installs pdserve into ./.venv on a fresh machine (Python 3.10+ only).
# Usage: scripts/install.sh [EXTRAS]   (default: test; e.g. "mooncake" for serving only)
# torch==2.13.0 is installed first so pip takes the CPU wheel instead of a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # The Mooncake transfer engine imports libibverbs even when it only speaks TCP.
  if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null
  fi
  # A C compiler builds the native CPU kernels (engine/attention/linear/native) on first use.
  if ! command -v cc >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq gcc libc6-dev >/dev/null
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[${1:-test}]"
