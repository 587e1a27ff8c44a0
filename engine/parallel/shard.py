"""Which part of the decoder one tensor-parallel rank holds, and which slice of each checkpoint
tensor that is.

Rank ``r`` of ``n`` holds, in every decoder layer:

- query heads ``[r * h/n, (r+1) * h/n)``: rows of ``q_proj`` (weight and bias), columns of
  ``o_proj`` (row-parallel: each rank's ``o_proj`` output is a partial sum, all-reduced);
- its key/value heads: with ``kv >= n`` heads, ``kv/n`` of them, ``[r * kv/n, (r+1) * kv/n)``;
  with fewer heads than ranks (``n % kv == 0``), the one head its query heads read,
  ``r // (n/kv)``, replicated on ``n/kv`` ranks. Rows of ``k_proj`` and ``v_proj``;
- MLP columns ``[r * I/n, (r+1) * I/n)``: rows of ``gate_proj`` and ``up_proj``, columns of
  ``down_proj`` (row-parallel, all-reduced).

The norms are whole on every rank. The embedding, the LM head and the vision tower are on rank 0
only: it embeds (images included) and samples, and the other ranks get the embeddings from it.
A rank's KV pool holds its key/value heads only.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import TextConfig
from engine.errors import ConfigError

_LAYER_PREFIX = "model.layers."
_RANK_0_ONLY = ("model.embed_tokens.", "lm_head.", "visual.")
# name inside a decoder layer -> (dim split, which partition)
_SPLITS = {
    "self_attn.q_proj.weight": (0, "q"),
    "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"),
    "mlp.up_proj.weight": (0, "mlp"),
    "mlp.down_proj.weight": (1, "mlp"),
}


def check_tp_size(cfg: TextConfig, size: int) -> None:
    """Raise :class:`ConfigError` unless the decoder splits over ``size`` ranks."""
    h, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if size < 1:
        raise ConfigError(f"tp size must be at least 1, got {size}")
    if h % size:
        raise ConfigError(f"tp size {size} must divide num_attention_heads ({h})")
    if kv % size and size % kv:
        raise ConfigError(f"tp size {size} must divide num_key_value_heads ({kv}) or be a "
                          "multiple of it")
    if inter % size:
        raise ConfigError(f"tp size {size} must divide intermediate_size ({inter})")


@dataclass(frozen=True)
class TextShard:
    """Rank ``rank``'s share of every decoder layer (see the module docstring)."""

    rank: int
    size: int
    head_dim: int
    num_heads: int  # query heads here
    num_kv_heads: int  # key/value heads here
    kv_head_start: int  # the first of them, as a global kv head index
    intermediate_size: int  # MLP columns here

    @classmethod
    def of(cls, cfg: TextConfig, rank: int = 0, size: int = 1) -> TextShard:
        check_tp_size(cfg, size)
        kv = cfg.num_key_value_heads
        kv_here = kv // size if kv >= size else 1
        kv_start = rank * kv_here if kv >= size else rank // (size // kv)
        return cls(rank, size, cfg.head_dim, cfg.num_attention_heads // size, kv_here, kv_start,
                   cfg.intermediate_size // size)

    def span(self, part: str) -> tuple[int, int]:
        """``[start, stop)`` of this rank's rows (or columns) of partition ``part``."""
        if part == "q":
            n = self.num_heads * self.head_dim
            return self.rank * n, (self.rank + 1) * n
        if part == "kv":
            return (self.kv_head_start * self.head_dim,
                    (self.kv_head_start + self.num_kv_heads) * self.head_dim)
        n = self.intermediate_size
        return self.rank * n, (self.rank + 1) * n

    def holds(self, name: str) -> bool:
        """Whether this rank holds checkpoint tensor ``name`` (a canonical name) at all."""
        return self.rank == 0 or not name.startswith(_RANK_0_ONLY)

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of this rank's part of checkpoint tensor ``name`` (a canonical
        name), or None when every rank holds it whole."""
        if not name.startswith(_LAYER_PREFIX):
            return None
        return self.layer_slice(name[len(_LAYER_PREFIX) :].partition(".")[2])

    def layer_slice(self, inside: str) -> tuple[int, int, int] | None:
        """:meth:`slice_of` of tensor ``inside`` a decoder layer (``self_attn.q_proj.weight``;
        an EAGLE draft's layer splits the same way)."""
        if self.size == 1:
            return None
        split = _SPLITS.get(inside)
        if split is None:
            return None
        dim, part = split
        return (dim, *self.span(part))
