"""Static-shape verify and draft-extend forwards over :class:`SpecGraphBuffers`.

A round's live batch of ``raw_bs`` requests is copied into persistent buffers and padded to the
smallest captured batch size ``bs`` by :func:`fill_draft_extend_prepare_buffers` (Triton on CUDA,
native PyTorch elsewhere); the forward then reads *only* the buffers, so a captured graph would
replay it unchanged. The mrope buffer is refilled from the final positions on every fill, so a
replay never sees positions of an earlier round.

Padded rows: ``N`` tokens at position 0 whose K/V go to the engine's scratch page (never handed
to a request), attention over ``N`` keys of that page, outputs discarded. On CUDA with graphs on
(and the Triton attention, whose launches never depend on the keys' count) each forward is
captured once per padded size (:class:`engine.runner.cuda_graph.GraphCache`) and replayed; on CPU
and NPU it runs eagerly on the same buffers, which is what lets the padding logic be tested here.
The attention lengths and page tables live in static buffers of this runner, refilled before
every forward like the token buffers; so does a draft tree's verify mask (``[bs, N, N]``, node
``q`` sees node ``w`` iff ``w`` is ``q`` or its ancestor; padded rows causal), whose verify
positions are ``S + depth`` (the caller's ``RoundInputs.positions``).

A round's per-request inputs (:class:`RoundInputs`: the verify window's positions and KV slots,
the padded page tables, mrope deltas) are gathered once per round from the engine runner's
persistent batch (:class:`engine.runner.input_batch.InputBatch`) with array operations, and reach
the buffers' device in one copy; the verify and the draft extend of the round share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decode_node.spec.fill import fill_draft_extend_prepare_buffers
from decode_node.spec.graph_buffers import SpecGraphBuffers
from engine.attention.backend import AttentionBatch
from engine.attention.select import backend_name
from engine.core.request import Request
from engine.llm_engine import LLMEngine, graph_sizes
from engine.models.step_extras import NO_EXTRAS, StepExtras
from engine.parallel.messages import StateStep
from engine.runner.cuda_graph import GraphCache
from engine.runner.draft_runner import DraftRunner
from engine.runner.input_batch import to_device


@dataclass(frozen=True)
class RoundInputs:
    """One round's per-request values, in batch order, for ``B`` requests padded to ``bs``
    (tensors on the buffers' device)."""

    reqs: list[Request]
    starts: list[int]  # S per request
    rows: np.ndarray  # [B] the requests' persistent-batch rows
    bs: int  # the padded (captured) batch size
    deltas: torch.Tensor  # [B] int64 mrope deltas
    page_table: torch.Tensor  # [bs, ceil((max S + N) / page_size)] int32; pad rows: scratch
    positions: torch.Tensor  # [B*N] int64, S + j: the verify window (a tree's: S + depth)
    slots: torch.Tensor  # [B*N] int64, KV slot of each window token
    seq_lens: torch.Tensor  # [B] int64, S + N
    temperatures: torch.Tensor  # [B] float32


class SpecGraphRunner:
    """The static verify and draft-extend forwards of one engine's EAGLE rounds (see the module
    docstring), captured at the engine's graph sizes (``EngineConfig.cuda_graph_sizes``)."""

    def __init__(self, engine: LLMEngine, drafter: DraftRunner, k: int) -> None:
        n = k + 1
        page_size = engine.config.page_size
        if n > page_size:
            raise ValueError(f"num_draft_tokens + 1 = {n} must fit one page ({page_size} tokens)")
        self.engine, self.drafter, self.n = engine, drafter, n
        max_bs = engine.scheduler.config.max_num_seqs
        self.capture_sizes = graph_sizes(engine.config, max_bs)
        self.bufs = SpecGraphBuffers.allocate(max_bs, n, engine.model_config.text.hidden_size,
                                              engine.pool.device, engine.model.dtype)
        self.pad_slot = engine.scratch_page * page_size
        self.bs = 0  # padded size of the last fill
        device = engine.pool.device
        # a TP forward announces itself to the other ranks on a pipe, and a hybrid model's
        # verify keeps its window's states with host-side work: neither can be captured
        enabled = (engine.config.graphs and backend_name(engine.pool) == "triton"
                   and engine.tp is None and engine.states is None)
        self.graphs = GraphCache(device, self.capture_sizes, enabled)
        sched = engine.scheduler.config
        self.max_pages = -(-(sched.max_model_len + sched.lookahead_tokens) // page_size)
        # static attention inputs: [max_bs] lengths, [max_bs + 1] row offsets, page tables
        self.kv_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.q_lens = torch.full((max_bs,), n, dtype=torch.int32, device=device)
        self.q_starts = torch.arange(0, (max_bs + 1) * n, n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=device)
        self.causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [N, N]
        self.tree_mask = self.causal.repeat(max_bs, 1, 1)  # [max_bs, N, N] bool

    def round_inputs(self, reqs: list[Request], starts: list[int]) -> RoundInputs:
        """Gather a round's inputs for ``reqs`` at ``starts`` (each must hold the pages of its
        window ``S..S+K``)."""
        n, batch = self.n, self.engine.runner.batch
        ends = [s + n for s in starts]
        rows = batch.rows(reqs, ends)
        bs = self.bufs.padded_size(len(reqs), self.capture_sizes)
        real = batch.table(rows, max(ends))
        table = np.full((bs, real.shape[1]), self.engine.scratch_page, dtype=np.int32)
        table[: len(reqs)] = real
        pos = (np.array(starts, dtype=np.int64)[:, None] + np.arange(n)).reshape(-1)  # [B*N]
        temps = np.array([r.sampling.temperature for r in reqs], dtype=np.float32)
        host = [batch.deltas(rows), table, pos, batch.slots(np.repeat(rows, n), pos),
                np.array(ends, dtype=np.int64), temps]
        return RoundInputs(reqs, starts, rows, bs, *to_device(host, self.bufs.device))

    def verify(self, rnd: RoundInputs, ids: torch.Tensor,
               tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over ``ids`` ``[B*N]`` (``[b, d_1..d_K]`` per request) at
        ``rnd.positions`` (``S..S+K`` for a chain), causal or under a draft tree's ``tree_mask``
        ``[B, N, N]``; returns the real rows' hidden states ``[B*N, H]`` (for the target's
        logits) and the features they hand the draft ``[B*N, H]`` (the same tensor for an
        EAGLE-1/2 draft; for an EAGLE-3 one its ``fc`` over three layers' outputs, computed in
        the same static forward)."""
        b = self.bufs
        self._fill(rnd, ids, torch.zeros(ids.shape[0], b.hidden_size, device=b.device,
                                         dtype=b.hidden_states.dtype), [0] * len(rnd.reqs))
        if tree_mask is not None:
            raw_bs = len(rnd.reqs)
            self.tree_mask[:raw_bs].copy_(tree_mask)
            self.tree_mask[raw_bs : self.bs].copy_(self.causal)
        b, rows, batch = self.bufs, self.bs * self.n, self._batch(rnd, tree_mask is not None)
        extras, step = self._window_states(rnd, tree_mask is not None)

        eagle3 = bool(self.drafter.aux_layers)

        def forward() -> torch.Tensor:
            embeds = self.engine.model.embed(b.input_ids[:rows])
            hidden, aux = self.engine.runner.forward_embeds_aux(
                embeds, b.mrope_positions[:, :rows], batch, extras, step)
            if not eagle3:
                return hidden
            return torch.cat((hidden, self.drafter.target_feature(hidden, aux)), dim=-1)

        kind = "verify" if tree_mask is None else "verify_tree"  # the mask changes the graph
        out = self.graphs.run(kind, self.bs, forward)[: len(rnd.reqs) * self.n]
        if not eagle3:
            return out, out
        return out[:, : b.hidden_size], out[:, b.hidden_size :]

    def keep_states(self, accepted: list[int]) -> None:
        """After a chain verify of a hybrid model: each request's state slot takes its state
        after its ``accepted`` window rows (the bonus and its accepted drafts), so its rejected
        drafts leave no trace (:meth:`LinearStates.keep`), on every tensor-parallel rank.
        Nothing to do without linear attention."""
        runner = self.engine.runner
        if runner.states is not None:
            (kept,) = to_device([np.array(accepted, dtype=np.int64)], self.bufs.device)
            if runner.peers is not None:
                runner.peers.keep_states(kept)
            runner.states.keep(kept)

    def draft_extend(self, rnd: RoundInputs, ids: torch.Tensor, hidden: torch.Tensor,
                     accepted: list[int]) -> torch.Tensor:
        """The draft over the verified window (``ids``: the committed tokens shifted by one,
        ``hidden``: the verify's states) at the same positions; returns the feature of each
        request's ``select_index`` row (its last accepted token) ``[B, H]``."""
        self._fill(rnd, ids, hidden, accepted)
        b, rows, batch = self.bufs, self.bs * self.n, self._batch(rnd)

        def forward() -> torch.Tensor:
            return self.drafter.forward(b.input_ids[:rows], b.hidden_states[:rows],
                                        b.mrope_positions[:, :rows], batch)

        feats = self.graphs.run("draft_extend", self.bs, forward)
        return feats[b.select_index[: len(rnd.reqs)]]

    def capture_all(self, tree: bool) -> list[str]:
        """Capture the verify (a tree's when ``tree``) and draft-extend forwards of every size
        now, over rows of padding only (they write the scratch page and nothing else), so that
        serving only replays; the graphs captured, as ``name:size`` (none unless
        :attr:`GraphCache.captures`)."""
        if not self.graphs.captures:
            return []
        device, n, hidden = self.bufs.device, self.n, self.bufs.hidden_size
        ids = torch.zeros(0, dtype=torch.int64, device=device)
        features = torch.zeros(0, hidden, dtype=self.bufs.hidden_states.dtype, device=device)
        mask = torch.zeros(0, n, n, dtype=torch.bool, device=device) if tree else None
        for bs in self.capture_sizes:
            rnd = self._padding_round(bs)
            self.verify(rnd, ids, mask)
            self.draft_extend(rnd, ids, features, [])
        kind = "verify_tree" if tree else "verify"
        return [f"{name}:{bs}" for bs in self.capture_sizes for name in (kind, "draft_extend")]

    def _padding_round(self, bs: int) -> RoundInputs:
        """A round of no request padded to ``bs`` rows (what :meth:`capture_all` runs)."""
        device = self.bufs.device
        none = torch.zeros(0, dtype=torch.int64, device=device)
        table = torch.full((bs, 1), self.engine.scratch_page, dtype=torch.int32, device=device)
        return RoundInputs([], [], np.zeros(0, dtype=np.int64), bs, none, table, none, none, none,
                           torch.zeros(0, dtype=torch.float32, device=device))

    def positions(self, raw_bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """1-D and mrope positions of the real rows of the last fill (for audits)."""
        rows = raw_bs * self.n
        return self.bufs.positions[:rows], self.bufs.mrope_positions[:, :rows]

    def _fill(self, rnd: RoundInputs, ids: torch.Tensor, hidden: torch.Tensor,
              num_correct: list[int]) -> None:
        raw_bs, n = len(rnd.reqs), self.n
        self.bs = rnd.bs
        correct = np.array(num_correct, dtype=np.int64)
        correct_t, accept_t, req_indices = to_device(
            [correct, correct + 1, np.arange(raw_bs, dtype=np.int64)], self.bufs.device)
        fill_draft_extend_prepare_buffers(
            self.bufs,
            src_input_ids=ids,
            src_positions=rnd.positions,
            src_out_cache_loc=rnd.slots,
            src_hidden_states=hidden,
            src_seq_lens=rnd.seq_lens,
            src_req_indices=req_indices,
            src_num_correct_drafts=correct_t,
            src_num_accept_tokens=accept_t,
            src_temperatures=rnd.temperatures,
            src_mrope_deltas=rnd.deltas,
            raw_bs=raw_bs, bs=self.bs, num_tokens_per_bs=n, num_front_tokens=0,
            seq_len_fill_value=n, pad_slot=self.pad_slot,
        )

    def _window_states(self, rnd: RoundInputs, tree: bool) -> tuple[StepExtras, StateStep | None]:
        """A hybrid model's verify reads each request's state slot and keeps the state after
        every window row until :meth:`keep_states` (padded rows read the first request's slot;
        :class:`LinearStates` writes nothing meanwhile): the prepared states and the step the
        other tensor-parallel ranks apply. Nothing without linear attention."""
        states = self.engine.runner.states
        if states is None:
            return NO_EXTRAS, None
        if tree:
            raise ValueError("a draft tree's verify of a hybrid model is not supported")
        slots = [r.state_slot for r in rnd.reqs]
        step = StateStep.verify(slots + [slots[0]] * (rnd.bs - len(slots)), self.n)
        return StepExtras(states=step.apply(states)), step

    def _batch(self, rnd: RoundInputs, tree: bool = False) -> AttentionBatch:
        """Attention over the filled buffers, from this runner's static inputs: real rows see
        ``S + N`` keys, padded rows ``N`` keys of the scratch page, the last ``N`` under the
        static tree mask when ``tree``. A captured graph keeps the capacity as its key bound; an
        eager forward uses the round's own (a host value: nothing reads the device)."""
        bs, n = self.bs, self.n
        width = rnd.page_table.shape[1]
        self.page_table[:bs, :width].copy_(rnd.page_table)
        self.kv_lens[:bs].copy_(self.bufs.seq_lens[:bs])
        bound = self.max_pages * self.engine.config.page_size if self.graphs.captures else (
            max(rnd.starts) + n)
        return AttentionBatch(self.q_lens[:bs], self.kv_lens[:bs], self.q_starts[: bs + 1],
                              self.page_table[:bs], self.bufs.out_cache_loc[: bs * n], n, bound,
                              self.tree_mask[:bs] if tree else None)
