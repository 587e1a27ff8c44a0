#!/usr/bin/env bash
# The README's main command: install, write the built-in tiny model, generate from a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh mooncake
.venv/bin/pdserve generate "def fibonacci(n):" --max-new-tokens 32
