"""StatePool: shapes and dtypes per layer, reset of the given slots only, and its byte counts."""

from __future__ import annotations

import pytest
import torch

from engine.kv.state_pool import StatePool, slot_bytes, slots_for_budget

SHAPE = {"conv_channels": 12, "conv_kernel": 4, "num_v_heads": 4, "head_k_dim": 8,
         "head_v_dim": 6}


def _pool(num_slots: int = 6, layers: tuple[int, ...] = (1, 2, 5)) -> StatePool:
    return StatePool(num_slots, list(layers), conv_channels=12, conv_kernel=4, num_v_heads=4,
                     head_k_dim=8, head_v_dim=6, dtype=torch.bfloat16)


def test_each_layer_has_a_conv_and_a_recurrent_state() -> None:
    pool = _pool()
    assert pool.layers == [1, 2, 5] and pool.num_layers == 3
    assert pool.device == torch.device("cpu")
    for i in range(pool.num_layers):
        assert pool.conv(i).shape == (6, 12, 3) and pool.conv(i).dtype == torch.bfloat16
        assert pool.recurrent(i).shape == (6, 4, 8, 6)
        assert pool.recurrent(i).dtype == torch.float32
        assert not pool.conv(i).any() and not pool.recurrent(i).any()
    assert pool.conv(0).data_ptr() != pool.conv(1).data_ptr()


def test_reset_zeroes_only_the_given_slots_in_every_layer() -> None:
    pool = _pool()
    for i in range(pool.num_layers):
        pool.conv(i).fill_(1)
        pool.recurrent(i).fill_(2)
    pool.reset([4, 1])
    kept = [0, 2, 3, 5]
    for i in range(pool.num_layers):
        assert not pool.conv(i)[[1, 4]].any() and not pool.recurrent(i)[[1, 4]].any()
        assert bool((pool.conv(i)[kept] == 1).all()) and bool((pool.recurrent(i)[kept] == 2).all())
    pool.reset([])  # nothing to do


def test_reset_refuses_slots_outside_the_pool_and_changes_nothing() -> None:
    pool = _pool()
    pool.recurrent(0).fill_(3)
    with pytest.raises(ValueError, match=r"\[6\] are outside \[0, 6\)"):
        pool.reset([0, 6])
    assert bool((pool.recurrent(0) == 3).all())


def test_bytes_per_slot_and_budget() -> None:
    pool = _pool(num_slots=5)
    per_layer = 12 * 3 * 2 + 4 * 8 * 6 * 4  # bf16 conv state + float32 recurrent state
    assert pool.bytes_per_slot == 3 * per_layer
    assert pool.total_bytes == 5 * 3 * per_layer
    actual = sum(t.numel() * t.element_size() for i in range(3)
                 for t in (pool.conv(i), pool.recurrent(i)))
    assert pool.total_bytes == actual
    assert slot_bytes(3, dtype=torch.bfloat16, **SHAPE) == pool.bytes_per_slot
    assert slots_for_budget(10 * 3 * per_layer + 1, 3, dtype=torch.bfloat16, **SHAPE) == 10
    assert slots_for_budget(3 * per_layer - 1, 3, dtype=torch.bfloat16, **SHAPE) == 0


@pytest.mark.parametrize(("num_slots", "layers", "kernel", "match"), [
    (0, [0], 4, "needs slots and layers"),
    (2, [], 4, "needs slots and layers"),
    (2, [3, 3], 4, "duplicate layer ids"),
    (2, [0], 0, "conv kernel"),
])
def test_bad_shapes_are_refused(num_slots: int, layers: list[int], kernel: int,
                                match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StatePool(num_slots, layers, conv_channels=12, conv_kernel=kernel, num_v_heads=4,
                  head_k_dim=8, head_v_dim=6)
