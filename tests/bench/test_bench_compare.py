"""``pdserve bench --compare`` in one small run: it starts the disaggregated and EAGLE clusters
and a colocated one without a prefix cache itself (a plain colocated one starts the same way, so
it is left out to save time), runs transformers' ``generate`` on the same shared-prefix
requests, and writes one row per target and request rate with every field, ratios against the
baseline, the prefix cache's hits and the KV bytes sent, and a PNG plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare import goodput_rates
from tests.cluster.harness import ROOT

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
FIELDS = {"request_throughput", "output_tokens_per_s", "completed", "failed", "ttft_ms",
          "tpot_ms", "itl_ms", "e2e_ms", "ratios", "prompt_tokens_per_request",
          "cached_tokens_per_request"}
TARGETS = ("disaggregated", "colocated-no-cache", "disaggregated+eagle", "transformers")


def test_compare_runs_every_target_on_the_same_requests(tmp_path: Path) -> None:
    out, png = tmp_path / "compare.json", tmp_path / "latency.png"
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "--compare", "--num-requests", "4",
         "--compare-targets", ",".join(TARGETS), "--dataset", "shared-prefix",
         "--shared-prefix-ratio", "0.75", "--input-len", "48", "--output-len", "5",
         "--max-concurrency", "2",
         "--request-rate", "50", "--request-rate", "inf", "--json", str(out),
         "--plot", str(png), "--no-progress", "--slo-ttft-ms", "600000"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["baseline"] == "transformers"
    rows = report["rows"]
    assert [(r["target"], r["request_rate"]) for r in rows] == [
        (t, rate) for t in TARGETS for rate in (50.0, None)]
    for row in rows:
        assert FIELDS <= set(row), row["target"]
        assert row["completed"] == 4 and row["failed"] == 0
        assert row["ratios"]["same_tokens"] == 1.0, row["target"]  # greedy everywhere
        assert row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
        assert row["prompt_tokens_per_request"] == 48
        cached = row["cached_tokens_per_request"]
        if row["target"] in ("transformers", "colocated-no-cache"):
            assert cached == 0, row["target"]
        elif row["request_rate"] is None:  # the cluster's cache holds the first run's prompts
            assert 16 <= cached < 48, row["target"]
        sent = row.get("kv_bytes_sent_per_request")
        if row["target"].startswith("disaggregated"):
            assert sent is not None and sent > 0, row["target"]
            assert set(row["node_counters"]) == {"prefill", "decode"}
            assert row["node_counters"]["prefill"]["transfer_bytes"] == pytest.approx(
                4 * sent, abs=4)
        else:
            assert sent is None, row["target"]
    warm = [r for r in rows if r["target"] == "disaggregated" and r["request_rate"] is None]
    assert warm[0]["node_counters"]["prefill"]["kv_bytes_not_sent"] > 0  # delta transfer
    eagle = [r for r in rows if r["target"] == "disaggregated+eagle"]
    assert all(1.0 <= r["acceptance_length"] <= 5.0 for r in eagle)
    assert all(r["ratios"]["output_tokens_per_s"] == 1.0 for r in rows
               if r["target"] == "transformers")
    assert all(r["goodput"] == 1.0 for r in rows)  # a 10-minute TTFT limit: every request
    assert report["goodput_max_rate"] == dict.fromkeys(TARGETS, "max")
    assert "| disaggregated+eagle |" in proc.stderr  # the Markdown table
    assert "| colocated-no-cache |" in proc.stderr and "KV KiB/req" in proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_max_rate_is_the_highest_rate_meeting_the_slo() -> None:
    rows = [{"target": "a", "request_rate": 2.0, "goodput": 1.0},
            {"target": "a", "request_rate": 8.0, "goodput": 0.95},
            {"target": "a", "request_rate": None, "goodput": 0.5},
            {"target": "b", "request_rate": 2.0, "goodput": 0.89},
            {"target": "b", "request_rate": None, "goodput": 0.2},
            {"target": "c", "request_rate": 2.0, "goodput": 0.1},
            {"target": "c", "request_rate": None, "goodput": 0.9},
            {"target": "d", "request_rate": 2.0}]  # no SLO given: skipped
    assert goodput_rates(rows) == {"a": 8.0, "b": None, "c": "max"}
