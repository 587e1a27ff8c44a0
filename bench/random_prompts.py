"""Random token prompts of the engine benchmarks (:mod:`bench.engine`, :mod:`bench.host_time`)."""

from __future__ import annotations

import torch


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 16, (batch, length), generator=gen).tolist()
