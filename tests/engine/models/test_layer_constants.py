"""The constant tensors the layers cache (``DeviceCopies``, the rotary half-swap index) are
ordinary tensors even when the engine makes them first under ``torch.inference_mode``: a
training script that runs after the engine in the same process can still backpropagate
through the same layers."""

from __future__ import annotations

import torch

from engine.models.layers import DeviceCopies, RotaryTables

HALF = 37  # a rotary width no other test uses, so its swap index is made here


def test_cached_constants_made_in_inference_mode_serve_autograd_later() -> None:
    with torch.inference_mode():
        made = RotaryTables(torch.ones(3, 2 * HALF), torch.zeros(3, 2 * HALF))
        copies = DeviceCopies(torch.arange(4.0))
        first = copies.on(torch.device("meta"))
    assert not made.swap.is_inference() and not first.is_inference()
    tables = RotaryTables(torch.rand(3, 2 * HALF), torch.rand(3, 2 * HALF))
    assert tables.swap is made.swap  # the cached index, made in inference mode above
    x = torch.randn(3, 2, 2 * HALF, requires_grad=True)
    tables.apply(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
