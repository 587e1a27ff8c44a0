"""Which part of the decoder one tensor-parallel rank holds, and which slices of each checkpoint
tensor that is.

Rank ``r`` of ``n`` holds, in every decoder layer:

- query heads ``[r * h/n, (r+1) * h/n)``: rows of ``q_proj`` (weight and bias; with Qwen3.5's
  output gate each head has ``2 * head_dim`` rows, its query then its gate), columns of
  ``o_proj`` (row-parallel: each rank's ``o_proj`` output is a partial sum, all-reduced);
- its key/value heads: with ``kv >= n`` heads, ``kv/n`` of them, ``[r * kv/n, (r+1) * kv/n)``;
  with fewer heads than ranks (``n % kv == 0``), the one head its query heads read,
  ``r // (n/kv)``, replicated on ``n/kv`` ranks. Rows of ``k_proj`` and ``v_proj``;
- MLP columns ``[r * I/n, (r+1) * I/n)``: rows of ``gate_proj`` and ``up_proj``, columns of
  ``down_proj`` (row-parallel, all-reduced);
- in a linear-attention layer (Gated DeltaNet, Qwen3.5), key heads ``[r * Hk/n, (r+1) * Hk/n)``
  and the value heads they serve (``Hv/Hk`` consecutive ones each, so ``[r * Hv/n,
  (r+1) * Hv/n)``): its query, key and value channels of ``in_proj_qkv`` and of the conv
  (three spans of the checkpoint's rows, concatenated in that order), its value channels of
  ``in_proj_z`` and of ``out_proj``'s columns (row-parallel, all-reduced), its value heads of
  ``in_proj_b``, ``in_proj_a``, ``dt_bias`` and ``A_log``. The gated norm's weight is per
  channel of a head, whole on every rank.

The other norms are whole on every rank too. The embedding, the LM head and the vision tower are
on rank 0 only: it embeds (images included) and samples, and the other ranks get the embeddings
from it. A rank's KV pool holds its key/value heads only, its state pool its linear-attention
heads only (:attr:`TextShard.linear_here`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import LinearAttentionConfig, TextConfig
from engine.errors import ConfigError

_LAYER_PREFIX = "model.layers."
_RANK_0_ONLY = ("model.embed_tokens.", "lm_head.", "visual.")
# name inside a decoder layer -> (dim split, which partition)
_SPLITS = {
    "self_attn.q_proj.weight": (0, "q_proj"),
    "self_attn.q_proj.bias": (0, "q_proj"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"),
    "mlp.up_proj.weight": (0, "mlp"),
    "mlp.down_proj.weight": (1, "mlp"),
    "linear_attn.in_proj_qkv.weight": (0, "linear_qkv"),
    "linear_attn.conv1d.weight": (0, "linear_qkv"),
    "linear_attn.in_proj_z.weight": (0, "linear_v"),
    "linear_attn.out_proj.weight": (1, "linear_v"),
    "linear_attn.in_proj_b.weight": (0, "linear_heads"),
    "linear_attn.in_proj_a.weight": (0, "linear_heads"),
    "linear_attn.dt_bias": (0, "linear_heads"),
    "linear_attn.A_log": (0, "linear_heads"),
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
    if cfg.linear is not None and cfg.linear.num_k_heads % size:
        raise ConfigError(f"tp size {size} must divide linear_num_key_heads "
                          f"({cfg.linear.num_k_heads}): the linear-attention layers split by "
                          "key head")


@dataclass(frozen=True)
class TensorPart:
    """A rank's part of a checkpoint tensor: the ranges ``spans`` (``[start, stop)`` each) of
    dimension ``dim``, concatenated in order."""

    dim: int
    spans: tuple[tuple[int, int], ...]


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
    q_rows_per_head: int  # rows of q_proj per query head: head_dim, twice that with a gate
    linear: LinearAttentionConfig | None = None  # the whole linear-attention layer's shape

    @classmethod
    def of(cls, cfg: TextConfig, rank: int = 0, size: int = 1) -> TextShard:
        check_tp_size(cfg, size)
        kv = cfg.num_key_value_heads
        kv_here = kv // size if kv >= size else 1
        kv_start = rank * kv_here if kv >= size else rank // (size // kv)
        q_rows = cfg.head_dim * (2 if cfg.attn_output_gate else 1)
        return cls(rank, size, cfg.head_dim, cfg.num_attention_heads // size, kv_here, kv_start,
                   cfg.intermediate_size // size, q_rows, cfg.linear)

    @property
    def linear_here(self) -> LinearAttentionConfig | None:
        """This rank's share of a linear-attention layer (its key heads and their value heads;
        the shape its layers and its state pool are built with), None without such layers."""
        lin = self.linear
        if lin is None:
            return None
        return replace(lin, num_k_heads=lin.num_k_heads // self.size,
                       num_v_heads=lin.num_v_heads // self.size)

    def spans(self, part: str) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` ranges of this rank's rows (or columns) of partition ``part``."""
        if part in ("q", "q_proj"):
            n = self.num_heads * (self.head_dim if part == "q" else self.q_rows_per_head)
            return ((self.rank * n, (self.rank + 1) * n),)
        if part == "kv":
            return ((self.kv_head_start * self.head_dim,
                     (self.kv_head_start + self.num_kv_heads) * self.head_dim),)
        if part == "mlp":
            n = self.intermediate_size
            return ((self.rank * n, (self.rank + 1) * n),)
        return self._linear_spans(part)

    def _linear_spans(self, part: str) -> tuple[tuple[int, int], ...]:
        whole, here = self.linear, self.linear_here
        assert whole is not None and here is not None, f"{part}: a model without linear layers"
        k, dk, v, dv = here.num_k_heads, here.head_k_dim, here.num_v_heads, here.head_v_dim
        k0, v0 = self.rank * k * dk, self.rank * v * dv  # this rank's first key/value channel
        if part == "linear_v":
            return ((v0, v0 + v * dv),)
        if part == "linear_heads":
            return ((self.rank * v, (self.rank + 1) * v),)
        key_dim = whole.num_k_heads * dk  # q channels, then k channels, then v channels
        return ((k0, k0 + k * dk), (key_dim + k0, key_dim + k0 + k * dk),
                (2 * key_dim + v0, 2 * key_dim + v0 + v * dv))

    def holds(self, name: str) -> bool:
        """Whether this rank holds checkpoint tensor ``name`` (a canonical name) at all."""
        return self.rank == 0 or not name.startswith(_RANK_0_ONLY)

    def part_of(self, name: str) -> TensorPart | None:
        """This rank's part of checkpoint tensor ``name`` (a canonical name), or None when every
        rank holds it whole."""
        if not name.startswith(_LAYER_PREFIX):
            return None
        return self.layer_part(name[len(_LAYER_PREFIX) :].partition(".")[2])

    def layer_part(self, inside: str) -> TensorPart | None:
        """:meth:`part_of` of tensor ``inside`` a decoder layer (``self_attn.q_proj.weight``)."""
        if self.size == 1:
            return None
        split = _SPLITS.get(inside)
        if split is None:
            return None
        dim, part = split
        return TensorPart(dim, self.spans(part))

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """:meth:`part_of` of a tensor split in one span, as ``(dim, start, stop)``."""
        if not name.startswith(_LAYER_PREFIX):
            return None
        return self.layer_slice(name[len(_LAYER_PREFIX) :].partition(".")[2])

    def layer_slice(self, inside: str) -> tuple[int, int, int] | None:
        """:meth:`layer_part` of a tensor split in one span, as ``(dim, start, stop)`` (an
        EAGLE draft's layer, all of whose tensors are). Raises ``ValueError`` for a tensor split
        in several spans (a linear-attention layer's ``in_proj_qkv``)."""
        part = self.layer_part(inside)
        if part is None:
            return None
        if len(part.spans) != 1:
            raise ValueError(f"{inside} is split in {len(part.spans)} spans: read its layer_part")
        return (part.dim, *part.spans[0])
