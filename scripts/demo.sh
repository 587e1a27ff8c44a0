#!/usr/bin/env bash
# The README's main command: install, start a prefill node, a decode node and a router on
# loopback with the built-in tiny model, stream one answer through `pdserve client`, stop all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh mooncake
export OMP_NUM_THREADS=1
PD=.venv/bin/pdserve
logs=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# start NAME ARGS...: run `pdserve ARGS --port 0` in the background; prints its port once ready.
start() {
  local name=$1; shift
  "$PD" "$@" --port 0 >"$logs/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do
    if port=$(grep -m1 -oP '^READY \K[0-9]+' "$logs/$name.log"); then echo "$port"; return; fi
    kill -0 "${pids[-1]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "$name did not start:" >&2; cat "$logs/$name.log" >&2; exit 1
}

"$PD" make-tiny-model "${PDSERVE_CACHE:-$HOME/.cache/pdserve}/tiny-qwen2-vl" >/dev/null
prefill=$(start prefill prefill)
decode=$(start decode decode)
router=$(start router router --prefill "127.0.0.1:$prefill" --decode "127.0.0.1:$decode")
echo "cluster up: router 127.0.0.1:$router, prefill :$prefill, decode :$decode"
"$PD" client --target "127.0.0.1:$router" "def fibonacci(n):" --max-new-tokens 32
