"""``python -m bench.netns_transfer`` runs end to end on a small request (one cap, one delay,
one send per row): every row is there, the capped row near its cap, the delayed row at least
the round trip it adds."""

from __future__ import annotations

import pytest

from bench import netns_transfer


@pytest.mark.slow
def test_the_benchmark_runs(netns_ready: None, capsys: pytest.CaptureFixture[str]) -> None:
    result = netns_transfer.main(["--quick", "--caps", "100", "--delays", "5", "--reps", "1"])
    assert result["bytes"] == netns_transfer.QUICK.nbytes
    (cap,), (delay,) = result["caps"], result["delays"]
    assert 0.5 < cap["over_cap"] < 1.2  # HTB's burst lets a little of 512 KiB through at once
    assert delay["ms"] >= 10.0 and delay["rtt_added_ms"] == 10.0
    out = capsys.readouterr().out
    assert "baseline (plain link)" in out and "over cap" in out
