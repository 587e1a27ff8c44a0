"""The EAGLE draft model next to a target model: its KV pool and its forward over the rows the
target just computed (the draft prefill).

The draft pool mirrors the target pool's pages (a request's ``page_ids`` index both), with one
layer whose global id is the draft band ``num_hidden_layers + 0``, so a prefill node can push the
draft KV next to the target's and a decode node receives it in the matching buffers.
:class:`DraftHead` is that pool and forward beside any target pool (a whole model's, or the last
pipeline stage's share); :class:`DraftRunner` adds the draft prefill over an engine's steps.

Whatever the draft (EAGLE-1/2 or EAGLE-3), what passes between the target and the draft is a
*feature* of the target's hidden size: the target's final hidden state, or for an EAGLE-3 draft
its ``fc`` over the outputs of three target layers (:meth:`DraftHead.target_feature`). The draft
prefill's seed, the aux row and the decode loop's buffers all carry that size.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBatch
from engine.attention.select import make_attention
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.errors import ConfigError
from engine.kv.pool import KVPool
from engine.models.eagle.eagle3 import Draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.parallel.driver import TPDriver
from engine.parallel.messages import Command
from engine.runner.model_runner import StepForward

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine  # the engine a draft runs beside (above this room)


def draft_row_ids(prompt: Sequence[int], start: int, num_tokens: int,
                  first_token: int | None) -> list[int]:
    """The token ids of a chunk's draft rows ``[start, start + num_tokens)``: row ``p`` takes
    token ``p + 1``, the prompt's, or past its end ``first_token`` (the sampled first token; only
    the prompt's last chunk needs it)."""
    end = start + num_tokens
    ids = list(prompt[start + 1 : end])
    if end < len(prompt):
        ids.append(prompt[end])
    else:
        assert first_token is not None, "the prompt's last chunk needs the sampled first token"
        ids.append(first_token)
    return ids


class DraftHead:
    """An EAGLE draft beside a target's KV pool: a one-layer draft pool mirroring
    ``target_pool``'s pages, and the draft's forward (which embeds with ``target``'s
    embedding).

    Beside a tensor-parallel target (``peers``: its other ranks), ``draft`` holds rank 0's
    share of its layer (:func:`engine.models.eagle.loader.load_draft` with the target's group), the
    pool rank 0's key/value heads, and every forward runs the layer on every rank (each rank
    holds the draft's share and its pool, :mod:`engine.parallel.rank`)."""

    def __init__(self, draft: Draft, target: Qwen2VLModel, target_pool: KVPool,
                 peers: TPDriver | None = None) -> None:
        if (peers is not None) != (target.tp.size > 1):
            raise ConfigError("a draft beside a tensor-parallel target needs its other ranks")
        draft.cfg.check_target(target.cfg.text)
        self.draft, self.target, self.peers = draft, target, peers
        p = target_pool
        self.pool = KVPool(p.num_pages, p.page_size, p.num_kv_heads, p.head_dim,
                           [draft.cfg.layer_id], p.dtype, p.device)
        self.attn = make_attention(self.pool)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, features: torch.Tensor, mrope: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """Draft rows ``(embedding of ids[t], features[t])`` at ``mrope`` ``[3, T]``, KV written at
        ``batch.slot_mapping``; returns the output features ``[T, H]``."""
        self.attn.prepare(batch)
        x = self.draft.layer_input(self.target.embed(ids), features)
        # under TP the other ranks run their share of the layer on the same rows
        peers = nullcontext() if self.peers is None else self.peers.step(x, mrope, batch,
                                                                          Command.DRAFT)
        with peers:
            return self.draft.finish(self.draft.run_layer(x, mrope, self.attn))

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the draft fuses (empty unless EAGLE-3)."""
        return self.draft.cfg.aux_layer_ids

    def target_feature(self, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The feature target rows hand the draft, from their final hidden states ``[T, H]`` and
        the outputs of :attr:`aux_layers` ``[T, 3H]`` (``[T, 0]`` for an EAGLE-1/2 draft)."""
        return self.draft.target_feature(hidden, aux)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, V]`` over the target's vocabulary of draft output features."""
        return self.draft.logits(features, self.target)

    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """The argmax of :meth:`logits` per row ``[n]`` int64 (a draft with its own vocabulary
        skips building the full rows)."""
        return self.draft.greedy_tokens(features, self.target)


class DraftRunner(DraftHead):
    """A :class:`DraftHead` beside an :class:`LLMEngine`'s pool, run over the engine's steps."""

    def __init__(self, engine: LLMEngine, draft: Draft) -> None:
        if engine.tp is not None and engine.draft_dir is None:
            raise ConfigError("a draft beside a tensor-parallel engine must be given to the "
                              "engine (LLMEngine(..., draft=DIR)), so its ranks hold their share")
        super().__init__(draft, engine.model, engine.pool, engine.runner.peers)
        self.engine = engine
        engine.runner.aux_layers = self.aux_layers  # every forward returns what the draft fuses
        cache = engine.scheduler.prefix_cache
        if cache is not None:
            # the draft's KV shares the target's page ids, and a block's last draft row depends
            # on the token after the block: key blocks by it too, so a hit skips the draft's
            # compute with the draft KV it would have written (engine/core/prefix_cache.py)
            cache.set_draft_mode(True)

    def pools(self) -> list[KVPool]:
        """The target's KV pool, then the draft's (what the transfer layer registers)."""
        return [self.engine.pool, self.pool]

    @torch.inference_mode()
    def prefill(self, out: SchedulerOutput, samples: list[tuple[int, float]],
                fwd: StepForward) -> dict[str, torch.Tensor]:
        """The draft over the chunk rows the target just computed (:func:`draft_row_ids`; the
        prompt's last chunk pairs its last row with the sampled first token), at each row's own
        position and KV slot.

        Returns, per request whose prompt ended in this step, the feature of its last row (it
        predicts the first draft token). The draft pool mirrors the target's pages, so the
        target's attention batch (slots, page tables, lengths) serves the draft unchanged.
        """
        ids: list[int] = []
        bonus = iter(samples)
        last: list[tuple[Request, int]] = []
        for item in out.items:
            first = next(bonus)[0] if item.needs_sample else None
            ids += draft_row_ids(item.request.prompt_token_ids, item.start, item.num_tokens,
                                 first)
            if item.needs_sample:
                last.append((item.request, len(ids) - 1))
        ids_t = torch.tensor(ids, device=self.pool.device)
        feats = self.forward(ids_t, self.target_feature(fwd.hidden, fwd.aux), fwd.mrope,
                             fwd.batch)
        return {r.request_id: feats[row] for r, row in last}
