"""Native PyTorch twin of the draft-extend / verify buffer fill (CPU, NPU, and the reference).

The Triton twin (:mod:`decode_node.spec.fill_triton`) has identical semantics, bit for bit; the
dispatcher is :func:`decode_node.spec.fill.fill_draft_extend_prepare_buffers`.
"""

from __future__ import annotations

import torch

from decode_node.spec.graph_buffers import SpecGraphBuffers, check_fill_args
from engine.multimodal.mrope import mrope_from_1d


def fill_draft_extend_prepare_buffers_native(
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
    """Fill the static buffers for ``raw_bs`` real requests padded to ``bs`` (plain PyTorch).

    Let ``N = num_tokens_per_bs``, ``T = raw_bs*N`` (real tokens) and ``P = bs*N`` (padded tokens).
    Token rows ``t < T`` and request rows ``i < raw_bs`` are *real*; token rows ``T <= t < P`` and
    request rows ``raw_bs <= i < bs`` are *padding*. After the fill:

    * per token, ``t < T``: ``input_ids[t]``, ``positions[t]``, ``out_cache_loc[t]`` and
      ``hidden_states[t, :]`` equal the sources' row ``t``;
    * per token, ``T <= t < P``: ``input_ids[t] = 0``, ``positions[t] = 0``,
      ``out_cache_loc[t] = pad_slot``, ``hidden_states[t, :] = 0``;
    * per request (real value / padding value): ``seq_lens`` src / ``seq_len_fill_value``;
      ``req_indices`` src / 0; ``num_correct_drafts`` src / 0; ``num_accept_tokens`` src / -1;
      ``temperatures`` src / 1.0; ``mrope_deltas`` src / 0;
    * ``select_index[i] = i*N + num_front_tokens + num_correct_drafts[i]`` for every ``i < bs``
      (from the value just written, so a padded row selects its own first row + num_front_tokens);
    * ``mrope_positions[a, t] = positions[t] + mrope_deltas[t // N]`` for ``a in 0..2`` and every
      ``t < P``, computed from the positions and deltas just written: the mrope buffer is refreshed
      on every fill and is never a stale copy (padded rows get ``0 + 0 = 0``, never negative);
    * token rows ``t >= P`` and request rows ``i >= bs`` of every buffer are left untouched.

    The sources are not modified. Argument checks are :func:`check_fill_args` (``ValueError``).
    """
    check_fill_args(
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
    )
    n = num_tokens_per_bs
    real, padded = raw_bs * n, bs * n

    def token_field(buf: torch.Tensor, src: torch.Tensor, pad: float) -> None:
        buf[:real].copy_(src)
        buf[real:padded].fill_(pad)

    token_field(bufs.input_ids, src_input_ids, 0)
    token_field(bufs.positions, src_positions, 0)
    token_field(bufs.out_cache_loc, src_out_cache_loc, pad_slot)
    token_field(bufs.hidden_states, src_hidden_states, 0.0)

    def request_field(buf: torch.Tensor, src: torch.Tensor, pad: float) -> None:
        buf[:raw_bs].copy_(src)
        buf[raw_bs:bs].fill_(pad)

    request_field(bufs.seq_lens, src_seq_lens, seq_len_fill_value)
    request_field(bufs.req_indices, src_req_indices, 0)
    request_field(bufs.num_correct_drafts, src_num_correct_drafts, 0)
    request_field(bufs.num_accept_tokens, src_num_accept_tokens, -1)
    request_field(bufs.temperatures, src_temperatures, 1.0)
    request_field(bufs.mrope_deltas, src_mrope_deltas, 0)

    rows = torch.arange(bs, dtype=torch.int64, device=bufs.device)  # [bs]
    torch.add(rows * n + num_front_tokens, bufs.num_correct_drafts[:bs], out=bufs.select_index[:bs])
    # mrope from the final positions just written (never from an earlier copy): [3, P]
    deltas = bufs.mrope_deltas[:bs].repeat_interleave(n)  # [P]
    bufs.mrope_positions[:, :padded].copy_(mrope_from_1d(bufs.positions[:padded], deltas))

