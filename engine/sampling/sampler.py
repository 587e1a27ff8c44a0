"""Token sampling: greedy, temperature, top-k, top-p and min-p, with per-request generators.

Tokens are chosen from ``scores``: the raw logits with the request's penalties applied
(:mod:`engine.sampling.penalties`; the raw logits themselves when there are none). Greedy rows take
the argmax of the scores; other rows divide them by the temperature and apply top-k, then top-p,
then min-p (the order and rules of :class:`engine.core.request.SamplingParams`). The returned
log-probability of each chosen token is always under the model's own distribution
(``log_softmax`` of the raw logits at temperature 1), whatever penalties or filters picked it:
it is what the model thinks of the text, comparable across requests and settings (so are the
alternatives of :mod:`engine.sampling.logprobs`). Rows with a
generator are sampled one by one with that generator, so a seeded request's token depends only on
its own logits and seed, never on the rest of the batch; rows without one share a single draw of
uniforms from the global RNG. A draw is one uniform per row, placed on the row's cumulative
distribution (:func:`inverse_cdf`): ``torch.multinomial`` (and the exponential race) draws
randomness for every token of the vocabulary: 3.2 ms a row of 151,936 tokens on this project's
2-core CPU, 98 ms for a batch of 32 (about a decode step), against 8 ms for those 32 this way.

Everything runs on the logits' device (a request's generator must live there too: see
:func:`make_generator`), and :meth:`Sampler.sample` copies its result to the host once: tokens
and log-probabilities travel together in one tensor, which is the step's only device -> host
synchronisation. Logits already on the CPU need no copy: there the argmax and the pick of each
chosen token's log-probability run in numpy over the tensors' own memory (a few torch calls
fewer per step, the same values: numpy's argmax also returns the first maximum, NaN included).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.request import SamplingParams

Picked = tuple[torch.Tensor, torch.Tensor] | None  # non-greedy rows [m] and their tokens [m]


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator on ``device`` (the engine's: where the logits are sampled) seeded with
    ``seed``; None when ``seed`` is None (use the global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    """Picks one token per row of a logits batch."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        scores: torch.Tensor | None = None,
    ) -> tuple[list[int], list[float]]:
        """Sample one token per row.

        Args:
            logits: ``[n, V]`` raw logits (float32 preferred; other dtypes are upcast).
            params: one :class:`SamplingParams` per row.
            generators: one generator (or None for the global RNG) per row.
            scores: ``[n, V]`` the penalized logits tokens are chosen from (default: ``logits``).
        Returns:
            ``(token_ids, logprobs)``, each of length ``n``; logprobs are of the raw logits.
        """
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(f"{n} logit rows but {len(params)} params, {len(generators)} gens")
        if n == 0:
            return [], []
        logits = logits.float()
        scores = logits if scores is None else scores.float()
        logprobs = torch.log_softmax(logits, dim=-1)  # [n, V]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        picked: Picked = None
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=logits.device)
            picked = idx, self._sample_rows(scores[idx], [params[i] for i in sampled_rows],
                                            [generators[i] for i in sampled_rows])
        if logits.device.type == "cpu":
            return _pick_on_host(scores, logprobs, picked)
        return _pick_on_device(scores, logprobs, picked)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw: ``logits [m, V]`` -> tokens
        ``[m]``."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits / temps.unsqueeze(1)  # [m, V]
        if any(_filters(p) for p in params):
            probs, order = _filtered_sorted_probs(scaled, params)  # [m, V] each, sorted desc
        else:
            probs, order = torch.softmax(scaled, dim=-1), None
        picked = _multinomial(probs, generators)  # [m]
        if order is None:
            return picked
        return order.gather(1, picked.unsqueeze(1)).squeeze(1)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from (temperature, top-k, top-p, min-p applied to
    ``logits``, penalized already if the request has penalties), normalised, in vocabulary order:
    ``logits [m, V]`` -> ``[m, V]``. Rows must not be greedy."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits.float() / temps.unsqueeze(1)
    if not any(_filters(p) for p in params):
        return torch.softmax(scaled, dim=-1)
    sorted_probs, order = _filtered_sorted_probs(scaled, params)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _filtered_sorted_probs(
    scaled: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort rows descending and keep top-k, then the smallest top-p nucleus, then the tokens with
    at least ``min_p`` times the top probability (always >= 1 token).

    Returns probabilities over the sorted order (not renormalised) and the permutation
    (``[m, V]`` each).
    """
    m, vocab = scaled.shape
    device = scaled.device
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    rank = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(rank >= ks.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [m, V]
    top_ps = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)  # [m, 1]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    drop = (mass_before >= top_ps) & (top_ps < 1.0)
    min_ps = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)  # [m, 1]
    drop |= probs < min_ps * probs[:, :1]  # ratios survive the top-k/top-p renormalisation
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    return probs, order


CDF_ROWS = 8  # rows per cumulative sum on the CPU (a [8, 151936] float64 block: 9.7 MB)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw from each row of ``probs`` ``[m, V]`` (non-negative weights; a row need not
    sum to 1) given ``u`` ``[m]`` uniforms in ``[0, 1)``: the first token whose cumulative
    weight exceeds ``u`` times the row's total, int64 ``[m]``. Token ``t`` is drawn with
    probability ``probs[t] / total``; a token of weight 0 never is. The sums are float64; on
    the CPU ``CDF_ROWS`` rows at a time (a whole batch's float64 sums would be allocated
    afresh, page by page, on every step)."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    last = probs.shape[1] - 1
    block = CDF_ROWS if probs.device.type == "cpu" else max(1, probs.shape[0])
    for start in range(0, probs.shape[0], block):
        rows = slice(start, start + block)
        cdf = probs[rows].cumsum(-1, dtype=torch.float64)  # [r, V]
        target = u[rows].to(torch.float64).unsqueeze(1) * cdf[:, -1:]  # [r, 1]
        out[rows] = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=last)
    return out


def _multinomial(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of ``probs`` ``[m, V]``: the unseeded rows' uniforms in one call on the
    global RNG, a seeded row's from its generator (:func:`inverse_cdf`)."""
    u = torch.empty(probs.shape[0], dtype=torch.float64, device=probs.device)
    free_rows = [i for i, g in enumerate(generators) if g is None]
    if free_rows:
        u[free_rows] = torch.rand(len(free_rows), dtype=torch.float64, device=probs.device)
    for i, gen in enumerate(generators):
        if gen is not None:  # stays on the device: no .item()
            u[i : i + 1] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device)
    return inverse_cdf(probs, u)


