"""The network benchmarks run end to end on small inputs: ``python -m bench.netns_transfer``
(one cap, one delay, one send per row: every row is there, the capped row near its cap, the
delayed row at least the round trip it adds) and ``python -m bench.netns_ttft`` (a short prompt,
two delays: both targets answer, and the added round trip shows in their TTFT)."""

from __future__ import annotations

import pytest

from bench import netns_transfer, netns_ttft


@pytest.mark.slow
def test_the_transfer_benchmark_runs(netns_ready: None,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    result = netns_transfer.main(["--quick", "--caps", "100", "--delays", "5", "--reps", "1"])
    assert result["bytes"] == netns_transfer.QUICK.nbytes
    (cap,), (delay,) = result["caps"], result["delays"]
    assert 0.5 < cap["over_cap"] < 1.2  # HTB's burst lets a little of 512 KiB through at once
    assert delay["ms"] >= 10.0 and delay["rtt_added_ms"] == 10.0
    out = capsys.readouterr().out
    assert "baseline (plain link)" in out and "over cap" in out


@pytest.mark.slow
def test_the_ttft_benchmark_runs(netns_ready: None, capsys: pytest.CaptureFixture[str]) -> None:
    """20 ms on every link: on either target the router's call to a worker and its first
    answer cross at least one round trip of 40 ms (the client and the routers share host 0)."""
    result = netns_ttft.main(["--delays", "0", "20", "--reps", "1", "--prompt-len", "64"])
    base, slow = result["rows"]
    assert (base["rtt_added_ms"], slow["rtt_added_ms"]) == (0, 40)
    for target in netns_ttft.TARGETS:
        assert slow[target]["min_ms"] >= 40, (target, slow[target])
        assert 0 < base[target]["min_ms"] < slow[target]["min_ms"]
    assert "disagg/coloc" in capsys.readouterr().out
