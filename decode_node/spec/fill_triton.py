"""Triton twin of the draft-extend / verify buffer fill: one program per padded request row.

Semantics are those of :func:`decode_node.spec.fill_native.fill_draft_extend_prepare_buffers_native`
bit for bit (a property test compares the two). Program ``i`` (``0 <= i < bs``) writes request
row ``i`` of every per-request buffer and token rows ``i*N .. i*N+N-1`` of every per-token buffer,
so nothing at or beyond ``bs`` / ``bs*N`` is touched and no two programs write the same element.

The kernel runs on CUDA; on CPU tensors only under ``TRITON_INTERPRET=1`` (the tests do so). The
interpreter is chosen when the kernel is built, so the kernel is built lazily, once per mode,
from the value of ``TRITON_INTERPRET`` at call time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from decode_node.spec.graph_buffers import SpecGraphBuffers, check_fill_args
from engine.attention.kernels.configs import fill_tile  # tile sizes, checked by tests/gpu_readiness


def _fill_rows(  # type: ignore[no-untyped-def]  # a Triton kernel: no Python annotations
    # buffers
    input_ids,  # [max_bs*N] int64
    positions,  # [max_bs*N] int64
    mrope_positions,  # [3, max_bs*N] int64, row stride mrope_stride
    out_cache_loc,  # [max_bs*N] int64
    hidden_states,  # [max_bs*N, hidden_size]
    seq_lens,  # [max_bs] int64, and below
    req_indices,
    num_correct_drafts,
    num_accept_tokens,
    select_index,
    temperatures,  # [max_bs] float32
    mrope_deltas,
    # sources (contiguous)
    src_input_ids,  # [raw_bs*N]
    src_positions,
    src_out_cache_loc,
    src_hidden_states,  # [raw_bs*N, hidden_size]
    src_seq_lens,  # [raw_bs]
    src_req_indices,
    src_num_correct_drafts,
    src_num_accept_tokens,
    src_temperatures,
    src_mrope_deltas,
    # scalars
    raw_bs,
    num_front_tokens,
    seq_len_fill_value,
    pad_slot,
    hidden_size,
    mrope_stride,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    real = i < raw_bs

    # per-request fields: source on real rows, fill value on padded rows
    seq = tl.load(src_seq_lens + i, mask=real, other=0)
    seq = tl.where(real, seq, seq_len_fill_value)
    tl.store(seq_lens + i, seq)
    req = tl.load(src_req_indices + i, mask=real, other=0)
    tl.store(req_indices + i, req)
    ncd = tl.load(src_num_correct_drafts + i, mask=real, other=0)
    tl.store(num_correct_drafts + i, ncd)
    nat = tl.load(src_num_accept_tokens + i, mask=real, other=-1)
    tl.store(num_accept_tokens + i, nat)
    temp = tl.load(src_temperatures + i, mask=real, other=1.0)
    tl.store(temperatures + i, temp)
    delta = tl.load(src_mrope_deltas + i, mask=real, other=0)
    tl.store(mrope_deltas + i, delta)
    tl.store(select_index + i, i * N + num_front_tokens + ncd)

    # per-token fields of this request's N rows
    j = tl.arange(0, BLOCK_N)
    in_row = j < N
    t = i * N + j  # [BLOCK_N] int64
    src_mask = t < raw_bs * N  # this row is real (implies in_row)
    tl.store(input_ids + t, tl.load(src_input_ids + t, mask=src_mask, other=0), mask=in_row)
    pos = tl.load(src_positions + t, mask=src_mask, other=0)
    tl.store(positions + t, pos, mask=in_row)
    loc = tl.load(src_out_cache_loc + t, mask=src_mask, other=0)
    loc = tl.where(real, loc, pad_slot)
    tl.store(out_cache_loc + t, loc, mask=in_row)
    # mrope from the positions just written, refreshed on every fill
    mrope = pos + delta
    tl.store(mrope_positions + t, mrope, mask=in_row)
    tl.store(mrope_positions + mrope_stride + t, mrope, mask=in_row)
    tl.store(mrope_positions + 2 * mrope_stride + t, mrope, mask=in_row)

    for h0 in range(0, hidden_size, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        m = in_row[:, None] & (cols < hidden_size)[None, :]
        offs = t[:, None] * hidden_size + cols[None, :]  # [BLOCK_N, BLOCK_H]
        val = tl.load(src_hidden_states + offs, mask=m & src_mask[:, None], other=0.0)
        tl.store(hidden_states + offs, val, mask=m)


_SCALARS = [
    "raw_bs", "num_front_tokens", "seq_len_fill_value", "pad_slot", "hidden_size", "mrope_stride"
]


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel; ``triton.jit`` picks the interpreter from ``TRITON_INTERPRET`` now."""
    del interpret  # cache key only: one kernel per mode
    # scalars equal to 1 would otherwise be specialized into constants (one compile per value)
    return triton.jit(_fill_rows, do_not_specialize=_SCALARS)