def _to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """``tokens`` ``[n]`` int64 and ``logprobs`` ``[n]`` float32 as Python lists, in one
    device -> host copy: the log-probabilities ride along as their float32 bit patterns in an
    int64 row, so both come back exactly."""
    bits = logprobs.contiguous().view(torch.int32).to(torch.int64)  # [n]
    host = torch.stack((tokens, bits)).cpu()  # [2, n]: the one copy
    return host[0].tolist(), host[1].to(torch.int32).view(torch.float32).tolist()


def _pick_on_device(
    logits: torch.Tensor, logprobs: torch.Tensor, picked: Picked
) -> tuple[list[int], list[float]]:
    """Each row's token (the argmax, or ``picked``'s token at ``picked``'s rows) and its
    log-probability, from ``logits`` and ``logprobs`` ``[n, V]`` on any device, brought to the
    host in one copy."""
    tokens = torch.argmax(logits, dim=-1)  # [n]; greedy rows are done
    if picked is not None:
        tokens[picked[0]] = picked[1]
    token_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [n] float32
    return _to_host(tokens, token_lp)


def _pick_on_host(
    logits: torch.Tensor, logprobs: torch.Tensor, picked: Picked
) -> tuple[list[int], list[float]]:
    """:func:`_pick_on_device` for CPU tensors, with the same result: the argmax and the pick
    of each token's log-probability run in numpy over the tensors' memory (no copy)."""
    tokens = _array(logits).argmax(axis=1)  # [n] int64
    if picked is not None:
        tokens[_array(picked[0])] = _array(picked[1])
    token_lp = _array(logprobs)[np.arange(tokens.shape[0]), tokens]  # [n] float32
    return tokens.tolist(), token_lp.tolist()


def _array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of CPU tensor ``t``."""
    return (t.detach() if t.requires_grad else t).numpy()
