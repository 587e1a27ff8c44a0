"""The hybrid transfer benchmark's smoke run: real sends of the quick shape, every figure
consistent with the shape (the benchmark itself checks the landed bytes and the byte count)."""

from __future__ import annotations

import pytest

from bench.hybrid_transfer import HybridShape, main

pytestmark = pytest.mark.slow


def test_quick_run_moves_what_the_shape_says() -> None:
    rows = main(["--quick", "--tokens", "64", "2048", "--reps", "1", "--json"])
    assert [(r["tokens"], r["model"]) for r in rows] == [
        (64, "hybrid"), (64, "full"), (2048, "hybrid"), (2048, "full")]
    shape = HybridShape(layers=8, kv_heads=2, head_dim=64, k_heads=4, k_dim=32, v_heads=8,
                        v_dim=32)
    for r in rows:
        assert r["bytes"] == shape.expected_bytes(r["tokens"], r["model"] == "hybrid")
        assert r["ms"] > 0
    short, long = rows[0], rows[2]
    # the states are fixed-size, the KV grows: the hybrid share shrinks with the prompt
    assert long["bytes_ratio"] < short["bytes_ratio"]  # (at 64 tokens the states weigh more)
    assert long["bytes_ratio"] < 0.5
