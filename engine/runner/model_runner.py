"""Turns one scheduler step into one model forward and returns the logits to sample from.

Per step it gathers, for the flat batch of ``T`` scheduled tokens, from the persistent batch
(:class:`engine.runner.input_batch.InputBatch`, rows given by the scheduler): token ids ``[T]``, the
1-D positions ``[T]`` (absolute token index), the KV slots ``[T]`` and the page tables; then the
mrope positions ``[3, T]`` derived from the positions (the prompt's rope table for prompt tokens
of image and video requests) and the attention batch. Python work per step is O(items), never
O(tokens). Vision embeddings (images and videos, encoded together in prompt order) are computed
when a request's first prompt chunk with vision tokens runs and dropped when its prompt is done;
a Qwen3-VL chunk also takes the DeepStack features of its visual tokens (:class:`StepExtras`).

Hybrid models (``states`` set): each forward names its sequences' state slots, and the slot of a
request whose computation starts at token 0 (a fresh prompt, or one resumed from scratch) is
zeroed first, so a request never sees an earlier holder's state; a request resuming from a
prefix hit takes its state checkpoint instead, and a chunk ending at a checkpoint boundary has
its slot copied into the checkpoint after the forward (``engine/core/state_checkpoints.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.attention.backend import AttentionBackend, AttentionBatch
from engine.attention.linear.states import LinearStates
from engine.core.request import TopLogprobs
from engine.core.scheduler import ScheduledItem, SchedulerOutput
from engine.kv.pool import move_kv
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.step_extras import NO_EXTRAS, StepExtras
from engine.multimodal.inputs import RequestState
from engine.multimodal.mrope import mrope_from_1d
from engine.parallel.driver import TPDriver
from engine.parallel.messages import StateStep
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.input_batch import InputBatch


@dataclass
class StepForward:
    """One forward's tensors, kept for whoever runs after the target (the draft model)."""

    input_ids: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] final-normed hidden states
    mrope: torch.Tensor  # [3, T] the positions the forward used
    slots: torch.Tensor  # [T] KV slots written
    sample_rows: torch.Tensor | slice  # [S] int64 rows whose logits are sampled, in item order
    # (``slice(None)`` when every row is, in order): index ``hidden`` with it
    batch: AttentionBatch  # the forward's attention inputs (a draft over the same rows reuses it)
    # [T, 3H] outputs of the runner's ``aux_layers`` (an EAGLE-3 draft's), [T, 0] without any
    aux: torch.Tensor
    # the sampled rows' alternatives, in sample order, set by the engine once it sampled
    # (engine.sampling.logprobs.top_logprobs; None for a request that asks for none)
    tops: list[TopLogprobs | None] = field(default_factory=list)


