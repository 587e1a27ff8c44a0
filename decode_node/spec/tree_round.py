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
* **Accept** (:func:`~decode_node.spec.accept.accept_tree_greedy`, or
  :func:`~decode_node.spec.accept.accept_tree_sampled` against the target's sampling
  distributions, penalties included): the path ``0 = p_0, p_1, .. p_{A-1}`` and ``A`` tokens to
  commit. The target KV of ``p_j`` moves from slot ``S + p_j`` to
  ``S + j`` (every layer), so the committed KV is contiguous again.
* **Draft extend**: the draft over rows ``j = 0 .. N - 1`` at ``S + j`` (the chain's window):
  row ``j < A`` pairs the verify's feature of ``p_j`` with committed token ``j``, so the
  draft KV lands at its committed slots directly; rows ``>= A`` repeat the last one and write
  past ``S + A``. Row ``A - 1`` seeds the next round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from decode_node.spec.accept import accept_tree_greedy, accept_tree_sampled
from decode_node.spec.graph_runner import RoundInputs, SpecGraphRunner
from decode_node.spec.tree import DraftTree, TreeDraft, TreeShape
from engine.attention.backend import AttentionBatch
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import RequestState
from engine.multimodal.mrope import mrope_from_1d
from engine.runner.draft_runner import DraftRunner
from engine.runner.input_batch import to_device
from engine.sampling.penalties import tree_scores
from engine.sampling.sampler import sampling_probs

# (phase, request ids per row, mrope positions [3, T], 1-D positions [T])
RowLog = Callable[[str, list[str], torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class TreeOutcome:
    """What a tree round commits, per request in batch order."""

    committed: list[list[int]]  # the A tokens to commit
    logits: torch.Tensor  # [B, N, V] verify logits along the path (row j: before token j)
    seeds: torch.Tensor  # [B, H] the draft feature that seeds the next round


class TreeRounds:
    """Tree rounds of ``shape`` over an engine, its draft and its static-buffer runner."""

    def __init__(self, engine: LLMEngine, drafter: DraftRunner, graph: SpecGraphRunner,
                 shape: TreeShape, log: RowLog) -> None:
        self.engine, self.drafter, self.graph, self.shape, self.log = (
            engine, drafter, graph, shape, log)

    def run(self, rnd: RoundInputs, features: torch.Tensor) -> TreeOutcome:
        """One round for the requests of ``rnd`` (each holding pages up to ``S + N`` and
        ``S + scratch``), seeded by their draft features ``[B, H]``."""
        bsz, n = len(rnd.reqs), self.shape.num_draft_tokens + 1
        tree = self._draft(rnd, features)
        device = self.graph.bufs.device
        bonus = torch.tensor([r.output_token_ids[-1] for r in rnd.reqs], device=device)
        ids = torch.cat([bonus.unsqueeze(1), tree.tokens.to(device)], dim=1)  # [B, N]
        starts = torch.tensor(rnd.starts, device=device)
        positions = (starts.unsqueeze(1) + tree.depths.to(device)).flatten()  # [B*N]: S + depth
        hidden, features = self.graph.verify(replace(rnd, positions=positions), ids.flatten(),
                                             tree.mask.to(device))
        self._log_graph("verify", rnd)
        logits = self.engine.model.logits(hidden).view(bsz, n, -1)  # [B, N, V]
        paths, committed = self._accept(rnd, ids.tolist(), tree, logits)
        self._move_target_kv(rnd, paths)
        pad = [p + [p[-1]] * (n - len(p)) for p in paths]
        nodes = torch.tensor(pad, device=device)  # [B, N] node of each draft-extend row
        ext = torch.tensor([c + [c[-1]] * (n - len(c)) for c in committed], device=device)
        path_features = features.reshape(bsz, n, -1).gather(
            1, nodes.unsqueeze(2).expand(-1, -1, features.shape[1])).flatten(0, 1)  # [B*N, H]
        seeds = self.graph.draft_extend(rnd, ext.flatten(), path_features,
                                        [len(c) - 1 for c in committed])
        self._log_graph("draft_extend", rnd)
        path_logits = logits.gather(1, nodes.unsqueeze(2).expand(-1, -1, logits.shape[2]))
        return TreeOutcome(committed, path_logits, seeds)

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

    def _accept(self, rnd: RoundInputs, ids: list[list[int]], tree: DraftTree,
                logits: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """Each request's accepted path (node indices) and tokens to commit."""
        paths, committed = [], []
        parents = tree.parents.tolist()
        for i, req in enumerate(rnd.reqs):
            scores = self.engine.structured.mask_tree(  # [N, V]
                req, ids[i], tree.mask[i], logits[i],
                tree_scores(req, ids[i], tree.mask[i], logits[i]))
            if req.sampling.is_greedy:
                path, toks = accept_tree_greedy(ids[i], parents[i],
                                                scores.argmax(dim=-1).tolist())
            else:
                assert isinstance(req.payload, RequestState)
                probs = sampling_probs(scores, [req.sampling] * scores.shape[0])
                path, toks = accept_tree_sampled(ids[i], parents[i], probs,
                                                 req.payload.generator)
            paths.append(path)
            committed.append(toks)
        return paths, committed

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

