"""Sorting one flat varlen batch into one-token rows and longer sequences.

A forward's tokens are concatenated: sequence ``b`` owns rows ``q_starts[b]:q_starts[b + 1]``
and the state slot ``slots[b]``. The linear-attention kernels step every one-token sequence (a
decode row, or a one-token prefill chunk) together in one vectorised step and run each longer
sequence on its own, so their Python work grows with the number of sequences, never with the
number of tokens. A sequence with no tokens is left out: its state is not touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VarlenSplit:
    """The sequences of one batch, by kind; index tensors live on the slots' device.

    ``single_rows[i]`` is the row of the ``i``-th one-token sequence and ``single_slots[i]`` its
    slot; ``spans[j]`` is ``(start, end)`` of the ``j``-th sequence of two or more tokens and
    ``span_slots[j]`` its slot. Both keep batch order.
    """

    single_rows: torch.Tensor  # [S] int64
    single_slots: torch.Tensor  # [S] int64
    spans: tuple[tuple[int, int], ...]
    span_slots: torch.Tensor  # [M] int64

    @property
    def num_single(self) -> int:
        return len(self.single_rows)


def split_varlen(q_starts: Sequence[int], slots: torch.Tensor, num_tokens: int) -> VarlenSplit:
    """Sort the batch given by ``q_starts`` (host offsets, ``B + 1`` of them, from 0 to
    ``num_tokens``, non-decreasing) and ``slots`` (``[B]`` int64) into a :class:`VarlenSplit`.

    Raises ``ValueError`` on offsets that do not describe ``num_tokens`` rows or whose count does
    not match the slots. The slots must be distinct (each running request owns one); that is the
    caller's invariant, not checked here (it would read the device).
    """
    if slots.dim() != 1 or len(q_starts) != slots.shape[0] + 1:
        raise ValueError(f"{len(q_starts)} offsets for slots of shape {tuple(slots.shape)}: "
                         "want one more offset than sequences")
    if q_starts[0] != 0 or q_starts[-1] != num_tokens:
        raise ValueError(f"offsets run from {q_starts[0]} to {q_starts[-1]}, "
                         f"not from 0 to {num_tokens}")
    single: list[int] = []
    multi: list[int] = []
    for b in range(len(q_starts) - 1):
        n = q_starts[b + 1] - q_starts[b]
        if n < 0:
            raise ValueError(f"offsets decrease at sequence {b}: {q_starts[b]} > {q_starts[b + 1]}")
        if n == 1:
            single.append(b)
        elif n > 1:
            multi.append(b)

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=slots.device)

    return VarlenSplit(
        single_rows=index([q_starts[b] for b in single]),
        single_slots=slots.index_select(0, index(single)),
        spans=tuple((q_starts[b], q_starts[b + 1]) for b in multi),
        span_slots=slots.index_select(0, index(multi)),
    )


def span_rows(spans: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The rows of ``spans`` concatenated in order: ``[sum of lengths]`` int64."""
    return torch.cat([torch.arange(start, end, device=device) for start, end in spans])
