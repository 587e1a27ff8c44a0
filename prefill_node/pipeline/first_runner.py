"""The first stage's forward: the engine's input building (tokens, images, mrope) over the first
stage's layers only, returning the residual stream for the next stage instead of logits. With a
tensor-parallel engine every forward goes through its driver (the runner's ``peers``), so the
other ranks run the same layers over the same embeddings."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.backend import AttentionBackend
from engine.core.scheduler import SchedulerOutput
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.qwen2_vl.vision import Grid
from engine.models.step_extras import NO_EXTRAS, StepExtras, VisualEmbeds
from engine.runner.model_runner import ModelRunner
from prefill_node.pipeline.aux_layers import merge_aux


class _FirstStageModel:
    """What :class:`ModelRunner` calls as its model: embeddings as usual, but the decoder call
    runs only ``layers`` and keeps its output (``[T, H]``), positions (``[3, T]``) and the outputs
    of its layers among ``aux_ids`` (:mod:`prefill_node.pipeline.aux_layers`)."""

    def __init__(self, model: Qwen2VLModel, layers: range, aux_ids: Sequence[int]) -> None:
        self.model, self.layers, self.cfg = model, layers, model.cfg
        self.aux_ids = aux_ids
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def encode_images(self, patches: torch.Tensor, grids: Sequence[Grid]) -> VisualEmbeds:
        return self.model.encode_images(patches, grids)

    def __call__(
        self, embeds: torch.Tensor, mrope: torch.Tensor, attn: AttentionBackend,
        extras: StepExtras = NO_EXTRAS,
    ) -> torch.Tensor:
        hidden, own = self.model.forward_layers_aux(embeds, mrope, attn, self.layers,
                                                    final_norm=False, aux_layers=self.aux_ids,
                                                    extras=extras)
        empty = hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)
        self.out = (hidden, mrope, merge_aux(self.aux_ids, self.layers, empty, own, slice(None)))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # nothing to sample on this stage


class FirstStageRunner:
    """Runs scheduled steps through the first stage's layers of ``engine``'s model (and of its
    other tensor-parallel ranks when it has some); ``aux_ids``: the target layers the last
    stage's EAGLE-3 draft fuses."""

    def __init__(self, engine: LLMEngine, layers: range, aux_ids: Sequence[int] = ()) -> None:
        self._stage = _FirstStageModel(engine.model, layers, aux_ids)
        self._runner = ModelRunner(engine.model, engine.runner.attn)
        self._runner.model = self._stage  # type: ignore[assignment]
        self._runner.peers = engine.runner.peers
        self._runner.states = engine.runner.states  # a hybrid model's linear layers here

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden states ``[T, H]`` after this stage's layers, mrope positions ``[3, T]`` and
        the aux outputs to send on (float32 ``[T, k * H]``, ``k`` = 0 without EAGLE-3)."""
        self._stage.out = None
        self._runner.execute(out)
        assert self._stage.out is not None
        hidden, mrope, aux = self._stage.out
        self._stage.out = None
        return hidden, mrope, aux


def first_stage_runner(engine: LLMEngine, aux_ids: Sequence[int] = ()) -> FirstStageRunner:
    """The first stage's runner over an engine built with ``EngineConfig.layers`` (its share of
    the weights and a KV pool of those layers only)."""
    layers = engine.config.layers
    if layers is None:
        raise ValueError("the first pipeline stage needs an engine built with EngineConfig.layers")
    stack = len(engine.model_config.vision.deepstack_visual_indexes)
    if stack > len(layers):  # the features are added to decoder layers 0..stack-1, here only
        raise ConfigError(
            f"Qwen3-VL adds DeepStack features to decoder layers 0..{stack - 1}, but the first "
            f"pipeline stage holds layers {layers.start}..{layers.stop - 1}: use fewer stages")
    return FirstStageRunner(engine, layers, aux_ids)
