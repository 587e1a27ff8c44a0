"""Repetition, frequency and presence penalties, and logit biases, on raw logits (rules:
``SamplingParams``).

A request with penalties gets a :class:`TokenHistory` on the logits' device the first time it is
sampled: which tokens its prompt holds (``[V]`` bool) and how often each token occurs in its
output (``[V]`` float32). Each later step adds only the output tokens that are new since then, so
a step costs O(new tokens) per penalized row, never O(history); rows without penalties cost
nothing but a flag check. The history lives in ``Request.history``, so it goes with the request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.request import Request, SamplingParams


class TokenHistory:
    """One request's prompt tokens (as a set) and output token counts, on one device.

    ``resumed`` (``SamplingParams.resumed_tokens``): the last ``resumed`` prompt tokens are
    output from before a failover, counted as output from the start.
    """

    def __init__(self, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device, resumed: int = 0) -> None:
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        if len(prompt_ids):
            self.prompt_seen[torch.tensor(list(prompt_ids), device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [V]
        self.synced = 0  # output tokens already counted
        if resumed:
            self.update(list(prompt_ids[len(prompt_ids) - resumed:]))
            self.synced = 0

    def update(self, output_ids: Sequence[int]) -> None:
        """Count ``output_ids[synced:]`` (outputs only ever grow)."""
        new = output_ids[self.synced:]
        if len(new):
            ids = torch.tensor(list(new), device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new), device=self.counts.device))
            self.synced = len(output_ids)


def history_of(req: Request, vocab_size: int, device: torch.device) -> TokenHistory:
    """``req``'s token history (made on first use, kept in ``req.history``), up to date with its
    output tokens."""
    hist = req.history
    if not isinstance(hist, TokenHistory):
        hist = req.history = TokenHistory(req.prompt_token_ids, vocab_size, device,
                                          req.sampling.resumed_tokens)
    hist.update(req.output_token_ids)
    return hist


def penalize(logits: torch.Tensor, params: Sequence[SamplingParams], seen: torch.Tensor,
             counts: torch.Tensor) -> torch.Tensor:
    """Penalized copy of ``logits`` ``[n, V]``: ``seen`` ``[n, V]`` bool marks the tokens of
    prompt and output (repetition penalty), ``counts`` ``[n, V]`` the output counts (frequency
    and presence penalties); one ``params`` per row, whose ``logit_bias`` is added last."""
    device = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    x = logits.float()
    scaled = torch.where(x > 0, x / rep, x * rep)  # [n, V]
    x = torch.where(seen, scaled, x)
    x = x - freq * counts - pres * (counts > 0).float()
    if any(p.logit_bias for p in params):
        x = x + _biases(params, x.shape[1], device)
    return x


def _biases(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, V]``: each row's ``logit_bias`` at its tokens, 0 elsewhere."""
    rows, tokens, values = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias:
            rows.append(i)
            tokens.append(token)
            values.append(value)
    out = torch.zeros(len(params), vocab, device=device)
    out[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = torch.tensor(
        values, device=device)
    return out


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[n, V]`` (one row per request) with each penalized row's penalties applied;
    ``logits`` itself (no copy) when no row has penalties."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.has_penalties]
    if not rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    hists = [history_of(reqs[i], vocab, device) for i in rows]
    counts = torch.stack([h.counts for h in hists])  # [m, V]
    seen = torch.stack([h.prompt_seen for h in hists]) | (counts > 0)  # [m, V]
    idx = torch.tensor(rows, device=device)
    out = logits.float().clone()
    out[idx] = penalize(out[idx], [reqs[i].sampling for i in rows], seen, counts)
    return out


def chain_scores(req: Request, drafts: Sequence[int] | torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
    """The verify logits ``[K + 1, V]`` of ``[b, d_1..d_K]`` that the target picks from: row
    ``j`` penalized with ``req``'s history plus ``d_1..d_j`` (what sampling right after ``d_j``
    would see), so speculative acceptance stays lossless under penalties; ``logits`` itself when
    ``req`` has none. ``drafts`` may be a tensor on the logits' device (nothing is read back)."""
    if not req.sampling.has_penalties:
        return logits
    seen, counts = _chain_rows(history_of(req, logits.shape[-1], logits.device), drafts)
    return penalize(logits, [req.sampling] * logits.shape[0], seen, counts)


def tree_scores(req: Request, tokens: Sequence[int] | torch.Tensor, mask: torch.Tensor,
                logits: torch.Tensor) -> torch.Tensor:
    """The verify logits ``[N, V]`` of a draft tree's nodes (node 0 the root, ``tokens[j]``
    node ``j``'s token, ``mask`` ``[N, N]`` bool its ancestors and itself): row ``j`` penalized
    with ``req``'s history plus the drafted tokens on node ``j``'s path; ``logits`` itself when
    ``req`` has none. ``tokens`` may be a tensor on the logits' device (nothing is read back)."""
    if not req.sampling.has_penalties:
        return logits
    hist = history_of(req, logits.shape[-1], logits.device)
    path = mask[:, 1:].float()  # [N, N - 1] the drafted nodes on each node's path
    dev, n = logits.device, len(tokens) - 1
    drafted = torch.zeros(n, logits.shape[-1], device=dev)  # [N - 1, V] one-hot node tokens
    drafted[torch.arange(n, device=dev), _ids(tokens, dev)[1:]] = 1.0
    counts = hist.counts.unsqueeze(0) + path.to(dev) @ drafted  # [N, V]
    seen = hist.prompt_seen.unsqueeze(0) | (counts > 0)
    return penalize(logits, [req.sampling] * logits.shape[0], seen, counts)


def _chain_rows(hist: TokenHistory, drafts: Sequence[int] | torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, counts)`` ``[K + 1, V]``: ``hist`` plus ``d_1..d_j`` on row ``j``."""
    device = hist.counts.device
    k = len(drafts)
    added = torch.zeros(k + 1, hist.counts.shape[0], device=device)  # [K + 1, V]
    if k:
        rows = torch.arange(1, k + 1, device=device)
        added[rows, _ids(drafts, device)] = 1.0
        added = added.cumsum(dim=0)
    counts = hist.counts.unsqueeze(0) + added
    seen = hist.prompt_seen.unsqueeze(0) | (counts > 0)
    return seen, counts


def _ids(tokens: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tokens`` as an int64 tensor on ``device`` (a tensor there already is used as is)."""
    return torch.as_tensor(tokens if isinstance(tokens, torch.Tensor) else list(tokens),
                           dtype=torch.int64, device=device)
