#!/usr/bin/env bash
# The README's test command: install, lint, type-check, run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/mypy  # the files and settings are in pyproject.toml's [tool.mypy]
# two workers (PDSERVE_TEST_WORKERS), a module per xdist group (tests/conftest.py): most tests
# wait on subprocesses and sockets, so two run well on two cores
.venv/bin/python -m pytest -q --durations=25 -n "${PDSERVE_TEST_WORKERS:-2}" --dist loadgroup "$@"
