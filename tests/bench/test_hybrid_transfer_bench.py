"""The hybrid transfer benchmark's smoke run: real sends of the quick shape over Mooncake on
loopback, every figure consistent with the shape (the benchmark itself checks each send's
landed bytes and byte count, and raises otherwise)."""

from __future__ import annotations

import pytest

from bench.hybrid_transfer import QUICK, HybridShape, main

pytestmark = pytest.mark.slow


def test_expected_bytes_is_the_formula() -> None:
    s = HybridShape()  # 8 full layers (3, 7, ..., 31), 24 linear, bfloat16
    assert s.full_layers(True) == list(range(3, 32, 4))
    state = 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert s.state_bytes() == state
    assert s.expected_bytes(1024, True) == 2 * 8 * 1024 * 4 * 256 * 2 + 24 * state
    assert s.expected_bytes(16384, False) == 2 * 32 * 16384 * 4 * 256 * 2 == 2 * 2**30
    assert s.expected_bytes(17, False) == s.expected_bytes(32, False)  # whole pages go


def test_quick_run_moves_what_the_shape_says(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--quick", "--tokens", "64", "2048", "--reps", "2"])
    assert [(r["tokens"], r["model"]) for r in rows] == [
        (64, "hybrid"), (64, "full"), (2048, "hybrid"), (2048, "full")]
    for r in rows:
        assert r["bytes"] == QUICK.expected_bytes(r["tokens"], r["model"] == "hybrid")
        assert 0 < r["min_ms"] <= r["ms"] <= r["max_ms"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
    short, long = rows[0], rows[2]
    assert short["bytes_ratio"] == short["bytes"] / rows[1]["bytes"]
    # the states are fixed-size, the KV grows: the hybrid share shrinks with the prompt
    assert long["bytes_ratio"] < short["bytes_ratio"]
    assert long["bytes"] < rows[3]["bytes"] and long["bytes_ratio"] < 0.5
    out = capsys.readouterr().out
    assert f"{long['bytes']:,}" in out and f"{long['bytes_ratio']:.3f}" in out
