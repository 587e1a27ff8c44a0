"""``bench.spec`` (EAGLE on vs off) runs end to end on the tiny random model and its random
draft: every batch size gets a row over all its prompt groups, outputs checked equal inside."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.cluster.harness import ROOT


def test_spec_bench_reports_a_row_per_batch_size() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.spec", "--k", "2", "--batch", "1,2", "--groups", "2",
         "--repeats", "2", "--new", "6", "--prompt-len", "8", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["batch"], r["groups"], r["k"]) for r in rows] == [(1, 2, 2), (2, 2, 2)]
    for row in rows:
        assert row["plain_tok_s"] > 0 and row["eagle_tok_s"] > 0
        assert 1.0 <= row["acceptance_length"] <= 3.0
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
