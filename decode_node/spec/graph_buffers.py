"""Persistent static buffers of the EAGLE verify and draft-extend forwards ("graph" buffers).

A captured forward (a CUDA graph on CUDA, the same eager forward elsewhere) reads its inputs from
fixed tensors allocated once for the largest captured batch. Before every replay the live batch of
``raw_bs`` requests is copied into the first rows and padded up to the captured size ``bs``
(:meth:`SpecGraphBuffers.padded_size`); see :mod:`decode_node.spec.fill` for the fill itself.

Layout: every request owns ``N = num_tokens_per_bs`` consecutive token rows, so request ``i``'s
tokens are rows ``i*N .. i*N+N-1`` of every per-token buffer. Per-request buffers have one entry
per request row. Buffers never change shape, dtype or device after allocation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

INT = torch.int64


@dataclass(frozen=True)
class SpecGraphBuffers:
    """Static buffers for up to ``max_bs`` requests of ``num_tokens_per_bs`` tokens each.

    Invariants: all tensors are contiguous and on ``device``; integer buffers are int64,
    ``temperatures`` is float32, ``hidden_states`` has ``hidden_dtype`` (float32 by default).
    """

    max_bs: int
    num_tokens_per_bs: int
    hidden_size: int
    device: torch.device
    input_ids: torch.Tensor  # [max_bs*N] int64
    positions: torch.Tensor  # [max_bs*N] int64, 1-D rope positions
    mrope_positions: torch.Tensor  # [3, max_bs*N] int64, positions + per-request delta
    out_cache_loc: torch.Tensor  # [max_bs*N] int64, KV slot of each token
    seq_lens: torch.Tensor  # [max_bs] int64
    req_indices: torch.Tensor  # [max_bs] int64
    num_correct_drafts: torch.Tensor  # [max_bs] int64 (accepted drafts, A - 1)
    num_accept_tokens: torch.Tensor  # [max_bs] int64 (A; -1 marks a padded row)
    select_index: torch.Tensor  # [max_bs] int64, token row of the last accepted token
    temperatures: torch.Tensor  # [max_bs] float32
    mrope_deltas: torch.Tensor  # [max_bs] int64
    hidden_states: torch.Tensor  # [max_bs*N, hidden_size] hidden_dtype

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        num_tokens_per_bs: int,
        hidden_size: int,
        device: torch.device | str = "cpu",
        hidden_dtype: torch.dtype = torch.float32,
    ) -> SpecGraphBuffers:
        """Allocate every buffer once, zero-filled."""
        if max_bs < 1 or num_tokens_per_bs < 1 or hidden_size < 1:
            raise ValueError(
                f"max_bs, num_tokens_per_bs and hidden_size must be >= 1, got "
                f"{max_bs}, {num_tokens_per_bs}, {hidden_size}"
            )
        t = max_bs * num_tokens_per_bs
        # the device the tensors really land on ("cuda" -> "cuda:0"), so device checks compare equal
        dev = torch.empty(0, device=device).device

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=INT, device=dev)

        return cls(
            max_bs=max_bs,
            num_tokens_per_bs=num_tokens_per_bs,
            hidden_size=hidden_size,
            device=dev,
            input_ids=ints(t),
            positions=ints(t),
            mrope_positions=ints(3, t),
            out_cache_loc=ints(t),
            seq_lens=ints(max_bs),
            req_indices=ints(max_bs),
            num_correct_drafts=ints(max_bs),
            num_accept_tokens=ints(max_bs),
            select_index=ints(max_bs),
            temperatures=torch.ones(max_bs, dtype=torch.float32, device=dev),
            mrope_deltas=ints(max_bs),
            hidden_states=torch.zeros(t, hidden_size, dtype=hidden_dtype, device=dev),
        )

    @property
    def max_num_tokens(self) -> int:
        return self.max_bs * self.num_tokens_per_bs

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by field name (for copies and comparisons)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def padded_size(self, bs: int, capture_sizes: Sequence[int]) -> int:
        """The smallest captured batch size ``>= bs`` (and ``<= max_bs``).

        Raises ``ValueError`` when ``bs < 1`` or no captured size fits.
        """
        if bs < 1:
            raise ValueError(f"batch size must be >= 1, got {bs}")
        sizes = sorted(s for s in capture_sizes if s <= self.max_bs)
        k = bisect.bisect_left(sizes, bs)
        if k == len(sizes):
            raise ValueError(
                f"no captured batch size >= {bs} among {sorted(capture_sizes)} "
                f"(max_bs {self.max_bs})"
            )
        return sizes[k]


def check_fill_args(
    bufs: SpecGraphBuffers,
    *,
    src_input_ids: torch.Tensor,
    src_positions: torch.Tensor,
    src_out_cache_loc: torch.Tensor,
    src_hidden_states: torch.Tensor,
    src_seq_lens: torch.Tensor,
    src_req_indices: torch.Tensor,
    src_num_correct_drafts: torch.Tensor,
    src_num_accept_tokens: torch.Tensor,
    src_temperatures: torch.Tensor,
    src_mrope_deltas: torch.Tensor,
    raw_bs: int,
    bs: int,
    num_tokens_per_bs: int,
    num_front_tokens: int,
) -> None:
    """Validate a fill's arguments; raise ``ValueError`` naming the first bad one.

    Checked: ``0 <= raw_bs <= bs <= max_bs`` and ``bs >= 1``; ``num_tokens_per_bs`` equals the
    buffers' width; ``0 <= num_front_tokens < num_tokens_per_bs``; every source has the shape
    ``[raw_bs*N]`` (``[raw_bs*N, hidden]`` for hidden states, ``[raw_bs]`` per request), the
    buffers' dtype and device. Values are not checked (that would sync the device): callers
    guarantee ``0 <= num_correct_drafts <= N - 1 - num_front_tokens`` on real rows.
    """
    n = bufs.num_tokens_per_bs
    if num_tokens_per_bs != n:
        raise ValueError(f"num_tokens_per_bs {num_tokens_per_bs} != the buffers' width {n}")
    if not 0 <= num_front_tokens < n:
        raise ValueError(f"num_front_tokens must be in [0, {n}), got {num_front_tokens}")
    if not (0 <= raw_bs <= bs <= bufs.max_bs and bs >= 1):
        raise ValueError(
            f"need 0 <= raw_bs <= bs <= max_bs and bs >= 1, got raw_bs={raw_bs}, bs={bs}, "
            f"max_bs={bufs.max_bs}"
        )
    tokens = raw_bs * n
    expect: dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype]] = {
        "src_input_ids": (src_input_ids, (tokens,), INT),
        "src_positions": (src_positions, (tokens,), INT),
        "src_out_cache_loc": (src_out_cache_loc, (tokens,), INT),
        "src_hidden_states": (
            src_hidden_states, (tokens, bufs.hidden_size), bufs.hidden_states.dtype
        ),
        "src_seq_lens": (src_seq_lens, (raw_bs,), INT),
        "src_req_indices": (src_req_indices, (raw_bs,), INT),
        "src_num_correct_drafts": (src_num_correct_drafts, (raw_bs,), INT),
        "src_num_accept_tokens": (src_num_accept_tokens, (raw_bs,), INT),
        "src_temperatures": (src_temperatures, (raw_bs,), torch.float32),
        "src_mrope_deltas": (src_mrope_deltas, (raw_bs,), INT),
    }
    for name, (t, shape, dtype) in expect.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
        if t.device != bufs.device:
            raise ValueError(f"{name} is on {t.device}, the buffers on {bufs.device}")
