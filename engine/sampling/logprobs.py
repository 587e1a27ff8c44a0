"""Log-probabilities beyond the sampled token's: the alternatives a request asks for with
``top_logprobs``, and its prompt's log-probabilities (``prompt_logprobs``).

Both are under the model's own distribution (``log_softmax`` of the raw logits, as the
sampled token's log-probability in :mod:`engine.sampling.sampler`), so they compare with a
reference model's directly. Only the rows that ask are normalized, and each result comes to the
host in one copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.request import Request, TopLogprobs
from engine.core.scheduler import SchedulerOutput

PROMPT_ROWS = 256  # prompt positions normalized at a time: [rows, vocab] float32 each


def top_logprobs(logits: torch.Tensor, ks: list[int]) -> list[TopLogprobs | None]:
    """The ``ks[i]`` most likely tokens of row ``i`` of the raw ``logits`` ``[n, V]`` with their
    log-probabilities, most likely first (None where ``ks[i]`` is 0; no work when no row
    asks)."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    out: list[TopLogprobs | None] = [None] * len(ks)
    if not rows:
        return out
    picked = logits[rows] if len(rows) < len(ks) else logits
    values, ids = torch.log_softmax(picked.float(), dim=-1).topk(max(ks[i] for i in rows), dim=-1)
    for j, (vals, toks) in enumerate(zip(*_to_host(values, ids), strict=True)):
        k = ks[rows[j]]
        out[rows[j]] = TopLogprobs(tuple(toks[:k]), tuple(vals[:k]))
    return out


def record_prompt_logprobs(out: SchedulerOutput, hidden: torch.Tensor,
                           logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append to each request of ``out`` that asks for ``prompt_logprobs`` the log-probability
    (and alternatives) of every prompt token its chunk predicts: position ``p``'s logits score
    prompt token ``p + 1``. ``hidden`` ``[T, H]`` holds the step's final hidden states, item
    after item; ``logits_of`` is the model's head. A chunk computed again (a request run again
    from its start) overwrites what an earlier pass recorded from its start on."""
    offset = 0
    for item in out.items:
        req, start = item.request, item.start
        end = min(item.start + item.num_tokens, req.num_prompt_tokens - 1)
        k = req.sampling.prompt_logprobs
        if k is not None and start < end:
            del req.prompt_logprobs[start:], req.prompt_top_logprobs[start:]
            for lo in range(start, end, PROMPT_ROWS):
                hi = min(lo + PROMPT_ROWS, end)
                rows = hidden[offset + lo - start : offset + hi - start]
                _record(req, logits_of(rows), req.prompt_token_ids[lo + 1 : hi + 1], k)
        offset += item.num_tokens


def _record(req: Request, logits: torch.Tensor, targets: list[int], k: int) -> None:
    """Append the log-probabilities of ``targets`` under ``logits`` ``[n, V]`` (row ``i``
    scores ``targets[i]``) and their ``k`` alternatives to ``req``'s prompt record."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
    picked = logprobs.gather(1, index)  # [n, 1]
    values, ids = logprobs.topk(k, dim=-1) if k else (picked[:, :0], index[:, :0])
    host_values, host_ids = _to_host(torch.cat((picked, values), dim=1),
                                     torch.cat((index, ids), dim=1))
    for vals, toks in zip(host_values, host_ids, strict=True):
        req.prompt_logprobs.append(vals[0])
        if k:
            req.prompt_top_logprobs.append(TopLogprobs(tuple(toks[1:]), tuple(vals[1:])))


def _to_host(values: torch.Tensor, ids: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
    """``values`` float32 and ``ids`` int64 ``[n, k]`` as lists, in one device -> host copy
    (token ids below 2**24 are exact in float32)."""
    host = torch.stack((values, ids.to(values.dtype))).cpu()  # [2, n, k]
    return host[0].tolist(), host[1].long().tolist()
