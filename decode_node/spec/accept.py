"""Acceptance of a round's drafts against the target's verify forward, a whole batch at once and
on the device: nothing here reads a tensor back to the host (the round reads its outcome once,
:func:`decode_node.spec.eagle_engine.read_outcome`).

Chains (``B`` requests, drafts ``d_1..d_K``, verify rows ``0..K``). Greedy: ``d_{j+1}`` is
accepted iff it and every draft before it equal the target's argmax at their rows (a cumulative
product of the matches); the argmax at the first mismatch (row ``K`` when all match) follows
them. Sampling: lossless speculative sampling (Leviathan et al.; Chen et al.): accept ``d`` with
probability ``min(1, p(d) / q(d))`` (``u * q(d) < p(d)`` for a uniform ``u``, never where
``q(d) = 0``); at the first rejection, at row ``j``, draw from ``normalize(max(p_j - q_j, 0))``
(``p_j`` itself when float rounding leaves nothing); when all ``K`` drafts pass, draw the bonus
from ``p_K``. ``p`` and ``q`` must be the exact distributions the target samples from and the
drafts were drawn from. Each request draws ``K`` uniforms and then one token, always, with its own
generator when it has one (so a seeded request's draws depend on its own seed and values only,
never on the batch); the unseeded share one call each on the global RNG.

Trees (``N`` nodes, node 0 the root, every parent before its children, siblings distinct tokens):
the round first takes a *target token* ``t_u`` at every node ``u``: the target's argmax
(greedy) or one draw from its distribution ``p_u`` (sampling). Node ``c`` is accepted iff its
parent is and its token equals ``t_parent`` (of two such siblings, the first in index order), so
the accepted nodes form one path from the root; its last node ``u`` contributes ``t_u`` after
the path's tokens. Under sampling each committed token is thus a draw from ``p_u`` at the node
that precedes it, taken whether or not a child proposed it: lossless whatever tokens the draft
proposed (they act as point masses), and ``p_u`` is drawn at every node at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode_node.spec.tree import DraftTree
from engine.core.request import Request, SamplingParams
from engine.multimodal.inputs import RequestState
from engine.sampling.sampler import inverse_cdf, sampling_probs

Generators = Sequence[torch.Generator | None]


@dataclass(frozen=True)
class Accepted:
    """What a batch of ``B`` requests commits from a verify window of ``N`` rows (device
    tensors)."""

    lengths: torch.Tensor  # [B] int64: A, the tokens to commit (accepted drafts + 1)
    tokens: torch.Tensor  # [B, N] int64: the A tokens, then the last one repeated
    path: torch.Tensor | None = None  # [B, N] int64, trees: the path's nodes, padded alike


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """One request's tokens to commit under :func:`chain_greedy`, from and to host lists
    (``len(target_argmax) == len(drafts) + 1``): the batched rule on a batch of one, for a
    caller that holds lists (a round keeps its tensors)."""
    d = torch.tensor([drafts], dtype=torch.int64).view(1, -1)
    accepted, last = chain_greedy(d, torch.tensor([target_argmax], dtype=torch.int64))
    return _host_tokens(chain_outcome(d, accepted, last))


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
    """One request's tokens to commit under :func:`chain_sampled`, as a host list (the batched
    rule on a batch of one, for a caller that holds lists): ``p`` the target distributions
    ``[K + 1, V]`` (row ``j`` the distribution of the token after the ``j``-th verified token),
    ``q`` ``[K, V]`` the ones ``drafts`` were drawn from."""
    d = torch.tensor([drafts], dtype=torch.int64, device=p.device).view(1, -1)
    accepted, last = chain_sampled(d, p.unsqueeze(0), q.unsqueeze(0), [generator])
    return _host_tokens(chain_outcome(d, accepted, last))


def chain_greedy(drafts: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of ``drafts`` ``[B, K]`` against the target's argmax at each verify
    row ``target`` ``[B, K + 1]``: the accepted drafts per request ``[B]`` and the token after
    them ``[B]``."""
    matches = (drafts == target[:, :-1]).long()  # [B, K]
    accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    return accepted, target.gather(1, accepted.unsqueeze(1)).squeeze(1)


