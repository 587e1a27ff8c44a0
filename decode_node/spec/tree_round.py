"""One EAGLE-2 tree round: draft a tree, verify it in one forward, keep the accepted path,
draft-extend over it.

Per request (``S`` committed, bonus ``b`` at index ``S``, tree of ``N = n + 1`` nodes, node 0 the
root ``b``; see :mod:`decode_node.spec.tree` for the tree itself):

* **Draft forwards** ``i = 1 .. steps - 1`` run the ``k`` frontier nodes of depth ``i``: row
  ``(feature of the parent, node token)`` at 1-D position ``S + i - 1`` (its parent's, the
  chain's pair convention), mrope ``+ delta``. Their draft KV goes to scratch slots
  ``S + (i - 1) * k + r`` and each row attends to the committed prefix, its ancestors' rows of the
  earlier forwards and itself. The draft extend overwrites the scratch before anything reads it.
* **Verify**: the target over the ``N`` nodes, node ``j`` at slot ``S + j`` and position
  ``S + depth(j)``, under the tree mask (the prefix, its ancestors and itself).
* **Accept** (:func:`~decode_node.spec.accept.accept_tree`, the whole batch on the device): the
  target's token at every node (its argmax, or one draw from its sampling distribution,
  penalties included), then the path ``0 = p_0, p_1, .. p_{A-1}`` and the ``A`` tokens to
  commit. Everything up to here stays on the device (:meth:`TreeRounds.verify`); the round reads
  the path with the rest of its outcome in one copy
  (:func:`~decode_node.spec.eagle_engine.read_outcome`), then :meth:`TreeRounds.extend` moves the
  target KV of ``p_j`` from slot ``S + p_j`` to ``S + j`` (every layer), so the committed KV is
  contiguous again.
* **Draft extend**: the draft over rows ``j = 0 .. N - 1`` at ``S + j`` (the chain's window):
  row ``j < A`` pairs the verify's feature of ``p_j`` with committed token ``j``, so the
  draft KV lands at its committed slots directly; rows ``>= A`` repeat the last one and write
  past ``S + A``. Row ``A - 1`` seeds the next round.

Requests with a grammar (``structured_output``) read their tree's tokens and mask on the host to
mask their verify rows (:meth:`engine.sampling.structured.StructuredOutputs.mask_tree`); no other
request reads anything before the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from decode_node.spec.accept import (
    Accepted,
    accept_tree,
    draw,
    generator_of,
    row_probs,
    rows_of,
)
from decode_node.spec.graph_runner import RoundInputs, SpecGraphRunner
from decode_node.spec.tree import DraftTree, TreeDraft, TreeShape
from engine.attention.backend import AttentionBatch
from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.multimodal.mrope import mrope_from_1d
from engine.runner.draft_runner import DraftRunner
from engine.runner.input_batch import to_device
from engine.sampling.penalties import tree_scores

# (phase, request ids per row, mrope positions [3, T], 1-D positions [T])
RowLog = Callable[[str, list[str], torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class TreeVerdict:
    """A tree round up to its acceptance, on the device, per request in batch order."""

    accepted: Accepted  # the lengths, the tokens to commit and the path
    logits: torch.Tensor  # [B, N, V] verify logits along the path (row j: before token j)
    features: torch.Tensor  # [B*N, H] the verify's features of every node


class TreeRounds:
    """Tree rounds of ``shape`` over an engine, its draft and its static-buffer runner."""

    def __init__(self, engine: LLMEngine, drafter: DraftRunner, graph: SpecGraphRunner,
                 shape: TreeShape, log: RowLog) -> None:
        self.engine, self.drafter, self.graph, self.shape, self.log = (
            engine, drafter, graph, shape, log)

    def verify(self, rnd: RoundInputs, features: torch.Tensor) -> TreeVerdict:
        """Draft, verify and accept for the requests of ``rnd`` (each holding pages up to
        ``S + N`` and ``S + scratch``), seeded by their draft features ``[B, H]``; reads
        nothing back but a grammar's tokens."""
        bsz, n = len(rnd.reqs), self.shape.num_draft_tokens + 1
        tree = self._draft(rnd, features)
        device = self.graph.bufs.device
        (bonus,) = to_device([np.array([r.output_token_ids[-1] for r in rnd.reqs],
                                       dtype=np.int64)], device)
        ids = torch.cat([bonus.unsqueeze(1), tree.tokens.to(device)], dim=1)  # [B, N]
        starts = torch.tensor(rnd.starts, device=device)
        positions = (starts.unsqueeze(1) + tree.depths.to(device)).flatten()  # [B*N]: S + depth
        hidden, features = self.graph.verify(replace(rnd, positions=positions), ids.flatten(),
                                             tree.mask.to(device))
        self._log_graph("verify", rnd)
        logits = self.engine.model.logits(hidden).view(bsz, n, -1)  # [B, N, V]
        accepted = accept_tree(ids, tree, self._targets(rnd.reqs, ids, tree, logits))
        assert accepted.path is not None
        path_logits = logits.gather(1, accepted.path.unsqueeze(2).expand(-1, -1,
                                                                         logits.shape[2]))
        return TreeVerdict(accepted, path_logits, features)

    def extend(self, rnd: RoundInputs, verdict: TreeVerdict, paths: list[list[int]]
               ) -> torch.Tensor:
        """Move the accepted nodes' target KV (``paths``: each request's accepted path, read
        on the host) and draft-extend over the committed window; returns the features that
        seed the next round ``[B, H]``."""
        self._move_target_kv(rnd, paths)
        acc, features = verdict.accepted, verdict.features
        assert acc.path is not None
        bsz, n = acc.path.shape
        path_features = features.reshape(bsz, n, -1).gather(
            1, acc.path.unsqueeze(2).expand(-1, -1, features.shape[1])).flatten(0, 1)  # [B*N, H]
        seeds = self.graph.draft_extend(rnd, acc.tokens.flatten(), path_features,
                                        [len(p) - 1 for p in paths])
        self._log_graph("draft_extend", rnd)
        return seeds

    def _draft(self, rnd: RoundInputs, features: torch.Tensor) -> DraftTree:
        """``steps - 1`` draft forwards growing each request's tree; the kept nodes."""
        k = self.shape.topk
        bsz = len(rnd.reqs)
        draft = TreeDraft(torch.log_softmax(self.drafter.logits(features), dim=-1), k)
        feats = features.repeat_interleave(k, dim=0)  # [B*k, H] features of the frontier's parents
        batch = self.engine.runner.batch
        starts = np.array(rnd.starts, dtype=np.int64)  # [B]
        device = rnd.page_table.device
        (table,) = to_device([batch.table(rnd.rows, int(starts.max()) + self.shape.scratch)],
                             device)
        deltas = rnd.deltas.repeat_interleave(k)  # [B*k]
        row_ids = [r.request_id for r in rnd.reqs for _ in range(k)]
        for i in range(1, self.shape.depth):
            pos_np = np.repeat(starts + i - 1, k)  # [B*k]: a depth-i node at its parent's S+i-1
            scratch = (starts[:, None] + (i - 1) * k + np.arange(k)).reshape(-1)  # [B*k]
            slots, pos = to_device([batch.slots(np.repeat(rnd.rows, k), scratch), pos_np],
                                   device)
            att = AttentionBatch.build([k] * bsz, (starts + i * k).tolist(), table, slots)
            att = replace(att, tree_mask=draft.rows_seen.to(device))
            mrope = mrope_from_1d(pos, deltas)  # from this forward's final positions
            out = self.drafter.forward(draft.frontier_tokens.flatten().to(device), feats, mrope,
                                       att)  # [B*k, H]
            self.log("draft_decode", row_ids, mrope, pos)
            parent_row = draft.expand(torch.log_softmax(self.drafter.logits(out), dim=-1))
            if i + 1 < self.shape.depth:  # the next frontier's parents' features
                index = parent_row.to(device).unsqueeze(2).expand(-1, -1, out.shape[1])
                feats = out.view(bsz, k, -1).gather(1, index).flatten(0, 1)  # [B*k, H]
        return draft.select(self.shape.num_draft_tokens)

    def _targets(self, reqs: list[Request], ids: torch.Tensor, tree: DraftTree,
                 logits: torch.Tensor) -> torch.Tensor:
        """The target's token at every node ``[B, N]``: the argmax of its scores (the logits
        with the request's penalties and grammar along the node's path), or for a sampled
        request one draw from its sampling distribution there, with its generator."""
        scores = self._scores(reqs, ids, tree, logits)
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if not sampled:
            return scores.argmax(dim=-1)
        n, vocab = scores.shape[1], scores.shape[2]
        probs = row_probs(rows_of(scores, sampled).reshape(-1, vocab),
                          [reqs[i].sampling for i in sampled for _ in range(n)])
        drawn = draw(probs.view(len(sampled), n, vocab), [generator_of(reqs[i]) for i in sampled])
        if len(sampled) == len(reqs):
            return drawn
        target = scores.argmax(dim=-1)  # [B, N]
        target[sampled] = drawn
        return target

    def _scores(self, reqs: list[Request], ids: torch.Tensor, tree: DraftTree,
                logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, N, V]`` with each request's penalties and grammar applied along its
        nodes' paths; ``logits`` itself when no request has either."""
        rows = [i for i, r in enumerate(reqs)
                if r.sampling.has_penalties or r.sampling.structured_output is not None]
        if not rows:
            return logits
        scores = logits.clone()
        mask = tree.mask.to(logits.device)
        for i in rows:
            req, raw = reqs[i], logits[i]
            row = tree_scores(req, ids[i], mask[i], raw)
            if req.sampling.structured_output is not None:  # host-side: reads the tree
                row = self.engine.structured.mask_tree(req, ids[i].tolist(), mask[i], raw, row)
            scores[i] = row
        return scores

    def _move_target_kv(self, rnd: RoundInputs, paths: list[list[int]]) -> None:
        """Move each accepted node's target KV from slot ``S + p_j`` to ``S + j``."""
        moves = [(i, s + p, s + j) for i, (s, path) in enumerate(zip(rnd.starts, paths,
                                                                     strict=True))
                 for j, p in enumerate(path) if p != j]
        if not moves:
            return
        item, src, dst = (np.array(x, dtype=np.int64) for x in zip(*moves, strict=True))
        batch = self.engine.runner.batch
        rows = rnd.rows[item]
        src_t, dst_t = to_device([batch.slots(rows, src), batch.slots(rows, dst)],
                                 self.engine.pool.device)
        self.engine.runner.move_kv(src_t, dst_t)  # on every TP rank

    def _log_graph(self, phase: str, rnd: RoundInputs) -> None:
        rows = [r.request_id for r in rnd.reqs for _ in range(self.shape.num_draft_tokens + 1)]
        pos, mrope = self.graph.positions(len(rnd.reqs))
        self.log(phase, rows, mrope.clone(), pos.clone())
