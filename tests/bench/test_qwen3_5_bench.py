"""``bench.qwen3_5_generate`` runs end to end on its 4-layer toy shape: a row per batch size,
greedy tokens equal to transformers' at batch 1, and the per-request memory of the hybrid
against an all-full-attention model of the same shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster.harness import ROOT

pytest.importorskip("transformers")


def test_qwen3_5_bench_reports_rows_and_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.qwen3_5_generate", "--tiny", "--vocab", "384",
         "--batches", "1,3", "--prompt-len", "10", "--new-tokens", "4", "--threads", "1",
         "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    assert report["rows"][0]["same"] == 1  # float32 greedy: the same tokens
    for row in report["rows"]:
        assert row["pdserve_tok_s"] > 0 and row["transformers_tok_s"] > 0
    mem = report["memory"]
    # 1 of the toy's 4 layers is full attention: K and V of 2 heads x 16 in float32 per token
    assert (mem["kv_layers"], mem["layers"]) == (1, 4)
    assert mem["kv_bytes_per_token"] == 2 * 2 * 16 * 4
    assert mem["full_kv_bytes_per_token"] == 4 * mem["kv_bytes_per_token"]
    # 3 linear layers: conv (2*2*8 + 4*8 channels, 3 taps) and a 4 x 8 x 8 float32 state each
    assert mem["state_bytes_per_request"] == 3 * (64 * 3 * 4 + 4 * 8 * 8 * 4)
    assert [r["tokens"] for r in mem["per_request"]] == [14, 4096, 32768]
