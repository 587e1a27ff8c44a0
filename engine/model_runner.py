"""Turns one scheduler step into one model forward and returns the logits to sample from.

Per step it builds, for the flat batch of ``T`` scheduled tokens: token ids ``[T]``, the 1-D
positions ``[T]`` (absolute token index), the mrope positions ``[3, T]`` derived from them (the
prompt's rope table for prompt tokens of image requests), the KV slots ``[T]``, and the attention
batch. Vision embeddings are computed when a request's first prompt chunk runs and dropped when
its prompt is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionBatch
from engine.inputs import RequestState
from engine.models.qwen2_vl import Qwen2VLModel
from engine.mrope import mrope_from_1d
from engine.scheduler import ScheduledItem, SchedulerOutput


@dataclass
class StepForward:
    """One forward's tensors, kept for whoever runs after the target (the draft model)."""

    input_ids: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] final-normed hidden states
    mrope: torch.Tensor  # [3, T] the positions the forward used
    slots: torch.Tensor  # [T] KV slots written
    sample_rows: list[int]  # rows whose logits are sampled, in item order


class ModelRunner:
    """Runs the model over scheduled items; owns no request state."""

    def __init__(self, model: Qwen2VLModel, attn: AttentionBackend) -> None:
        self.model = model
        self.attn = attn
        self.page_size = attn.pool.page_size
        self.image_token_id = model.cfg.image_token_id

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward the step's tokens; returns float32 logits ``[num_samples, vocab]`` in item
        order (one row per item with ``needs_sample``)."""
        fwd = self.run(out)
        return self.model.logits(fwd.hidden[fwd.sample_rows])

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepForward:
        """Forward the step's tokens; the hidden states and positions of every token."""
        ids: list[int] = []
        pos: list[int] = []
        deltas: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        ps = self.page_size
        for item in out.items:
            req, s, n = item.request, item.start, item.num_tokens
            ids.extend(_token_slice(item))
            pos.extend(range(s, s + n))
            deltas.extend([_state(item).delta] * n)
            pages = req.page_ids
            slots.extend(pages[i // ps] * ps + i % ps for i in range(s, s + n))
            if item.needs_sample:
                sample_rows.append(len(ids) - 1)
        ids_t, pos_t, deltas_t, slots_t = torch.tensor([ids, pos, deltas, slots]).unbind(0)
        mrope = mrope_from_1d(pos_t, deltas_t)  # [3, T]
        embeds = self.model.embed(ids_t)  # [T, H]
        mrope = self._prompt_positions(out.items, mrope, embeds, ids_t)
        batch = AttentionBatch.from_lists(
            q_lens=[it.num_tokens for it in out.items],
            kv_lens=[it.start + it.num_tokens for it in out.items],
            page_tables=[it.request.page_ids for it in out.items],
            slot_mapping=slots_t,
        )
        hidden = self.forward_embeds(embeds, mrope, batch)
        return StepForward(ids_t, hidden, mrope, slots_t, sample_rows)

    @torch.inference_mode()
    def forward_embeds(
        self, embeds: torch.Tensor, mrope: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """The target model over explicit inputs: ``embeds`` ``[T, H]`` at ``mrope`` ``[3, T]``,
        K/V written at ``batch.slot_mapping``; returns hidden states ``[T, H]``."""
        self.attn.prepare(batch)
        return self.model(embeds, mrope, self.attn)

    def _prompt_positions(
        self,
        items: list[ScheduledItem],
        mrope: torch.Tensor,
        embeds: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """Put image embeddings and the prompt's rope table in place for image prompt chunks."""
        offset = 0
        copied = False
        for item in items:
            state = _state(item)
            prompt_len = item.request.num_prompt_tokens
            s, n = item.start, item.num_tokens
            if state.mrope_table is not None and s < prompt_len:
                k = min(n, prompt_len - s)
                if not copied:
                    mrope, copied = mrope.contiguous(), True
                mrope[:, offset : offset + k] = state.mrope_table[:, s : s + k]
                chunk = slice(offset, offset + k)
                self._place_image_embeds(state, embeds[chunk], ids[chunk], s)
                if s + k == prompt_len:
                    state.image_embeds = None
                    state.images = []
            offset += n
        return mrope

    def _place_image_embeds(
        self, state: RequestState, embeds: torch.Tensor, ids: torch.Tensor, start: int
    ) -> None:
        if state.image_prefix is None:
            return
        mask = ids == self.image_token_id
        count = int(mask.sum())
        if not count:
            return
        if state.image_embeds is None:
            patches = torch.cat([im.patches for im in state.images])
            grids = [im.grid_thw for im in state.images]
            state.image_embeds = self.model.encode_images(patches, grids)
        first = int(state.image_prefix[start])
        embeds[mask] = state.image_embeds[first : first + count]


def _state(item: ScheduledItem) -> RequestState:
    state = item.request.payload
    assert isinstance(state, RequestState), "requests must carry a RequestState payload"
    return state


def _token_slice(item: ScheduledItem) -> list[int]:
    """Token ids ``[start, start + num_tokens)`` of the item's request, without copying it all."""
    req, s, e = item.request, item.start, item.start + item.num_tokens
    prompt = req.prompt_token_ids
    if e <= len(prompt):
        return prompt[s:e]
    out = req.output_token_ids
    if s >= len(prompt):
        return out[s - len(prompt) : e - len(prompt)]
    return prompt[s:] + out[: e - len(prompt)]
