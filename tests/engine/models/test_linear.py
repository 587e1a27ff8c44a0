"""Prepared linears (engine/models/linear.py) against torch's F.linear, their twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear import PACKING, PreparedLinear, packs, prepare_linears


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 130])
def test_prepared_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    for b in (None, bias):
        linear = PreparedLinear(weight, b)
        assert linear.packed == packs(weight)
        torch.testing.assert_close(linear(x), F.linear(x, weight, b), **_tolerance(dtype))
    assert torch.equal(PreparedLinear(weight).weight(), weight)  # the packing keeps every bit


def test_cpu_float32_weights_are_packed_and_packing_can_be_turned_off() -> None:
    weight = torch.randn(8, 4)
    assert torch.backends.mkldnn.is_available()  # the project's CPU wheel has oneDNN
    assert PreparedLinear(weight).packed
    assert not PreparedLinear(weight.half()).packed  # float16: the plain product
    PACKING["enabled"] = False
    try:
        plain = PreparedLinear(weight)
        assert not plain.packed and plain.weight() is not weight  # a detached view
        assert plain.weight().data_ptr() == weight.data_ptr()
    finally:
        PACKING["enabled"] = True


def test_empty_and_strided_inputs() -> None:
    weight = torch.randn(6, 4)
    linear = PreparedLinear(weight)
    assert linear(torch.empty(0, 4)).shape == (0, 6)
    x = torch.randn(4, 5).t()  # [5, 4], not contiguous
    torch.testing.assert_close(linear(x), F.linear(x, weight))
    batched = torch.randn(2, 3, 4)
    torch.testing.assert_close(linear(batched), F.linear(batched, weight))


def test_prepare_linears_stacks_groups_and_frees_packed_weights() -> None:
    torch.manual_seed(0)
    q, k = nn.Linear(4, 6), nn.Linear(4, 2)
    o = nn.Linear(8, 4, bias=False)
    x, y = torch.randn(3, 4), torch.randn(3, 8)
    want_qk = torch.cat([q(x), k(x)], dim=-1)
    want_o = o(y)
    with torch.no_grad():
        qk, out = prepare_linears(((q, k), (o,)))
        torch.testing.assert_close(qk(x), want_qk)
        torch.testing.assert_close(out(y), want_o)
    assert qk.packed and q.weight.numel() == 0 and k.weight.numel() == 0  # one copy: the packed
    assert q.bias is not None and q.bias.shape == (6,)  # biases stay


def test_unpacked_projections_share_the_stacked_rows() -> None:
    torch.manual_seed(0)
    gate, up = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)
    x = torch.randn(2, 4)
    PACKING["enabled"] = False
    try:
        with torch.no_grad():
            fused, = prepare_linears(((gate, up),))
            up.weight.zero_()  # an in-place change reaches the stacked weight
            assert torch.equal(fused(x)[:, 3:], torch.zeros(2, 3))
            torch.testing.assert_close(fused(x)[:, :3], gate(x))
    finally:
        PACKING["enabled"] = True
