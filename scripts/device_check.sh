#!/usr/bin/env bash
# The one prepared accelerator check (see scripts/device_check.py): correctness of pdserve on the
# device against transformers, graphs on/off, EAGLE vs plain decoding, and speed vs transformers,
# written as a JSON report to $OUT (default ./device_check_out). Needs no network and no install:
# the repository runs from its working tree.
#
#   bash scripts/device_check.sh [--device cuda] [--quick] [--budget-s 450]
#
# DEVICE_CHECK_LIMIT_S (default 480) is the hard limit; the report is rewritten after every
# section, so a run stopped by it still leaves the sections done so far.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_check_out}"
export OUT
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ "$PYTHON" = python3 ] && PYTHON=.venv/bin/python
timeout --signal=TERM --kill-after=10 "${DEVICE_CHECK_LIMIT_S:-480}" \
    "$PYTHON" scripts/device_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_check.log"
status=${PIPESTATUS[0]}
echo "device_check: exit $status; report $OUT/device_check.json, summary $OUT/device_check_summary.txt"
exit "$status"
