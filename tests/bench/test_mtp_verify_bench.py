"""``bench.mtp_verify`` runs end to end on its small shape: both ways of keeping a verify's
linear-attention states leave the same bits (checked before timing, or the run fails), a row per
batch size and K, and replay holding the rows' inputs instead of a state per row."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cluster.harness import ROOT


def test_mtp_verify_bench_rows_and_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.mtp_verify", "--quick", "--reps", "1", "--batch", "1",
         "2", "--k", "3", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 3), (2, 3)]
    for r in rows:
        n, heads, dk, dv = r["k"] + 1, 4, 16, 16  # the small shape: 4 value heads of 16
        assert r["rows_bytes"] == r["batch"] * n * heads * dk * dv * 4
        assert r["replay_bytes"] == r["batch"] * n * heads * (dk + dv + 2) * 4
        assert r["rows_ms"] > 0 and r["replay_all_ms"] > 0
