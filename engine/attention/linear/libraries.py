"""The CUDA libraries' linear-attention kernels behind the torch reference's interface.

They follow the libraries' source (flash-linear-attention 0.4 to 0.6, causal-conv1d 1.4 to
1.6); their plumbing (rows, slots, state layouts, keywords) is tested on stand-ins that do what
the libraries document. On a GPU: :class:`FlaGatedDeltaRule` over fla 0.6.0 matched the torch
reference on an H200 (2026-12-04, ``scripts/device_check.py`` section ``f_hybrid``: a mixed
batch of continued prefill chunks, decode rows and a fresh prompt, bf16 and float32, outputs
and states), and Qwen3.5 through the engine with it equalled transformers. UNTESTED ON A GPU:
:class:`LibraryCausalConv1d` (causal-conv1d was not built there). Each adapter is
handed the library's module by ``select``, the only place the libraries are imported.

- :class:`FlaGatedDeltaRule` (``fla.ops.gated_delta_rule``): one-token sequences through
  ``fused_recurrent_gated_delta_rule`` as a batch of ``S`` sequences of one token, longer ones
  through ``chunk_gated_delta_rule`` as one varlen sequence (``cu_seqlens``), each from its slot's
  state. fla's state is ``[N, Hv, Dk, Dv]`` float32 (the default ``state_v_first=False``), the
  pool's layout, so no transpose. Releases before 0.5 take no fewer key than value heads in the
  chunked kernel, so key heads are repeated here for every release. Arguments go by keyword:
  ``fused_recurrent_gated_delta_rule`` has ``gk`` and ``gv`` between ``g`` and ``beta``.
- :class:`LibraryCausalConv1d` (``causal_conv1d``): one-token rows through
  ``causal_conv1d_update`` with ``conv_state_indices`` (it updates the pool's slots in place),
  longer sequences through ``causal_conv1d_fn`` in its channel-last layout with
  ``initial_states`` and ``final_states_out``. The library takes kernels of 2 to 4 taps,
  channels in multiples of 8 and inputs in the state's dtype; any other call runs the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from types import ModuleType

import torch

from engine.attention.linear import conv
from engine.attention.linear.varlen import span_rows, split_varlen


class FlaGatedDeltaRule:
    """``gated_delta_rule`` (see ``delta_rule``) on flash-linear-attention's Triton kernels."""

    def __init__(self, ops: ModuleType) -> None:
        self._chunk = ops.chunk_gated_delta_rule
        self._recurrent = ops.fused_recurrent_gated_delta_rule

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, q_starts: Sequence[int], state: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        split = split_varlen(q_starts, slots, v.shape[0])
        group = v.shape[1] // k.shape[1]
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        out = torch.empty_like(v)
        common = {"scale": q.shape[-1] ** -0.5, "output_final_state": True,
                  "use_qk_l2norm_in_kernel": True}
        if split.num_single:
            rows, slot = split.single_rows, split.single_slots
            q1, k1, v1, g1, b1 = (t.index_select(0, rows).unsqueeze(1)  # [S, 1, H, ...]
                                  for t in (q, k, v, g, beta))
            o, s = self._recurrent(q=q1, k=k1, v=v1, g=g1, beta=b1,
                                   initial_state=state.index_select(0, slot), **common)
            state.index_copy_(0, slot, s.to(state.dtype))
            out.index_copy_(0, rows, o[:, 0].to(v.dtype))
        if split.spans:
            rows = span_rows(split.spans, v.device)
            offsets = accumulate((end - start for start, end in split.spans), initial=0)
            cu_seqlens = torch.tensor(list(offsets), dtype=torch.int64, device=v.device)
            qs, ks, vs, gs, bs = (t.index_select(0, rows).unsqueeze(0)  # [1, R, H, ...]
                                  for t in (q, k, v, g, beta))
            o, s = self._chunk(q=qs, k=ks, v=vs, g=gs, beta=bs,
                               initial_state=state.index_select(0, split.span_slots),
                               cu_seqlens=cu_seqlens, **common)
            state.index_copy_(0, split.span_slots, s.to(state.dtype))
            out.index_copy_(0, rows, o[0].to(v.dtype))
        return out


class LibraryCausalConv1d:
    """``causal_conv1d`` (see ``conv``) on the causal-conv1d library's CUDA kernels."""

    def __init__(self, lib: ModuleType) -> None:
        self._fn = lib.causal_conv1d_fn
        self._update = lib.causal_conv1d_update

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 q_starts: Sequence[int], conv_state: torch.Tensor, slots: torch.Tensor,
                 activation: str | None = "silu") -> torch.Tensor:
        if not (2 <= weight.shape[1] <= 4 and x.shape[1] % 8 == 0
                and x.dtype == conv_state.dtype and activation in conv.ACTIVATIONS):
            return conv.causal_conv1d(x, weight, bias, q_starts, conv_state, slots, activation)
        split = split_varlen(q_starts, slots, x.shape[0])
        out = torch.empty_like(x)
        if split.num_single:
            rows = split.single_rows
            y = self._update(x.index_select(0, rows), conv_state, weight, bias, activation,
                             conv_state_indices=split.single_slots.to(torch.int32))
            out.index_copy_(0, rows, y)
        for j, (start, end) in enumerate(split.spans):
            slot = split.span_slots[j : j + 1]
            # [1, C, K - 1] with channels innermost, the layout the library's states need
            initial = conv_state.index_select(0, slot).transpose(1, 2).contiguous().transpose(1, 2)
            final = torch.empty_like(initial)  # keeps initial's strides
            y, _ = self._fn(x[start:end].T.unsqueeze(0), weight, bias, initial_states=initial,
                            return_final_states=True, final_states_out=final,
                            activation=activation)
            conv_state.index_copy_(0, slot, final)
            out[start:end] = y[0].T
        return out
