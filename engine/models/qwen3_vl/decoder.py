"""The Qwen3 decoders' attention layer (shared by Qwen3-VL and Qwen3.5's full-attention layers)
and Qwen3-VL's decoder layer.

Against Qwen2-VL's: no q/k/v biases (unless ``attention_bias``), an RMSNorm over each query and
key head before the rotation, an explicit head width. Qwen3.5 adds an output gate (``q_proj``
makes, per head, the query and a gate; the attention output is multiplied by ``sigmoid(gate)``
before ``o_proj``), zero-centred norms and a partial rotation (``RotaryTables`` turns the
leading ``rotary_dim`` channels).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import TextConfig
from engine.models.layers import RMSNorm, RotaryTables, make_norm
from engine.models.linear import PreparedLinear, empty_like_weight, prepare_linears
from engine.models.qwen2_vl.model import Mlp
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard


class Qwen3Attention(nn.Module):
    """Self-attention over this rank's heads with q/k norms (and, with
    ``cfg.attn_output_gate``, the output gate); q/k/v column-parallel, ``o_proj`` row-parallel
    and all-reduced over ``tp``."""

    def __init__(self, cfg: TextConfig, shard: TextShard, tp: TPGroup) -> None:
        super().__init__()
        d, h, kv = cfg.head_dim, shard.num_heads, shard.num_kv_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, h, kv
        self.gated = cfg.attn_output_gate
        bias = cfg.attention_bias
        q_width = h * d * (2 if self.gated else 1)
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=bias)
        self.q_norm = make_norm(d, cfg.rms_norm_eps, offset=cfg.zero_centered_norm)
        self.k_norm = make_norm(d, cfg.rms_norm_eps, offset=cfg.zero_centered_norm)
        self.tp = tp
        self.qkv: PreparedLinear | None = None  # set by fuse()
        self.o: PreparedLinear | None = None
        self.o_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """Prepare q/k/v as one linear and ``o_proj`` without its bias
        (:func:`~engine.models.linear.prepare_linears`); a second call keeps the first."""
        if self.qkv is not None:
            return
        self.qkv, = prepare_linears(((self.q_proj, self.k_proj, self.v_proj),))
        # row-parallel: the bias is added once, by rank 0, to the all-reduced sum
        if self.o_proj.bias is not None and self.tp.rank == 0:
            self.o_bias = self.o_proj.bias.detach()
        self.o = PreparedLinear(self.o_proj.weight)
        if self.o.packed:
            self.o_proj.weight = empty_like_weight(self.o_proj.weight)

    def forward(
        self, x: torch.Tensor, rot: RotaryTables, attn: AttentionBackend, layer: int
    ) -> torch.Tensor:
        assert self.qkv is not None and self.o is not None, "fuse() the model first"
        t, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        q_width = h * d * (2 if self.gated else 1)
        gate: torch.Tensor | None = None
        if self.gated:
            qg = qkv[:, :q_width].view(t, h, 2 * d)
            q, gate = qg[..., :d], qg[..., d:].reshape(t, h * d)
        else:
            q = qkv[:, :q_width].view(t, h, d)
        k = qkv[:, q_width : q_width + kv * d].view(t, kv, d)
        v = qkv[:, q_width + kv * d :].view(t, kv, d)
        q = rot.apply(self.q_norm.forward(q))
        k = rot.apply(self.k_norm.forward(k))
        out = attn.forward(q, k, v, layer).reshape(t, h * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = self.tp.all_reduce(self.o(out))
        return out if self.o_bias is None else out + self.o_bias


class Qwen3DecoderLayer(nn.Module):
    """Qwen3-VL's decoder layer: norm, :class:`Qwen3Attention`, norm, gated MLP."""

    def __init__(self, cfg: TextConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        shard = TextShard.of(cfg, tp.rank, tp.size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg, shard, tp)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(
        self, x: torch.Tensor, rot: RotaryTables, attn: AttentionBackend, layer: int
    ) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rot, attn, layer)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))
