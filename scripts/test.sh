#!/usr/bin/env bash
# The README's test command: install, lint, type-check, run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# AIPerf, the load generator tests/deploy/test_launch.py runs against a launched cluster, in a
# venv of its own: it pins huggingface-hub<2, which the test extra's transformers cannot share.
# It needs no torch; the constraint makes a dependency that asks for one an error, not a CUDA
# build's download.
[ -x .venv/aiperf/bin/python ] || python3 -m venv .venv/aiperf
.venv/aiperf/bin/pip install -q -c <(echo "torch<0") aiperf==0.13.0
.venv/bin/ruff check .
.venv/bin/mypy  # the files and settings are in pyproject.toml's [tool.mypy]
.venv/bin/python -m pytest -q --durations=40 "$@"
