"""EAGLE-2 draft trees: the shape flags and the dynamic tree built while drafting.

A round drafts for each request a tree rooted at its bonus token ``b`` (depth 0, index ``S``):

* **depth 1**: the top-``k`` tokens of the draft's seed feature (no forward needed);
* **forward i** (``i = 1 .. steps - 1``) runs the ``k`` *frontier* nodes of depth ``i``; each
  frontier node's top-``k`` children are candidates of depth ``i + 1`` (``k*k`` per forward),
  and the ``k`` best of them by cumulative log-probability become the next frontier;
* **rerank**: the ``n`` best candidates overall (of ``k + (steps - 1) * k*k``) are verified.

A child's score is its parent's plus a log-probability (``<= 0``), so it never beats its parent;
ties go to the earlier candidate, and a parent is always an earlier candidate than its children.
So the kept set is closed under "parent of", i.e. a tree. Its nodes are numbered root first and
then in candidate order, so every parent comes before its children.

With ``k = 1`` and ``steps = n`` the tree is the chain ``d_1..d_n`` (:attr:`TreeShape.is_chain`),
which :class:`decode_node.spec.eagle_engine.EagleEngine` runs on its own chain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """The draft tree of a round: ``topk`` children per expanded node, ``steps`` depths, and
    ``num_draft_tokens`` nodes kept for the verify (besides the root)."""

    num_draft_tokens: int
    topk: int = 1
    steps: int | None = None  # None: num_draft_tokens (a chain when topk == 1)

    def __post_init__(self) -> None:
        n, k, s = self.num_draft_tokens, self.topk, self.depth
        if n < 1:
            raise ValueError(f"--num-draft-tokens must be at least 1, got {n}")
        if k < 1:
            raise ValueError(f"--draft-topk must be at least 1, got {k}")
        if s < 1:
            raise ValueError(f"--draft-steps must be at least 1, got {s}")
        if n > self.num_candidates:
            raise ValueError(
                f"--num-draft-tokens {n} exceeds the {self.num_candidates} candidates a tree of "
                f"--draft-topk {k} and --draft-steps {s} drafts (topk + (steps - 1) * topk^2); "
                "raise the steps or the topk, or draft fewer tokens")

    @property
    def depth(self) -> int:
        """Draft depths per round (``steps``, defaulting to ``num_draft_tokens``)."""
        return self.num_draft_tokens if self.steps is None else self.steps

    @property
    def is_chain(self) -> bool:
        """Whether the round is today's chain of ``num_draft_tokens`` drafts."""
        return self.topk == 1 and self.depth == self.num_draft_tokens

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk

    @property
    def scratch(self) -> int:
        """Draft KV slots the tree forwards write past ``S`` (``k`` per forward)."""
        return self.topk * (self.depth - 1)

    @property
    def lookahead(self) -> int:
        """KV a request may need past its tokens: the verify's ``n + 1`` rows from ``S`` on, or
        the tree forwards' scratch, whichever reaches further (``S + 1`` tokens exist)."""
        return max(self.num_draft_tokens, self.scratch - 1)


@dataclass(frozen=True)
class DraftTree:
    """The verified trees of ``B`` requests, ``N = n + 1`` nodes each (node 0 is the root)."""

    tokens: torch.Tensor  # [B, n] int64, the draft token of nodes 1..n
    parents: torch.Tensor  # [B, N] int64, node index of each node's parent (-1 for the root)
    depths: torch.Tensor  # [B, N] int64, 0 for the root
    mask: torch.Tensor  # [B, N, N] bool, node q sees node w iff w is q or one of its ancestors


