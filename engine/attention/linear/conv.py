"""The causal depthwise conv of a linear-attention layer, over a flat varlen batch (torch).

Each channel ``c`` of a sequence's inputs ``x`` is convolved with its own ``K`` taps: the output
at token ``t`` is ``act(bias[c] + sum_j weight[c, j] * w[t + j])`` over the window ``w`` = the
sequence's previous ``K - 1`` inputs (its slot's conv state) followed by ``x``. A fresh slot is
zeros, which is the zero left padding of a prompt run in one piece, so a prompt run in chunks
gives the same outputs. The conv runs in the weight's dtype, as transformers' Qwen3.5 does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.attention.linear.varlen import split_varlen

ACTIVATIONS = ("silu", None)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    q_starts: Sequence[int],
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The conv of every sequence of the batch; ``[T, C]`` in ``x``'s dtype.

    ``x`` ``[T, C]`` holds the forward's channels, sequence ``b`` rows
    ``q_starts[b]:q_starts[b + 1]`` (host offsets); ``weight`` is ``[C, K]``, ``bias`` ``[C]``
    or None; ``conv_state`` ``[num_slots, C, K - 1]`` is the pool's tensor for this layer and
    ``slots`` ``[B]`` int64 the sequences' (distinct) slots. After the call slot ``slots[b]``
    holds the last ``K - 1`` inputs of its sequence, counting earlier chunks (so a sequence
    shorter than ``K - 1`` keeps part of the old state); no other slot changes. One-token
    sequences run as one batched step; longer ones one at a time.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    split = split_varlen(q_starts, slots, x.shape[0])
    out = torch.empty_like(x)
    if split.num_single:
        state = conv_state.index_select(0, split.single_slots)  # [S, C, K - 1]
        rows = x.index_select(0, split.single_rows).to(state.dtype)
        window = torch.cat([state, rows.unsqueeze(-1)], dim=-1)  # [S, C, K]
        conv_state.index_copy_(0, split.single_slots, window[:, :, 1:])
        y = _conv(window, weight, bias, activation)[:, :, 0]
        out.index_copy_(0, split.single_rows, y.to(x.dtype))
    for j, (start, end) in enumerate(split.spans):
        slot = split.span_slots[j : j + 1]
        state = conv_state.index_select(0, slot)  # [1, C, K - 1]
        window = torch.cat([state, x[start:end].T.unsqueeze(0).to(state.dtype)], dim=-1)
        conv_state.index_copy_(0, slot, window[:, :, end - start :])
        out[start:end] = _conv(window, weight, bias, activation)[0].T.to(x.dtype)
    return out


def _conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          activation: str | None) -> torch.Tensor:
    """The valid depthwise conv of ``window`` ``[N, C, L]``: ``[N, C, L - K + 1]``, in the
    weight's dtype, activated."""
    y = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_window(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv of ``B`` sequences of ``n`` rows each (a speculative verify window), leaving
    the pool untouched: ``x`` ``[B * n, C]`` (sequence ``b`` rows ``b * n .. b * n + n - 1``),
    its state read from slot ``slots[b]`` of ``conv_state`` ``[num_slots, C, K - 1]``.

    Returns the outputs ``[B * n, C]`` in ``x``'s dtype and each sequence's input window
    ``[B, C, K - 1 + n]`` in the state's dtype (its old state, then its rows): the conv state
    after the sequence's first ``a`` rows is ``window[:, :, a : a + K - 1]``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    b, c = slots.shape[0], x.shape[1]
    state = conv_state.index_select(0, slots)  # [B, C, K - 1]
    rows = x.view(b, n, c).transpose(1, 2).to(state.dtype)  # [B, C, n]
    window = torch.cat([state, rows], dim=-1)  # [B, C, K - 1 + n]
    y = _conv(window, weight, bias, activation)  # [B, C, n]
    return y.transpose(1, 2).reshape(b * n, c).to(x.dtype), window
