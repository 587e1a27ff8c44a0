"""Dispatch of the draft-extend / verify buffer fill by device.

Triton on CUDA (one launch, graph-replay friendly); native PyTorch on CPU and NPU (Ascend's
Triton "mega-kernels" are the crash our peers shipped, so NPU never takes the Triton path). Both
twins have the semantics documented on
:func:`~decode_node.spec.fill_native.fill_draft_extend_prepare_buffers_native`.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from decode_node.spec.fill_native import fill_draft_extend_prepare_buffers_native
from decode_node.spec.graph_buffers import SpecGraphBuffers

Backend = Literal["auto", "native", "triton"]


def select_backend(device: torch.device | str) -> Literal["native", "triton"]:
    """``"triton"`` on CUDA when Triton is installed, ``"native"`` everywhere else (CPU, NPU)."""
    # a string is parsed by hand: torch.device("npu") only parses once torch_npu is imported
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "native"


def fill_draft_extend_prepare_buffers(
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
    backend: Backend = "auto",
) -> Literal["native", "triton"]:
    """Fill ``bufs`` for ``raw_bs`` real requests padded to ``bs``; return the backend used.

    ``backend="auto"`` picks :func:`select_backend` of the buffers' device; ``"native"`` or
    ``"triton"`` force one twin (tests; Triton on CPU needs ``TRITON_INTERPRET=1``). The result is
    the same either way: see ``fill_draft_extend_prepare_buffers_native`` for the contract.
    """
    if backend not in ("auto", "native", "triton"):
        raise ValueError(f"backend must be 'auto', 'native' or 'triton', got {backend!r}")
    chosen = select_backend(bufs.device) if backend == "auto" else backend
    if chosen == "triton":
        # imported here so that CPU and NPU installs never need Triton
        from decode_node.spec.fill_triton import fill_draft_extend_prepare_buffers_triton as fill
    else:
        fill = fill_draft_extend_prepare_buffers_native
    fill(
        bufs,
        src_input_ids=src_input_ids,
        src_positions=src_positions,
        src_out_cache_loc=src_out_cache_loc,
        src_hidden_states=src_hidden_states,
        src_seq_lens=src_seq_lens,
        src_req_indices=src_req_indices,
        src_num_correct_drafts=src_num_correct_drafts,
        src_num_accept_tokens=src_num_accept_tokens,
        src_temperatures=src_temperatures,
        src_mrope_deltas=src_mrope_deltas,
        raw_bs=raw_bs,
        bs=bs,
        num_tokens_per_bs=num_tokens_per_bs,
        num_front_tokens=num_front_tokens,
        seq_len_fill_value=seq_len_fill_value,
        pad_slot=pad_slot,
    )
    return chosen