def chain_sampled(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                  generators: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling of ``drafts`` ``[B, K]`` drawn from ``q`` ``[B, K, V]``
    against the target's ``p`` ``[B, K + 1, V]`` (one generator or None per request): the
    accepted drafts per request ``[B]`` and the token drawn after them ``[B]``."""
    bsz, k = drafts.shape
    u = uniforms(bsz, k, generators, p.device)  # [B, K]
    pd = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    qd = q.gather(2, drafts.unsqueeze(2)).squeeze(2)
    passed = ((qd > 0) & (u * qd < pd)).long()
    accepted = passed.cumprod(dim=1).sum(dim=1)  # [B]
    row = accepted.view(bsz, 1, 1).expand(-1, 1, p.shape[2])
    target = p.gather(1, row).squeeze(1)  # [B, V] p at the first rejection, or p_K
    drafted = q.gather(1, row.clamp(max=k - 1)).squeeze(1)  # [B, V] q there (none at row K)
    drafted = torch.where((accepted < k).unsqueeze(1), drafted, 0.0)
    residual = torch.clamp(target - drafted, min=0.0)
    total = residual.sum(dim=1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny),
                       target)
    return accepted, draw(dist, generators)


def chain_outcome(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> Accepted:
    """The tokens a chain commits: the ``accepted`` drafts ``[B]`` of ``drafts`` ``[B, K]``,
    then ``last`` ``[B]``, repeated to the window's ``K + 1`` rows."""
    cols = torch.arange(drafts.shape[1] + 1, device=drafts.device)
    padded = torch.cat([drafts, last.unsqueeze(1)], dim=1)  # [B, K + 1]
    tokens = torch.where(cols < accepted.unsqueeze(1), padded, last.unsqueeze(1))
    return Accepted(accepted + 1, tokens)


def accept_tree(ids: torch.Tensor, tree: DraftTree, target: torch.Tensor) -> Accepted:
    """The accepted path of each request's tree and its tokens to commit (see the module
    docstring): ``ids`` ``[B, N]`` the nodes' tokens (node 0 the bonus), ``target`` ``[B, N]``
    the target's token at each node (argmax, or a draw from its distribution)."""
    parents = tree.parents.to(ids.device)
    nodes = torch.arange(ids.shape[1], device=ids.device)
    wanted = target.gather(1, parents.clamp(min=0))  # [B, N] the target's token at the parent
    matches = (ids == wanted) | (nodes == 0)  # the root is always on the path
    sibling = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (nodes.view(1, 1, -1)
                                                                 < nodes.view(1, -1, 1))
    first = matches & ~(sibling & matches.unsqueeze(1)).any(dim=2)  # no earlier sibling matched
    mask, depths = tree.mask.to(ids.device), tree.depths.to(ids.device)
    accepted = ~(mask & ~first.unsqueeze(1)).any(dim=2)  # [B, N] the node and its ancestors pass
    last = torch.where(accepted, depths, -1).argmax(dim=1, keepdim=True)  # [B, 1] deepest
    lengths = depths.gather(1, last) + 1  # [B, 1]
    on_path = mask.gather(1, last.unsqueeze(2).expand(-1, 1, ids.shape[1])).squeeze(1)
    at_depth = on_path.unsqueeze(1) & (depths.unsqueeze(1) == nodes.view(1, -1, 1))  # [B, d, j]
    path = torch.where(nodes < lengths, (at_depth.long() * nodes).sum(dim=2), last)  # [B, N]
    after = ids.gather(1, torch.cat([path[:, 1:], last], dim=1))  # token of the next path node
    tokens = torch.where(nodes < lengths - 1, after, target.gather(1, last))
    return Accepted(lengths.squeeze(1), tokens, path)


def row_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """:func:`~engine.sampling.sampler.sampling_probs` of ``logits`` ``[m, V]`` (one ``params``
    per row), each row as it would be alone: rows with a top-k, top-p or min-p filter and rows
    without go through separate calls (one filtered row sends every row of a call through the
    filtered path, whose rounding differs), so no request's distribution depends on the
    batch."""
    filtered = [i for i, p in enumerate(params) if _filters(p)]
    if len(filtered) in (0, len(params)):
        return sampling_probs(logits, list(params))
    plain = [i for i, p in enumerate(params) if not _filters(p)]
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in (filtered, plain):
        out[rows] = sampling_probs(logits[rows], [params[i] for i in rows])
    return out


def draw(probs: torch.Tensor, generators: Generators) -> torch.Tensor:
    """One draw from each distribution of ``probs`` ``[B, ..., V]`` ``-> [B, ...]``
    (:func:`engine.sampling.sampler.inverse_cdf`): request ``b``'s uniforms from its
    generator, the unseeded requests' from one call on the global RNG."""
    flat = probs.reshape(len(generators), -1, probs.shape[-1])  # [B, R, V]
    u = uniforms(flat.shape[0], flat.shape[1], generators, probs.device, torch.float64)
    return inverse_cdf(flat.flatten(0, 1), u.flatten()).view(probs.shape[:-1])


def uniforms(bsz: int, k: int, generators: Generators, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, k]`` uniforms in ``[0, 1)`` of ``dtype``: request ``b``'s from its generator, the
    unseeded requests' from one call on the global RNG."""
    free = [b for b, g in enumerate(generators) if g is None]
    picks: dict[int, torch.Tensor] = {}
    if free:
        picks.update(zip(free, torch.rand(len(free), k, dtype=dtype, device=device), strict=True))
    for b, gen in enumerate(generators):
        if gen is not None:
            picks[b] = torch.rand(k, dtype=dtype, generator=gen, device=gen.device).to(device)
    return torch.stack([picks[b] for b in range(bsz)])


def rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, or ``t`` itself (no copy) when ``rows`` are all of its rows in order."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def generator_of(req: Request) -> torch.Generator | None:
    """``req``'s generator (made from its seed on the engine's device), or None for the global
    RNG."""
    assert isinstance(req.payload, RequestState)
    return req.payload.generator


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _host_tokens(acc: Accepted) -> list[int]:
    """The committed tokens of a batch of one, on the host."""
    row: list[int] = acc.tokens[0].tolist()
    return row[: int(acc.lengths[0])]
