"""The EAGLE draft model next to a target engine: its KV pool and its forward over the rows the
target just computed (the draft prefill).

The draft pool mirrors the target pool's pages (a request's ``page_ids`` index both), with one
layer whose global id is the draft band ``num_hidden_layers + 0``, so a prefill node can push the
draft KV next to the target's and a decode node receives it in the matching buffers.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBatch
from engine.attention_select import make_attention
from engine.kv_cache import BufferInfo, KVPool
from engine.llm_engine import LLMEngine
from engine.model_runner import StepForward
from engine.models.eagle import EagleDraft
from engine.request import Request
from engine.scheduler import SchedulerOutput


class DraftRunner:
    def __init__(self, engine: LLMEngine, draft: EagleDraft) -> None:
        draft.cfg.check_target(engine.model_config.text)
        self.engine, self.draft = engine, draft
        pool = engine.pool
        self.pool = KVPool(pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim,
                           [draft.cfg.layer_id], pool.dtype, pool.device)
        self.attn = make_attention(self.pool)
        cache = engine.scheduler.prefix_cache
        if cache is not None:
            # the draft's KV shares the target's page ids, and a block's last draft row depends
            # on the token after the block: key blocks by it too, so a hit skips the draft's
            # compute with the draft KV it would have written (engine/prefix_cache.py)
            cache.set_draft_mode(True)

    def buffer_infos(self) -> list[BufferInfo]:
        """The target's KV buffer entries followed by the draft's (what the transfer layer
        registers)."""
        return [*self.engine.pool.buffer_infos(), *self.pool.buffer_infos()]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, features: torch.Tensor, mrope: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """Draft rows ``(embedding of ids[t], features[t])`` at ``mrope`` ``[3, T]``, KV written at
        ``batch.slot_mapping``; returns the output features ``[T, H]``."""
        self.attn.prepare(batch)
        return self.draft(self.engine.model.embed(ids), features, mrope, self.attn)

    @torch.inference_mode()
    def prefill(self, out: SchedulerOutput, samples: list[tuple[int, float]],
                fwd: StepForward) -> dict[str, torch.Tensor]:
        """The draft over the chunk rows the target just computed: row ``p`` pairs the target
        feature of ``p`` with token ``p + 1`` (the next chunk's first token, or the sampled first
        token on the prompt's last chunk), at row ``p``'s own position and KV slot.

        Returns, per request whose prompt ended in this step, the feature of its last row (it
        predicts the first draft token). The draft pool mirrors the target's pages, so the
        target's attention batch (slots, page tables, lengths) serves the draft unchanged.
        """
        ids: list[int] = []
        bonus = iter(samples)
        last: list[tuple[Request, int]] = []
        for item in out.items:
            prompt, end = item.request.prompt_token_ids, item.start + item.num_tokens
            ids += prompt[item.start + 1 : end]
            ids.append(prompt[end] if end < len(prompt) else next(bonus)[0])
            if item.needs_sample:
                last.append((item.request, len(ids) - 1))
        ids_t = torch.tensor(ids, device=self.pool.device)
        feats = self.forward(ids_t, fwd.hidden, fwd.mrope, fwd.batch)
        return {r.request_id: feats[row] for r, row in last}