def fill_draft_extend_prepare_buffers_triton(
    bufs: SpecGraphBuffers,
    *,
    src_input_ids: torch.Tensor,  # [raw_bs*N] int64
    src_positions: torch.Tensor,  # [raw_bs*N] int64
    src_out_cache_loc: torch.Tensor,  # [raw_bs*N] int64
    src_hidden_states: torch.Tensor,  # [raw_bs*N, hidden]
    src_seq_lens: torch.Tensor,  # [raw_bs] int64
    src_req_indices: torch.Tensor,  # [raw_bs] int64
    src_num_correct_drafts: torch.Tensor,  # [raw_bs] int64
    src_num_accept_tokens: torch.Tensor,  # [raw_bs] int64
    src_temperatures: torch.Tensor,  # [raw_bs] float32
    src_mrope_deltas: torch.Tensor,  # [raw_bs] int64
    raw_bs: int,
    bs: int,
    num_tokens_per_bs: int,
    num_front_tokens: int,
    seq_len_fill_value: int,
    pad_slot: int = 0,
) -> None:
    """Fill the static buffers for ``raw_bs`` real requests padded to ``bs``, in one launch.

    Same arguments, checks and semantics as
    :func:`~decode_node.spec.fill_native.fill_draft_extend_prepare_buffers_native` (see its
    docstring for the exact contract), including padded rows and the mrope buffer. Needs CUDA
    tensors, or ``TRITON_INTERPRET=1`` for CPU tensors.
    """
    srcs = {
        "src_input_ids": src_input_ids,
        "src_positions": src_positions,
        "src_out_cache_loc": src_out_cache_loc,
        "src_hidden_states": src_hidden_states,
        "src_seq_lens": src_seq_lens,
        "src_req_indices": src_req_indices,
        "src_num_correct_drafts": src_num_correct_drafts,
        "src_num_accept_tokens": src_num_accept_tokens,
        "src_temperatures": src_temperatures,
        "src_mrope_deltas": src_mrope_deltas,
    }
    check_fill_args(
        bufs,
        **srcs,
        raw_bs=raw_bs,
        bs=bs,
        num_tokens_per_bs=num_tokens_per_bs,
        num_front_tokens=num_front_tokens,
    )
    interpret = bool(triton.knobs.runtime.interpret)
    if bufs.device.type == "cpu" and not interpret:
        raise RuntimeError(
            "the Triton buffer fill needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; "
            "use fill_draft_extend_prepare_buffers_native on CPU"
        )
    s = {k: v.contiguous() for k, v in srcs.items()}
    n = num_tokens_per_bs
    block_n, block_h, num_warps = fill_tile(n, bufs.hidden_size)
    _kernel(interpret)[(bs,)](
        bufs.input_ids,
        bufs.positions,
        bufs.mrope_positions,
        bufs.out_cache_loc,
        bufs.hidden_states,
        bufs.seq_lens,
        bufs.req_indices,
        bufs.num_correct_drafts,
        bufs.num_accept_tokens,
        bufs.select_index,
        bufs.temperatures,
        bufs.mrope_deltas,
        s["src_input_ids"],
        s["src_positions"],
        s["src_out_cache_loc"],
        s["src_hidden_states"],
        s["src_seq_lens"],
        s["src_req_indices"],
        s["src_num_correct_drafts"],
        s["src_num_accept_tokens"],
        s["src_temperatures"],
        s["src_mrope_deltas"],
        raw_bs,
        num_front_tokens,
        seq_len_fill_value,
        pad_slot,
        bufs.hidden_size,
        bufs.mrope_positions.stride(0),
        N=n,
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )
