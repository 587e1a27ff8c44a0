"""The transfer benchmark runs end to end on a tiny shape and reports all three rates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_reports_rates() -> None:
    cmd = [sys.executable, "-m", "bench.transfer", "--json", "--layers", "2",
           "--kv-heads", "2", "--head-dim", "16", "--page-size", "4", "--dtype", "float32",
           "--tokens", "64", "--reps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True,
                          cwd=ROOT)
    out = json.loads(proc.stdout)
    for key in ("send_kvcache_gbps", "engine_gbps", "memcpy_gbps", "send_over_engine",
                "engine_over_memcpy"):
        assert out[key] > 0
    assert [c["fragmented"] for c in out["cases"]] == [False, True]


@pytest.mark.slow
def test_bench_reports_heterogeneous_tp_ratios() -> None:
    cmd = [sys.executable, "-m", "bench.transfer", "--json", "--layers", "2",
           "--kv-heads", "2", "--head-dim", "16", "--page-size", "4", "--dtype", "float32",
           "--tokens", "64", "--reps", "1", "--tp", "1:2", "2:1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True,
                          cwd=ROOT)
    runs = json.loads(proc.stdout)["runs"]
    assert [(r["prefill_tp"], r["decode_tp"]) for r in runs] == [(1, 2), (2, 1)]
    for r in runs:
        assert min(r["ratio_vs_prefill_tp"], r["ratio_vs_decode_tp"], r["ratio_same_blocks"]) > 0
        for case in r["cases"]:  # page-sized blocks: as many as equal TP at the larger TP
            big = "equal_d_blocks" if r["decode_tp"] > r["prefill_tp"] else "equal_p_blocks"
            assert case["hetero_blocks"] == case[big]