class ModelRunner:
    """Runs the model over scheduled items; its persistent batch mirrors the running requests'
    page tables (the scheduler's ``page_ids`` stay the source of truth)."""

    def __init__(self, model: Qwen2VLModel, attn: AttentionBackend) -> None:
        self.model = model
        self.attn = attn
        self.page_size = attn.pool.page_size
        self.image_token_id = model.cfg.image_token_id
        self.video_token_id = model.cfg.video_token_id
        self.batch = InputBatch(self.page_size, attn.pool.device)
        # decode steps through static buffers (CUDA graphs); None: every step runs eagerly
        self.decode_graphs: DecodeGraphs | None = None
        # the other tensor-parallel ranks, which run every forward with this one; None: no TP
        self.peers: TPDriver | None = None
        # target layers whose outputs every forward also returns (set by an EAGLE-3 draft)
        self.aux_layers: tuple[int, ...] = ()
        # a hybrid model's state pool (None for a model without linear attention)
        self.states: LinearStates | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward the step's tokens; returns float32 logits ``[num_samples, vocab]`` in item
        order (one row per item with ``needs_sample``)."""
        fwd = self.run(out)
        return self.model.logits(fwd.hidden[fwd.sample_rows])

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepForward:
        """Forward the step's tokens; the hidden states and positions of every token."""
        step = self.batch.prepare(out.items)
        mrope = mrope_from_1d(step.positions, step.deltas)  # [3, T]
        batch = step.attention
        graphs = self.decode_graphs
        if graphs is not None and not self.aux_layers and _pure_decode(out.items, batch, graphs):
            hidden = graphs.run(step.input_ids, mrope, batch.kv_lens, batch.max_kv,
                                batch.page_table, batch.slot_mapping)
            aux = hidden[:, :0]
        else:
            embeds = self.model.embed(step.input_ids)  # [T, H]
            mrope, extras = self._prompt_positions(out.items, mrope, embeds, step.input_ids)
            states = None
            if self.states is not None:
                states = _state_step(out.items)
                extras = replace(extras, states=states.apply(self.states))
            hidden, aux = self.forward_embeds_aux(embeds, mrope, batch, extras, states)
            if states is not None and self.states is not None:
                states.saved(self.states)
        return StepForward(step.input_ids, hidden, mrope, batch.slot_mapping, step.sample_rows,
                           batch, aux)

    @torch.inference_mode()
    def forward_embeds(
        self, embeds: torch.Tensor, mrope: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """The target model over explicit inputs: ``embeds`` ``[T, H]`` at ``mrope`` ``[3, T]``,
        K/V written at ``batch.slot_mapping``; returns hidden states ``[T, H]``."""
        return self.forward_embeds_aux(embeds, mrope, batch)[0]

    @torch.inference_mode()
    def forward_embeds_aux(
        self, embeds: torch.Tensor, mrope: torch.Tensor, batch: AttentionBatch,
        extras: StepExtras = NO_EXTRAS, states: StateStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_embeds`, also returning the outputs of ``aux_layers``
        ``[T, len(aux_layers) * H]`` (:meth:`Qwen2VLModel.forward_aux`). ``extras``: the
        forward's DeepStack features and this rank's prepared state pool; ``states``: the state
        step that prepared it, which the other tensor-parallel ranks apply to their pools."""
        self.attn.prepare(batch)
        if self.peers is None:
            return self._forward(embeds, mrope, extras)
        with self.peers.step(embeds, mrope, batch, extras=extras, states=states):
            return self._forward(embeds, mrope, extras)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the target K/V of slots ``src`` ``[M]`` to ``dst`` ``[M]`` (int64, on the pool's
        device), in every rank's pool (:func:`engine.kv.pool.move_kv`)."""
        if self.peers is not None:
            self.peers.move_kv(src, dst)
        move_kv(self.attn.pool, src, dst)

    def _forward(self, embeds: torch.Tensor, mrope: torch.Tensor, extras: StepExtras
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.aux_layers:  # the model's plain call (a pipeline stage stands in for it)
            hidden = self.model(embeds, mrope, self.attn, extras)
            return hidden, hidden[:, :0]
        return self.model.forward_aux(embeds, mrope, self.attn, self.aux_layers, extras)

    def _prompt_positions(
        self,
        items: list[ScheduledItem],
        mrope: torch.Tensor,
        embeds: torch.Tensor,
        ids: torch.Tensor,
    ) -> tuple[torch.Tensor, StepExtras]:
        """Put vision embeddings and the prompt's rope table in place for image and video prompt
        chunks; the DeepStack rows and features of their visual tokens (Qwen3-VL)."""
        offset = 0
        copied = False
        stack_rows: list[torch.Tensor] = []
        stack_feats: list[tuple[torch.Tensor, ...]] = []
        for item in items:
            prompt_len = len(item.request.prompt_token_ids)
            s, n = item.start, item.num_tokens
            if s >= prompt_len:  # past the prompt: positions from the 1-D ones
                offset += n
                continue
            state = _state(item)
            if state.mrope_table is not None:
                k = min(n, prompt_len - s)
                if not copied:
                    mrope, copied = mrope.contiguous(), True
                mrope[:, offset : offset + k] = state.mrope_table[:, s : s + k]
                chunk = slice(offset, offset + k)
                placed = self._place_vision_embeds(state, embeds[chunk], ids[chunk], s)
                if placed is not None and placed[1]:
                    stack_rows.append(placed[0] + offset)
                    stack_feats.append(placed[1])
                if s + k == prompt_len:
                    state.image_embeds = None
                    state.images = []
            offset += n
        if not stack_rows:
            return mrope, NO_EXTRAS
        layers = zip(*stack_feats, strict=True)  # per stacked layer, every chunk's features
        return mrope, StepExtras(torch.cat(stack_rows), tuple(torch.cat(f) for f in layers))

    def _place_vision_embeds(
        self, state: RequestState, embeds: torch.Tensor, ids: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Image and video tokens of a chunk starting at prompt index ``start`` take their
        embeddings, in prompt order. Returns the chunk rows ``[V]`` of those tokens and their
        DeepStack features (one ``[V, H]`` per stacked layer; none but Qwen3-VL's), or None
        when the chunk has no visual token."""
        if state.image_prefix is None:
            return None
        mask = (ids == self.image_token_id) | (ids == self.video_token_id)
        if start + len(ids) > state.vision_end:  # resumed output: text whatever its ids
            mask[max(0, state.vision_end - start):] = False
        count = int(mask.sum())
        if not count:
            return None
        if state.image_embeds is None:
            patches = torch.cat([im.patches for im in state.images])
            grids = [im.grid_thw for im in state.images]
            state.image_embeds = self.model.encode_images(patches, grids)
        first = int(state.image_prefix[start])
        visual = state.image_embeds
        embeds[mask] = visual.embeds[first : first + count]
        rows = mask.nonzero().squeeze(1)
        return rows, tuple(f[first : first + count] for f in visual.deepstack)


def _state_step(items: list[ScheduledItem]) -> StateStep:
    """The state pool's use by this forward: every item's rows and slot, the slots of items
    starting at token 0 to be zeroed first, the state checkpoints to restore and to save."""
    return StateStep.of(((it.num_tokens, it.request.state_slot, it.start) for it in items),
                        [(it.restore_from, it.request.state_slot) for it in items
                         if it.restore_from >= 0],
                        [(it.request.state_slot, it.save_to) for it in items if it.save_to >= 0])


def _state(item: ScheduledItem) -> RequestState:
    state = item.request.payload
    assert isinstance(state, RequestState), "requests must carry a RequestState payload"
    return state


def _pure_decode(items: list[ScheduledItem], batch: AttentionBatch, graphs: DecodeGraphs) -> bool:
    """Whether every item decodes one token past its prompt and the batch fits the graphs."""
    if batch.max_q != 1 or not graphs.fits(batch.num_seqs, batch.max_kv):
        return False
    return all(it.start >= len(it.request.prompt_token_ids) for it in items)
