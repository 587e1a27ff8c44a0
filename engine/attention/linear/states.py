"""One forward's view of the linear-attention state pool: which rows belong to which request's
state slot, and the kernels that read and update those states.

The runner calls :meth:`LinearStates.prepare` once per forward (after zeroing the slots of
requests whose computation starts at token 0); each linear-attention layer then calls
:meth:`conv` and :meth:`delta_rule` with its pool index. Both update the slots' states in
place, so after the forward every slot holds the state after its request's last row.
"""

from __future__ import annotations

import torch

from engine.attention.linear.select import LinearAttentionKernels, linear_kernels
from engine.kv.state_pool import StatePool


class LinearStates:
    """The state pool of one engine (or one tensor-parallel rank) and this forward's rows."""

    def __init__(self, pool: StatePool, kernels: LinearAttentionKernels | None = None) -> None:
        self.pool = pool
        self.kernels = kernels or linear_kernels(pool.device)
        self.q_starts: list[int] = [0]
        self.slots = torch.zeros(0, dtype=torch.int64, device=pool.device)

    def prepare(self, q_starts: list[int], slots: torch.Tensor) -> None:
        """This forward's sequences: sequence ``b`` owns rows ``q_starts[b]:q_starts[b + 1]``
        and state slot ``slots[b]`` (``[B]`` int64 on the pool's device)."""
        if len(q_starts) != slots.shape[0] + 1:
            raise ValueError(f"{len(q_starts) - 1} sequences but {slots.shape[0]} state slots")
        self.q_starts, self.slots = q_starts, slots

    def conv(self, index: int, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """The causal depthwise conv (silu) of pool layer ``index`` over ``x`` ``[T, C]``."""
        return self.kernels.conv(x, weight, bias, self.q_starts, self.pool.conv(index),
                                 self.slots)

    def delta_rule(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule of pool layer ``index`` (see
        :func:`engine.attention.linear.delta_rule.gated_delta_rule`)."""
        return self.kernels.delta_rule(q, k, v, g, beta, self.q_starts,
                                       self.pool.recurrent(index), self.slots)
