"""Qwen3.5: a hybrid decoder over the Qwen3 vision tower (no DeepStack).

``TextConfig.layer_types`` says per layer which token mixer it has: Gated DeltaNet
(:class:`GatedDeltaNet`, its context in the state pool) or gated full attention
(:class:`Qwen3Attention` with the output gate, its context in the paged KV pool). The two pools
number their layers separately: an engine holding ``layers`` keeps the KV of its
full-attention layers at their index among those, and the states of its linear layers at
their index among those (:meth:`Qwen35Model.pool_index`). Norms are zero-centred
(``1 + weight``). Every forward needs ``StepExtras.states``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig, TextConfig
from engine.models.layers import OffsetRMSNorm, RotaryTables
from engine.models.qwen2_vl.model import Mlp, TextModel
from engine.models.qwen3_5.gated_delta_net import GatedDeltaNet
from engine.models.qwen3_vl.decoder import Qwen3Attention
from engine.models.qwen3_vl.model import Qwen3VLModel
from engine.models.step_extras import StepExtras
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard


class HybridDecoderLayer(nn.Module):
    """Norm, the layer's token mixer (``linear_attn`` or ``self_attn``), norm, gated MLP."""

    def __init__(self, cfg: TextConfig, layer: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        shard = TextShard.of(cfg, tp.rank, tp.size)
        self.linear = cfg.is_linear(layer)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, shard, tp)
        else:
            self.self_attn = Qwen3Attention(cfg, shard, tp)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Mlp(cfg, shard, tp)

    def fuse(self) -> None:
        (self.linear_attn if self.linear else self.self_attn).fuse()
        self.mlp.fuse()

    def forward(self, x: torch.Tensor, rot: RotaryTables, attn: AttentionBackend, index: int,
                extras: StepExtras) -> torch.Tensor:
        h = self.input_layernorm.forward(x)
        if self.linear:
            assert extras.states is not None, "a hybrid forward needs StepExtras.states"
            x = x + self.linear_attn.forward(h, extras.states, index)
        else:
            x = x + self.self_attn.forward(h, rot, attn, index)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class Qwen35Model(Qwen3VLModel):
    """Qwen3.5 (``model_type`` ``qwen3_5``): see the module docstring. The vision tower and
    its encoding are Qwen3-VL's (its DeepStack list is empty)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp)
        # per held layer range: each layer's index in its own pool
        self._indexes: dict[range, dict[int, int]] = {}

    def build_text(self, cfg: TextConfig, tp: TPGroup) -> TextModel:
        return TextModel(cfg, [HybridDecoderLayer(cfg, i, tp)
                               for i in range(cfg.num_hidden_layers)],
                         OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def fuse(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer, HybridDecoderLayer):  # not a layer a pipeline stage dropped
                layer.fuse()
        self.fuse_head()

    def pool_index(self, layer: int, layers: range) -> int:
        indexes = self._indexes.get(layers)
        if indexes is None:
            t = self.cfg.text
            kinds = (t.attention_layers(layers), t.linear_layers(layers))
            indexes = self._indexes[layers] = {g: i for ids in kinds for i, g in enumerate(ids)}
        return indexes[layer]

    def run_layer(self, layer: int, x: torch.Tensor, rot: RotaryTables,
                  attn: AttentionBackend, index: int, extras: StepExtras) -> torch.Tensor:
        return self.model.layers[layer].forward(x, rot, attn, index, extras)
