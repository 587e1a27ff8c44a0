"""``bench.hybrid_prefix_cache`` runs end to end on its 4-layer toy shape: the same greedy
outputs with the cache on and off, hits only with it on (each later prompt resumes at the last
state checkpoint inside the shared prefix), and one checkpoint's bytes reported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster.harness import ROOT

pytest.importorskip("transformers")


def test_hybrid_prefix_cache_bench_reports_hits_and_equal_outputs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.hybrid_prefix_cache", "--tiny", "--vocab", "384",
         "--prompt-len", "80", "--interval", "32", "--requests", "2", "--new-tokens", "3",
         "--threads", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["same_outputs"]
    # 72 shared tokens: checkpoints at 32 and 64; 2 single and 2 batched requests hit 64 each
    assert report["on"]["hit_tokens"] == 4 * 64 and report["off"]["hit_tokens"] == 0
    # 3 linear layers: conv (64 channels, 3 taps) and a 4 x 8 x 8 float32 state each
    assert report["on"]["state_checkpoint_bytes"] == 3 * (64 * 3 * 4 + 4 * 8 * 8 * 4)
    assert report["on"]["ttft_p50_s"] > 0 and report["off"]["requests_per_s"] > 0