class TreeDraft:
    """The candidates of one round's trees while drafting (``B`` requests, ``k = topk``).

    Candidate indices are global per request and grow with each expansion: ``0..k-1`` are the
    depth-1 candidates, then ``k*k`` per forward.
    """

    def __init__(self, seed_logprobs: torch.Tensor, topk: int) -> None:
        """Depth 1 from the seed features' log-probabilities ``[B, V]``."""
        self.k = topk
        lp, tok = seed_logprobs.topk(topk, dim=-1)  # [B, k] each
        bsz = lp.shape[0]
        device = lp.device
        self.scores = [lp.clamp(max=0.0)]  # [B, m] per expansion
        self.tokens = [tok]
        self.parents = [torch.full((bsz, topk), -1, dtype=torch.int64, device=device)]
        self.frontier = torch.arange(topk, device=device).expand(bsz, topk)  # [B, k] candidates
        self.frontier_scores = self.scores[0]  # [B, k]
        self.frontier_tokens = tok  # [B, k]
        self.size = topk
        # ancestors of each frontier row among the forwards' rows so far, itself included
        self.rows_seen = torch.eye(topk, dtype=torch.bool, device=device).expand(bsz, -1, -1)

    def expand(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Add the children of the frontier, whose forward gave ``logprobs`` ``[B*k, V]``, and
        move the frontier to the best ``k`` of them. Returns each new frontier row's parent row
        in that forward ``[B, k]`` (its feature is the next forward's input)."""
        k = self.k
        bsz = self.frontier.shape[0]
        lp, tok = logprobs.view(bsz, k, -1).topk(k, dim=-1)  # [B, k, k]
        scores = (self.frontier_scores.unsqueeze(2) + lp.clamp(max=0.0)).reshape(bsz, k * k)
        tok = tok.reshape(bsz, k * k)
        parents = self.frontier.unsqueeze(2).expand(bsz, k, k).reshape(bsz, k * k)
        base = self.size
        self.scores.append(scores)
        self.tokens.append(tok)
        self.parents.append(parents)
        self.size += k * k
        best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # [B, k]
        self.frontier = base + best
        self.frontier_scores = scores.gather(1, best)
        self.frontier_tokens = tok.gather(1, best)
        parent_row = torch.div(best, k, rounding_mode="floor")  # [B, k]
        seen = self.rows_seen.gather(1, parent_row.unsqueeze(2).expand(-1, -1,
                                                                        self.rows_seen.shape[2]))
        own = torch.eye(k, dtype=torch.bool, device=seen.device).expand(bsz, -1, -1)
        self.rows_seen = torch.cat([seen, own], dim=2)  # [B, k, W + k]
        return parent_row

    def select(self, n: int) -> DraftTree:
        """The ``n`` best candidates of every request as a :class:`DraftTree`."""
        scores = torch.cat(self.scores, dim=1)  # [B, C]
        tokens = torch.cat(self.tokens, dim=1)
        parents = torch.cat(self.parents, dim=1)
        bsz = scores.shape[0]
        top = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n]
        chosen = top.sort(dim=-1).values  # [B, n] candidate indices, parents first
        node_of = torch.full_like(scores, -1, dtype=torch.int64)  # [B, C] candidate -> node
        node_of.scatter_(1, chosen, torch.arange(1, n + 1, device=scores.device).expand(bsz, n))
        cand_parent = parents.gather(1, chosen)  # [B, n]
        # a kept node's parent is kept (the module docstring) unless NaN scores broke the
        # order; such an orphan hangs from the root, so the result is a tree whatever the
        # scores (mended on the device: a check read on the host would stall every round)
        par = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
        par = par.clamp(min=0)
        node_parents = torch.cat([torch.full((bsz, 1), -1, dtype=torch.int64,
                                             device=par.device), par], dim=1)  # [B, N]
        return DraftTree(tokens.gather(1, chosen), node_parents, *_depths_and_mask(par))


def _depths_and_mask(par: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths ``[B, N]`` and ancestor masks ``[B, N, N]`` of trees whose node ``j >= 1`` has
    parent ``par[:, j - 1] < j``."""
    bsz, n = par.shape
    rows = torch.arange(bsz, device=par.device)
    depths = torch.zeros(bsz, n + 1, dtype=torch.int64, device=par.device)
    mask = torch.eye(n + 1, dtype=torch.bool, device=par.device).repeat(bsz, 1, 1)
    for j in range(1, n + 1):
        p = par[:, j - 1]
        depths[:, j] = depths[rows, p] + 1
        mask[:, j] |= mask[rows, p]
    return depths, mask
