"""Acceptance of a chain of draft tokens against the target's verify forward.

Greedy: draft ``d_{j+1}`` is accepted iff it equals the target's argmax at row ``j``, in order;
the first mismatch (or row ``K`` when all match) gives the new bonus token. Sampling: lossless
speculative sampling (Leviathan et al.; Chen et al.): accept ``d`` with probability
``min(1, p(d) / q(d))``; at the first rejection draw from ``normalize(max(p - q, 0))``; when all
``K`` drafts pass, draw the bonus from ``p`` at row ``K``. ``p`` and ``q`` must be the exact
distributions the target samples from and the drafts were drawn from.

Trees: the accepted nodes form one root-to-node path. Greedy: node ``c`` is accepted iff its
parent is and its token equals the target's argmax at its parent. Sampling (target-only, the
drafts taken as point masses): at the path's last node ``u``, try its children in order with the
target's distribution ``p_u``: accept child token ``x`` with probability ``p(x)``, else remove
``x`` from ``p`` and renormalize; when no child is accepted draw from what is left. Each step's
token then has exactly the distribution ``p_u`` (``x_1`` with ``p(x_1)``, ``x_2`` with
``(1 - p(x_1)) p(x_2) / (1 - p(x_1))``, any other ``y`` with ``p(y)``), so it is lossless
whatever tokens the draft proposed.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to commit: the accepted drafts followed by the target's token at the first
    mismatch. ``len(target_argmax) == len(drafts) + 1``."""
    out = []
    for j, d in enumerate(drafts):
        if d != target_argmax[j]:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def accept_tree_greedy(tokens: list[int], parents: list[int],
                       target_argmax: list[int]) -> tuple[list[int], list[int]]:
    """The accepted path of one draft tree and the tokens to commit.

    ``tokens[j]`` is node ``j``'s token (node 0, the root, is the bonus), ``parents[j]`` its
    parent (``< j``; -1 for the root), ``target_argmax[j]`` the target's argmax at node ``j``.
    Returns the path's node indices (from the root; ``A`` of them) and the ``A`` tokens to
    commit: the accepted nodes' tokens, then the target's argmax at the path's last node.
    """
    path = [0]
    while True:
        want = target_argmax[path[-1]]
        child = next((c for c in range(path[-1] + 1, len(tokens))
                      if parents[c] == path[-1] and tokens[c] == want), None)
        if child is None:
            return path, [*(tokens[c] for c in path[1:]), want]
        path.append(child)


def accept_tree_sampled(tokens: list[int], parents: list[int], p: torch.Tensor,
                        generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Lossless sampling over one draft tree (see the module docstring).

    ``tokens`` and ``parents`` as in :func:`accept_tree_greedy` (siblings have distinct
    tokens); ``p``: the target's distribution at each node ``[N, V]``. Returns the accepted
    path's node indices and the tokens to commit.
    """
    path: list[int] = [0]
    out: list[int] = []
    while True:
        dist = p[path[-1]].clone()  # [V] what is left of the target's distribution
        child = None
        for c in range(path[-1] + 1, len(tokens)):
            if parents[c] != path[-1]:
                continue
            x = tokens[c]
            if torch.rand((), generator=generator).item() < float(dist[x]):
                child = c
                break
            dist[x] = 0.0
            total = float(dist.sum())
            dist = dist / total if total > 0 else p[path[-1]]  # 0 only by float rounding
        if child is None:
            out.append(int(torch.multinomial(dist, 1, generator=generator).item()))
            return path, out
        path.append(child)
        out.append(tokens[child])


def accept_sampled(
    drafts: list[int],
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Lossless speculative sampling of one request.

    ``p``: target distributions ``[K + 1, V]`` (row ``j`` is the distribution of the token
    after the ``j``-th verified token); ``q``: the draft distributions ``[K, V]`` that
    ``drafts`` were sampled from. Returns the tokens to commit (accepted drafts + one more).
    """
    out = []
    for j, d in enumerate(drafts):
        u = torch.rand((), generator=generator).item()
        pd, qd = float(p[j, d]), float(q[j, d])
        if qd > 0 and u * qd < pd:
            out.append(d)
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator).item()))
    return out
