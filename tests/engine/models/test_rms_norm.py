"""The decoder's RMSNorm (engine/models/layers.py) against transformers' Qwen2RMSNorm, bit for
bit, in float32 and in the narrower dtypes it normalises in float32."""

from __future__ import annotations

import pytest
import torch

from engine.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_equals_transformers_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    gen = torch.Generator().manual_seed(rows)
    ours, theirs = RMSNorm(96, 1e-6), Qwen2RMSNorm(96, eps=1e-6)
    weight = torch.randn(96, generator=gen)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
