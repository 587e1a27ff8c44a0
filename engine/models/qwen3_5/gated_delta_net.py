"""Qwen3.5's linear-attention layer (Gated DeltaNet) over flat token batches.

Per token: projections to the mixed q/k/v channels, a gate ``z`` (one per value channel), and
per value head ``b`` (``beta = sigmoid(b)``, the write strength) and ``a`` (the log decay
``g = -exp(A_log) * softplus(a + dt_bias)``); a causal depthwise conv (silu) over the mixed
channels; the gated delta rule over the conv's q, k, v; a gated RMSNorm per value head
(``norm(out) * silu(z)``) and ``out_proj``. The per-request context is fixed-size and lives in
the state pool (:class:`engine.attention.linear.states.LinearStates`): the conv's last
``kernel - 1`` inputs and the recurrent state. Parameter names follow the Hugging Face layout
(``linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``,
``dt_bias``, ``A_log``, ``norm``, ``out_proj``).

Under tensor parallelism a rank holds its key heads and their value heads
(:attr:`engine.parallel.shard.TextShard.linear_here`): the projections and the conv are
column-parallel (channels are independent up to the delta rule, which never mixes heads),
``out_proj`` row-parallel, its partial sums all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.linear.norm import gated_rms_norm
from engine.attention.linear.states import LinearStates
from engine.config import LinearAttentionConfig, TextConfig
from engine.models.linear import PreparedLinear, prepare_linears
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard


class GatedNormWeight(nn.Module):
    """The gated RMSNorm's weight (``linear_attn.norm.weight``, a plain scale: not zero-centred
    like the decoder's norms)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    """One linear-attention layer over this rank's heads (``shard``; every head in the group
    of one), ``out_proj``'s partial sums all-reduced over ``tp``."""

    def __init__(self, cfg: TextConfig, shard: TextShard, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        lin = shard.linear_here
        assert lin is not None, "a linear-attention layer needs TextConfig.linear"
        self.lin: LinearAttentionConfig = lin  # this rank's heads
        self.tp = tp
        hidden, hv = cfg.hidden_size, lin.num_v_heads
        self.key_dim = lin.num_k_heads * lin.head_k_dim
        self.value_dim = hv * lin.head_v_dim
        channels = lin.conv_channels
        self.in_proj_qkv = nn.Linear(hidden, channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, hv, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, lin.conv_kernel, groups=channels, bias=False,
                                padding=lin.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedNormWeight(lin.head_v_dim)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.eps = cfg.rms_norm_eps
        self.proj_in: PreparedLinear | None = None  # set by fuse()
        self.proj_out: PreparedLinear | None = None
        self.conv_weight = torch.empty(0)

    def fuse(self) -> None:
        """One prepared linear for the four input projections (rows: q/k/v, z, b, a), the
        prepared ``out_proj`` and the conv's weight as ``[C, K]``; a second call keeps the
        first."""
        if self.proj_in is not None:
            return
        self.proj_in, self.proj_out = prepare_linears((
            (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a),
            (self.out_proj,)))
        self.conv_weight = self.conv1d.weight.detach().squeeze(1)

    def forward(self, x: torch.Tensor, states: LinearStates, index: int) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``, reading and updating the states of pool
        layer ``index`` for the forward's rows."""
        lin, t = self.lin, x.shape[0]
        channels, hv = lin.conv_channels, lin.num_v_heads
        assert self.proj_in is not None and self.proj_out is not None, "fuse() first"
        mixed, z, b, a = self.proj_in(x).split(
            [channels, self.value_dim, hv, hv], dim=-1)
        mixed = states.conv(index, mixed, self.conv_weight, None)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, lin.num_k_heads, lin.head_k_dim)
        k = k.reshape(t, lin.num_k_heads, lin.head_k_dim)
        v = v.reshape(t, hv, lin.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = states.delta_rule(index, q, k, v, g, beta)  # [T, Hv, Dv]
        out = gated_rms_norm(out, z.reshape(t, hv, lin.head_v_dim), self.norm.weight, self.eps)
        return self.tp.all_reduce(self.proj_out(out.reshape(t, self.value_dim)))
