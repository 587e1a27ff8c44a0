"""The KV shape and page choice shared by the transfer benchmarks (:mod:`bench.transfer`,
:mod:`bench.transfer_tp`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.kv.pool import KVPool

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Shape:
    """Model KV shape and the token counts to send."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    tokens: tuple[int, ...]
    reps: int

    @property
    def num_pages(self) -> int:
        return 2 * max(self.tokens) // self.page_size

    def pool(self) -> KVPool:
        return KVPool(self.num_pages, self.page_size, self.kv_heads, self.head_dim,
                      list(range(self.layers)), getattr(torch, self.dtype))


def random_pages(n: int, num_pages: int, fragmented: bool, rng: random.Random) -> list[int]:
    """``n`` page ids of a pool of ``num_pages``: one contiguous run, or ``fragmented`` ones
    drawn anywhere."""
    if not fragmented:
        start = rng.randrange(num_pages - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(num_pages), n)
