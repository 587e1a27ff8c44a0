#!/usr/bin/env bash
# The README's test command: install, lint, type-check, run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/mypy  # the files and settings are in pyproject.toml's [tool.mypy]
.venv/bin/python -m pytest -q --durations=40 "$@"
