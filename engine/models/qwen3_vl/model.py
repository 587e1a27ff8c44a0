"""Qwen3-VL: the patch-16 vision tower with DeepStack, and a Qwen3 decoder whose first layers'
outputs take the DeepStack features at the visual tokens.

DeepStack acts on prompt rows only: a forward's :class:`StepExtras` names the rows holding
visual tokens whose embeddings came with it and one feature per stacked layer for each; decode
rows carry none. Everything else (mrope positions, the KV, pipeline and tensor-parallel
shares) is the Qwen2-VL machinery of :class:`Qwen2VLModel`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig, TextConfig
from engine.models.layers import RMSNorm, RotaryTables
from engine.models.qwen2_vl.model import Qwen2VLModel, TextModel
from engine.models.qwen2_vl.vision import Grid
from engine.models.qwen3_vl.decoder import Qwen3DecoderLayer
from engine.models.qwen3_vl.vision import Qwen3VisionTower
from engine.models.step_extras import StepExtras, VisualEmbeds
from engine.parallel.group import TPGroup


class Qwen3VLModel(Qwen2VLModel):
    """Qwen3-VL (``model_type`` ``qwen3_vl``): see the module docstring."""

    def build_text(self, cfg: TextConfig, tp: TPGroup) -> TextModel:
        return TextModel(cfg, [Qwen3DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers)],
                         RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def build_visual(self, cfg: ModelConfig) -> nn.Module:
        return Qwen3VisionTower(cfg.vision)

    def fuse(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer, Qwen3DecoderLayer):  # not a layer a pipeline stage dropped
                layer.fuse()
        self.fuse_head()

    def encode_images(self, patches: torch.Tensor, grids: Sequence[Grid]) -> VisualEmbeds:
        patches = patches.to(device=self.device, dtype=self.dtype)
        merged, stack = self.visual(patches, grids)
        return VisualEmbeds(merged.to(self.dtype), tuple(f.to(self.dtype) for f in stack))

    def run_layer(self, layer: int, x: torch.Tensor, rot: RotaryTables,
                  attn: AttentionBackend, index: int, extras: StepExtras) -> torch.Tensor:
        x = self.model.layers[layer].forward(x, rot, attn, index)
        if layer < len(extras.deepstack) and extras.deepstack_rows is not None:
            x = x.index_add(0, extras.deepstack_rows, extras.deepstack[layer])
        return x
