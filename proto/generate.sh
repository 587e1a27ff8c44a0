#!/usr/bin/env bash
# Regenerates the Python modules of proto/pdserve/v1/*.proto (committed next to them).
# Usage: bash proto/generate.sh [OUT_ROOT]   (default: proto/, i.e. in place)
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-.}"
PY="${PYTHON:-python3}"
mkdir -p "$out"
"$PY" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  pdserve/v1/generate.proto pdserve/v1/worker.proto pdserve/v1/admin.proto
# protoc writes absolute imports ("from pdserve.v1 import ..."); the package lives under proto/.
sed -i "s/^from pdserve\.v1 import/from proto.pdserve.v1 import/" "$out"/pdserve/v1/*_pb2*.py "$out"/pdserve/v1/*_pb2*.pyi
