"""The MTP (NEXTN) draft of a Qwen3.5 checkpoint: its multi-token-prediction module, run in the
EAGLE loop like any draft (:data:`engine.models.eagle.eagle3.Draft`).

The module lives in the *target's* weights, under ``mtp.*`` (``text_config``'s
``mtp_num_hidden_layers`` says how many layers it has; pdserve runs one):

- ``mtp.fc.weight`` ``[H, 2H]`` (no bias), ``mtp.pre_fc_norm_embedding.weight`` and
  ``mtp.pre_fc_norm_hidden.weight`` ``[H]``;
- ``mtp.layers.0.*``: one gated full-attention decoder layer of the target's shape (q/k norms,
  ``q_proj`` with the output gate, the partial interleaved mrope rotation, the MLP);
- ``mtp.norm.weight`` ``[H]``. Every norm is zero-centred (``1 + weight``), as the target's.

Row ``p`` of a draft forward: ``fc(cat(pre_fc_norm_embedding(embed(token p + 1)),
pre_fc_norm_hidden(feature p)))`` (the embedding first, as vLLM and SGLang read the module),
then the layer at row ``p``'s position, then ``norm``: the output feature, which the next draft
step reads as its feature and the target's LM head turns into logits predicting token
``p + 2``. The feature a target row hands the draft is its final-normed hidden state (as for
EAGLE-1/2); the embedding and the LM head are the target's. The layer's KV sits in the draft band
(global layer id ``num_hidden_layers + 0``), so it travels and mirrors pages like an EAGLE
draft's. Under tensor parallelism the layer is split like the target's full-attention layers
(:func:`engine.models.eagle.loader.draft_shard`); ``fc`` and the norms are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.checkpoint import read_module
from engine.config import FULL_ATTENTION, ModelConfig, TextConfig
from engine.errors import CheckpointError, ConfigError
from engine.models.layers import MropeRotary, OffsetRMSNorm
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.qwen3_5.model import HybridDecoderLayer
from engine.models.step_extras import NO_EXTRAS
from engine.parallel.group import SINGLE, TPGroup

MTP_PREFIX = "mtp."
MTP_MODEL_TYPES = ("qwen3_5",)  # the families whose checkpoints may carry an MTP module


@dataclass(frozen=True)
class MtpConfig:
    """The MTP layer's shape (the target's text config with one full-attention layer) and the
    target depth its KV band sits above."""

    text: TextConfig
    target_num_layers: int

    @classmethod
    def of(cls, target: TextConfig) -> MtpConfig:
        """The MTP module of a checkpoint whose text config is ``target``."""
        text = replace(target, num_hidden_layers=1, layer_types=(FULL_ATTENTION,), linear=None,
                       mtp_num_hidden_layers=0)
        return cls(text, target.num_hidden_layers)

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose outputs the draft fuses: none (it reads the final state)."""
        return ()

    @property
    def layer_id(self) -> int:
        """Global layer id of the MTP layer's KV (the draft band)."""
        return self.target_num_layers

    def check_target(self, target: TextConfig) -> None:
        """Raise ``ConfigError`` unless this module fits ``target`` (the checkpoint it came from
        always does): hidden and vocabulary size, KV heads, head size, rotation, depth."""
        t, d = target, self.text
        fields = (("hidden_size", d.hidden_size, t.hidden_size),
                  ("vocab_size", d.vocab_size, t.vocab_size),
                  ("num_hidden_layers", self.target_num_layers, t.num_hidden_layers),
                  ("num_key_value_heads", d.num_key_value_heads, t.num_key_value_heads),
                  ("head_dim", d.head_dim, t.head_dim),
                  ("rotary_dim", d.rotary_dim, t.rotary_dim),
                  ("mrope_section", list(d.mrope_section), list(t.mrope_section)))
        diffs = [f"{name} is {mine} in the MTP module, {theirs} in the target"
                 for name, mine, theirs in fields if mine != theirs]
        if diffs:
            raise ConfigError("the MTP draft does not fit the target model: " + "; ".join(diffs))


class MtpDraft(nn.Module):
    """A Qwen3.5 MTP module (its layer split over ``tp``) with the interface of
    :class:`~engine.models.eagle.draft.EagleDraft`; module names are the checkpoint's without
    ``mtp.``."""

    def __init__(self, cfg: MtpConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        t = cfg.text
        h, eps = t.hidden_size, t.rms_norm_eps
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(t, 0, tp)])
        self.norm = OffsetRMSNorm(h, eps)
        self.rotary = MropeRotary(t.rotary_dim, t.rope_theta, t.mrope_section,
                                  t.mrope_interleaved)

    @property
    def layer(self) -> HybridDecoderLayer:
        """The module's one decoder layer (``mtp.layers.0``)."""
        layer = self.layers[0]
        assert isinstance(layer, HybridDecoderLayer)
        return layer

    def fuse(self) -> None:
        self.layer.fuse()

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor,
                mrope_positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Rows ``(embedding of token p+1, feature of p)`` ``[T, H]`` each at
        ``mrope_positions`` ``[3, T]``; writes the layer's KV through ``attn`` and returns the
        output features ``[T, H]``."""
        x = self.layer_input(token_embeds, features)
        return self.finish(self.run_layer(x, mrope_positions, attn))

    def layer_input(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The rows entering the layer: ``fc`` of the normed embedding and feature side by side,
        ``[T, H]``."""
        return self.fc(torch.cat((self.pre_fc_norm_embedding.forward(token_embeds),
                                  self.pre_fc_norm_hidden.forward(features)), dim=-1))

    def run_layer(self, x: torch.Tensor, mrope_positions: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
        """The decoder layer over :meth:`layer_input`'s rows (this rank's share of it), its KV
        at the draft pool's layer 0."""
        return self.layer.forward(x, self.rotary(mrope_positions, x.dtype), attn, 0, NO_EXTRAS)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The output features of the layer's output: ``mtp.norm``."""
        return self.norm.forward(x)

    def target_feature(self, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The feature a target row hands the module: its final-normed hidden state ``[T, H]``
        (``aux`` is empty)."""
        return hidden

    def logits(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """Float32 logits ``[n, V]`` of output ``features`` ``[n, H]`` through the target's LM
        head."""
        return target.logits(features)

    def greedy_tokens(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """``logits(features, target).argmax(-1)`` ``[n]``."""
        return self.logits(features, target).argmax(dim=-1)


def is_mtp_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a target checkpoint of a family that carries an MTP module (its
    ``config.json`` names such a ``model_type``), rather than a draft directory."""
    try:
        return ModelConfig.from_dir(path).model_type in MTP_MODEL_TYPES
    except ConfigError:
        return False


def read_mtp(path: Path, target: TextConfig, device: str | torch.device
             ) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """The config and tensors (names without ``mtp.``, on ``device``) of the MTP module in the
    checkpoint ``path``. ``CheckpointError`` when it has no ``mtp.*`` tensors; ``ConfigError``
    when its config asks for other than one MTP layer or the module does not fit ``target``."""
    own = ModelConfig.from_dir(path).text
    layers = own.mtp_num_hidden_layers
    if layers > 1:
        raise ConfigError(f"{path}: mtp_num_hidden_layers is {layers}; pdserve's MTP draft runs "
                          "one layer")
    cfg = MtpConfig.of(own)
    cfg.check_target(target)
    state = read_module(path, MTP_PREFIX, device)
    if not state:
        raise CheckpointError(f"{path}: the checkpoint has no MTP module (no {MTP_PREFIX}* "
                              "tensors): --draft mtp needs a checkpoint published with one")
    return cfg, state
