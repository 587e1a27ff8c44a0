"""``pdserve bench`` against a live local cluster (colocated, EAGLE on, prefix cache on): held-out
code prompts (every field of its JSON is there and the numbers are sane), then multi-turn chats
on the same cluster (later turns find the conversation so far in the prefix cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.builtin import builtin_model_dir
from tests.cluster.harness import ROOT, running

pytestmark = pytest.mark.slow
SUMMARY_KEYS = {"mean", "p50", "p90", "p99"}


def test_bench_json_has_every_field_and_sane_numbers(tmp_path: Path) -> None:
    model = builtin_model_dir()
    worker = ["decode", "--model", str(model), "--port", "0", "--num-pages", "256",
              "--draft", str(model / "draft"), "--num-draft-tokens", "3"]
    with running(worker) as [d], running(["router", "--model", str(model), "--port", "0",
                                          "--colocated", d.address]) as [r]:
        out, chats = tmp_path / "bench.json", tmp_path / "chats.json"
        _bench(r.address, out, "--num-requests", "12", "--dataset", "code", "--input-len",
               "24", "--output-len", "10", "--max-concurrency", "4", "--num-draft-tokens",
               "3", "--slo-ttft-ms", "60000")
        _bench(r.address, chats, "--dataset", "multi-turn", "--num-conversations", "2",
               "--num-turns", "3", "--turn-len", "20", "--output-len", "4")
    multi = json.loads(chats.read_text())
    assert multi["completed"] == 6 and multi["failed"] == 0
    assert multi["prompt_tokens_per_request"] == 44  # turns of 20, 20+4+20, 20+4+20+4+20
    # the full pages of the turn before: 1 of turn 1's 23 computed tokens (20 + 3 answered;
    # the last answer token has no KV), 2 of turn 2's 47; turn 1 finds none: (0 + 16 + 32) / 3
    assert multi["cached_tokens_per_request"] == 16
    report = json.loads(out.read_text())
    for key in ("request_throughput", "output_tokens_per_s", "completed", "failed",
                "acceptance_length", "goodput"):
        assert key in report, key
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == SUMMARY_KEYS, key
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["ttft_ms"]["p50"] <= report["e2e_ms"]["p50"]
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"] + 1e-6
    assert report["total_output_tokens"] > 0 and report["output_tokens_per_s"] > 0
    assert 1.0 <= report["acceptance_length"] <= 4.0
    assert report["goodput"] == 1.0


def _bench(address: str, out: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "--target", address, *args,
         "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
