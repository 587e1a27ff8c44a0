"""Static-shape verify and draft-extend forwards over :class:`SpecGraphBuffers`.

A round's live batch of ``raw_bs`` requests is copied into persistent buffers and padded to the
smallest captured batch size ``bs`` by :func:`fill_draft_extend_prepare_buffers` (Triton on CUDA,
native PyTorch elsewhere); the forward then reads *only* the buffers, so a captured graph would
replay it unchanged. The mrope buffer is refilled from the final positions on every fill, so a
replay never sees positions of an earlier round.

Padded rows: ``N`` tokens at position 0 whose K/V go to the engine's scratch page (never handed
to a request), attention over ``N`` keys of that page, outputs discarded. On CPU and NPU the
forward runs eagerly on the buffers (capturing CUDA graphs is for a CUDA device, not built yet),
which is what lets the padding logic be tested here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode_node.spec.fill import fill_draft_extend_prepare_buffers
from decode_node.spec.graph_buffers import SpecGraphBuffers
from engine.attention import AttentionBatch
from engine.draft_runner import DraftRunner
from engine.llm_engine import LLMEngine
from engine.request import Request

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class RoundInputs:
    """One round's per-request values, in batch order."""

    reqs: list[Request]
    starts: list[int]  # S per request
    deltas: torch.Tensor  # [B] mrope deltas


class SpecGraphRunner:
    def __init__(self, engine: LLMEngine, drafter: DraftRunner, k: int,
                 capture_sizes: Sequence[int] = CAPTURE_SIZES) -> None:
        n = k + 1
        page_size = engine.config.page_size
        if n > page_size:
            raise ValueError(f"num_draft_tokens + 1 = {n} must fit one page ({page_size} tokens)")
        self.engine, self.drafter, self.n = engine, drafter, n
        max_bs = engine.scheduler.config.max_num_seqs
        self.capture_sizes = sorted({*(s for s in capture_sizes if s < max_bs), max_bs})
        self.bufs = SpecGraphBuffers.allocate(max_bs, n, engine.model_config.text.hidden_size,
                                              hidden_dtype=engine.model.dtype)
        self.pad_slot = engine.scratch_page * page_size
        self.bs = 0  # padded size of the last fill

    def verify(self, rnd: RoundInputs, ids: torch.Tensor) -> torch.Tensor:
        """The target over ``ids`` ``[B*N]`` (``[b, d_1..d_K]`` per request) at ``S..S+K``;
        returns the real rows' hidden states ``[B*N, H]``."""
        self._fill(rnd, ids, torch.zeros(ids.shape[0], self.bufs.hidden_size,
                                         dtype=self.bufs.hidden_states.dtype), [0] * len(rnd.reqs))
        b, rows = self.bufs, self.bs * self.n
        embeds = self.engine.model.embed(b.input_ids[:rows])
        hidden = self.engine.runner.forward_embeds(embeds, b.mrope_positions[:, :rows],
                                                   self._batch(rnd))
        return hidden[: len(rnd.reqs) * self.n]

    def draft_extend(self, rnd: RoundInputs, ids: torch.Tensor, hidden: torch.Tensor,
                     accepted: list[int]) -> torch.Tensor:
        """The draft over the verified window (``ids``: the committed tokens shifted by one,
        ``hidden``: the verify's states) at the same positions; returns the feature of each
        request's ``select_index`` row (its last accepted token) ``[B, H]``."""
        self._fill(rnd, ids, hidden, accepted)
        b, rows = self.bufs, self.bs * self.n
        feats = self.drafter.forward(b.input_ids[:rows], b.hidden_states[:rows],
                                     b.mrope_positions[:, :rows], self._batch(rnd))
        return feats[b.select_index[: len(rnd.reqs)]]

    def positions(self, raw_bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """1-D and mrope positions of the real rows of the last fill (for audits)."""
        rows = raw_bs * self.n
        return self.bufs.positions[:rows], self.bufs.mrope_positions[:, :rows]

    def _fill(self, rnd: RoundInputs, ids: torch.Tensor, hidden: torch.Tensor,
              num_correct: list[int]) -> None:
        raw_bs, n = len(rnd.reqs), self.n
        self.bs = self.bufs.padded_size(raw_bs, self.capture_sizes)
        starts = torch.tensor(rnd.starts)
        pos = (starts.unsqueeze(1) + torch.arange(n)).flatten()  # [B*N]: S + j
        correct = torch.tensor(num_correct)
        fill_draft_extend_prepare_buffers(
            self.bufs,
            src_input_ids=ids,
            src_positions=pos,
            src_out_cache_loc=self._slots(rnd, pos),
            src_hidden_states=hidden,
            src_seq_lens=starts + n,
            src_req_indices=torch.arange(raw_bs),
            src_num_correct_drafts=correct,
            src_num_accept_tokens=correct + 1,
            src_temperatures=torch.tensor([r.sampling.temperature for r in rnd.reqs],
                                          dtype=torch.float32),
            src_mrope_deltas=rnd.deltas,
            raw_bs=raw_bs, bs=self.bs, num_tokens_per_bs=n, num_front_tokens=0,
            seq_len_fill_value=n, pad_slot=self.pad_slot,
        )

    def _slots(self, rnd: RoundInputs, pos: torch.Tensor) -> torch.Tensor:
        """KV slot of each real row: its absolute index, through its request's pages."""
        ps = self.engine.config.page_size
        slots = []
        for i, r in enumerate(rnd.reqs):
            for p in pos[i * self.n : (i + 1) * self.n].tolist():
                slots.append(r.page_ids[p // ps] * ps + p % ps)
        return torch.tensor(slots)

    def _batch(self, rnd: RoundInputs) -> AttentionBatch:
        b, pad = self.bufs, self.bs - len(rnd.reqs)
        tables = [r.page_ids for r in rnd.reqs] + [[self.engine.scratch_page]] * pad
        return AttentionBatch.from_lists([self.n] * self.bs, b.seq_lens[: self.bs].tolist(), tables,
                              b.out_cache_loc[: self.bs * self.n])
