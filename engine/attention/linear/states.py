"""One forward's view of the linear-attention state pool: which rows belong to which request's
state slot, and the kernels that read and update those states.

The runner calls :meth:`LinearStates.prepare` once per forward (after zeroing the slots of
requests whose computation starts at token 0); each linear-attention layer then calls
:meth:`conv` and :meth:`delta_rule` with its pool index. Both update the slots' states in
place, so after the forward every slot holds the state after its request's last row.

A speculative verify forward (:meth:`LinearStates.prepare_window`) instead runs ``n`` rows per
request (the bonus token and the drafts) and writes no slot: each layer keeps, beside the pool,
what it needs to rebuild the state after any prefix of the window (the torch kernels of
:func:`~engine.attention.linear.conv.causal_conv1d_window` and
:mod:`engine.attention.linear.delta_rule`, on every device). The conv keeps its input window;
the recurrent state is kept as ``verify_states`` says (:data:`engine.config.VERIFY_STATES`):

- ``"rows"`` (:data:`~engine.config.KEEP_ROWS`): the state after every row,
  ``[B, n, Hv, Dk, Dv]`` float32 per layer;
- ``"replay"`` (:data:`~engine.config.REPLAY`): the rows' inputs to the state update only
  (:class:`~engine.attention.linear.delta_rule.WindowInputs`, about ``(Dk + Dv) / (Dk * Dv)``
  of that), from which the kept state is stepped again.

Once the accepted count ``a`` of each request is known, :meth:`LinearStates.keep` writes the
state after its first ``a`` rows into its slot (in both modes the same bits), so a rejected
draft leaves no trace in the pool.
"""

from __future__ import annotations

import torch

from engine.attention.linear.conv import causal_conv1d_window
from engine.attention.linear.delta_rule import (
    WindowInputs,
    gated_delta_rule_window,
    gated_delta_rule_window_inputs,
    replay_window,
)
from engine.attention.linear.select import LinearAttentionKernels, linear_kernels
from engine.config import KEEP_ROWS, REPLAY, VERIFY_STATES, VerifyStates
from engine.kv.state_pool import StatePool


class LinearStates:
    """The state pool of one engine (or one tensor-parallel rank) and this forward's rows;
    ``verify_states`` (one of :data:`engine.config.VERIFY_STATES`): what a verify window keeps
    of the recurrent states until :meth:`keep` (module docstring)."""

    def __init__(self, pool: StatePool, kernels: LinearAttentionKernels | None = None,
                 verify_states: VerifyStates = KEEP_ROWS) -> None:
        if verify_states not in VERIFY_STATES:
            raise ValueError(f"verify_states must be one of {', '.join(VERIFY_STATES)}, got "
                             f"{verify_states!r}")
        self.pool = pool
        self.kernels = kernels or linear_kernels(pool.device)
        self.verify_states = verify_states
        self.q_starts: list[int] = [0]
        self.slots = torch.zeros(0, dtype=torch.int64, device=pool.device)
        self.window = 0  # rows per sequence of a verify window; 0: an ordinary forward
        # per pool layer, the window's states (filled by a window forward, used by keep()): conv
        # inputs [B, C, K - 1 + n], and the recurrent state after each row [B, n, Hv, Dk, Dv]
        # ("rows") or the rows' inputs to it ("replay")
        self._conv_windows: dict[int, torch.Tensor] = {}
        self._recurrent_rows: dict[int, torch.Tensor] = {}
        self._recurrent_inputs: dict[int, WindowInputs] = {}

    def prepare(self, q_starts: list[int], slots: torch.Tensor) -> None:
        """This forward's sequences: sequence ``b`` owns rows ``q_starts[b]:q_starts[b + 1]``
        and state slot ``slots[b]`` (``[B]`` int64 on the pool's device)."""
        if len(q_starts) != slots.shape[0] + 1:
            raise ValueError(f"{len(q_starts) - 1} sequences but {slots.shape[0]} state slots")
        self.q_starts, self.slots = q_starts, slots
        self._set_window(0)

    def prepare_window(self, slots: torch.Tensor, n: int) -> None:
        """A verify forward: sequence ``b`` owns rows ``b * n .. b * n + n - 1`` and reads slot
        ``slots[b]`` (``[B]`` int64 on the pool's device; padded sequences may read any slot),
        which stays as it is until :meth:`keep`."""
        if n < 1:
            raise ValueError(f"a verify window of {n} rows")
        self.q_starts = list(range(0, (slots.shape[0] + 1) * n, n))
        self.slots = slots
        self._set_window(n)

    def keep(self, accepted: torch.Tensor) -> None:
        """After a verify forward: slot ``slots[b]`` of each of the first ``R`` sequences takes
        its state after its first ``accepted[b]`` rows (``[R]`` int64 on the pool's device, each
        in ``1..n``), in every layer the forward ran; the window's states are dropped."""
        if not self.window:
            raise RuntimeError("keep() follows a verify forward (prepare_window)")
        r, taps = accepted.shape[0], self.pool.conv_kernel - 1
        slots, seqs = self.slots[:r], torch.arange(r, device=accepted.device)
        for index, window in self._conv_windows.items():
            cols = accepted[:, None, None] + torch.arange(taps, device=accepted.device)  # [R,1,K-1]
            kept = window[:r].gather(2, cols.expand(r, window.shape[1], taps))  # [R, C, K - 1]
            self.pool.conv(index).index_copy_(0, slots, kept)
        for index, rows in self._recurrent_rows.items():
            self.pool.recurrent(index).index_copy_(0, slots, rows[seqs, accepted - 1])
        for index, inputs in self._recurrent_inputs.items():
            replay_window(inputs, self.pool.recurrent(index), self.slots, accepted)
        self._set_window(0)

    def conv(self, index: int, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """The causal depthwise conv (silu) of pool layer ``index`` over ``x`` ``[T, C]``."""
        if self.window:
            out, window = causal_conv1d_window(x, weight, bias, self.window,
                                               self.pool.conv(index), self.slots)
            self._conv_windows[index] = window
            return out
        return self.kernels.conv(x, weight, bias, self.q_starts, self.pool.conv(index),
                                 self.slots)

    def delta_rule(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule of pool layer ``index`` (see
        :func:`engine.attention.linear.delta_rule.gated_delta_rule`)."""
        if self.window and self.verify_states == REPLAY:
            out, inputs = gated_delta_rule_window_inputs(q, k, v, g, beta, self.window,
                                                         self.pool.recurrent(index), self.slots)
            self._recurrent_inputs[index] = inputs
            return out
        if self.window:
            out, rows = gated_delta_rule_window(q, k, v, g, beta, self.window,
                                                self.pool.recurrent(index), self.slots)
            self._recurrent_rows[index] = rows
            return out
        return self.kernels.delta_rule(q, k, v, g, beta, self.q_starts,
                                       self.pool.recurrent(index), self.slots)

    def _set_window(self, n: int) -> None:
        self.window = n
        self._conv_windows.clear()
        self._recurrent_rows.clear()
        self._recurrent_inputs.clear()
