#!/usr/bin/env bash
# The README's test command: install, lint, run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
