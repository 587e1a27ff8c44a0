#!/usr/bin/env bash
# The README's main command: install, `pdserve launch` a local Ray cluster (router, prefill and
# decode workers on the built-in tiny model), stream one answer with `pdserve client`, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh mooncake
export OMP_NUM_THREADS=1
PD=.venv/bin/pdserve
log=$(mktemp)
"$PD" launch --port 0 >"$log" 2>&1 &
launcher=$!
stop() {
  kill -INT "$launcher" 2>/dev/null && wait "$launcher" 2>/dev/null || true
  grep -E "^(stopping|stopped)" "$log" || true
}
trap stop EXIT
for _ in $(seq 1800); do
  address=$(grep -m1 -oP '^READY \K\S+' "$log") && break
  kill -0 "$launcher" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
[ -n "${address:-}" ] || { echo "the cluster did not start:" >&2; cat "$log" >&2; exit 1; }
grep -m1 "^router:" "$log"
"$PD" client --target "$address" --chat \
  "Write a Python function fibonacci(n). Return the n-th Fibonacci number." --max-new-tokens 64
