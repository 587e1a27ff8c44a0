"""The EAGLE draft head: one decoder layer over (token embedding, target feature) pairs.

Row ``p`` of a draft forward takes the target's final hidden state at index ``p`` (or, while
drafting, the draft's own output of the previous row) and the embedding of token ``p + 1``, at
rope position ``p``; its output feature predicts token ``p + 2`` through the target's LM head.
Embedding and LM head are the target's (shared, not stored here). The draft's KV lives in its own
pool whose single entry carries the global layer id ``target_num_layers + 0`` (the draft band).

The draft comes in layout variants, recorded in :class:`DraftConfig`: ``fc`` with or without a
bias, the layer with or without its input norm, with or without a final norm. The defaults are
pdserve's own draft (no bias, both norms); the original EAGLE draft has the bias and neither norm.

Checkpoint layouts (Hugging Face-style directories; :func:`~engine.models.eagle.loader.load_draft`
tells them apart by ``config.json`` and :mod:`engine.models.eagle.layouts` reads them):

- pdserve's own: ``config.json`` with ``model_type`` ``qwen2_vl_eagle``, the target's
  ``text_config`` shape (``num_hidden_layers`` 1), ``target_num_hidden_layers`` and any variant
  flags (``fc_bias``, ``layer_input_norm``, ``final_norm``; absent ones read as the defaults);
  ``model.safetensors`` with ``fc.weight`` (``fc.bias``), ``layers.0.*`` (a whole decoder layer,
  ``input_layernorm`` unless left out), ``norm.weight`` (unless left out).
- the original EAGLE one (EAGLE-1 and EAGLE-2 drafts): a flat Llama/Qwen2-style ``config.json``
  (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
  ``vocab_size``, ``num_hidden_layers`` 1, ``bias``, ``qkv_bias``, rope settings) and
  ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.*``, ``layers.0.mlp.*``,
  ``layers.0.post_attention_layernorm.weight`` (maybe ``embed_tokens.weight``, not used) in
  safetensors or ``pytorch_model.bin`` files (single or sharded with an index), under these
  names or SGLang's (``model.``-prefixed, maybe an unused ``lm_head.weight``).

EAGLE-3 drafts (:mod:`engine.models.eagle.eagle3`: they fuse the outputs of three target layers and
may predict over a vocabulary of their own) carry :class:`Eagle3Spec` in their config; in
pdserve's own layout its keys are ``eagle_aux_hidden_state_layer_ids`` and ``draft_vocab_size``,
and the SpecForge / SGLang layout is read by :mod:`engine.models.eagle.eagle3_layout`.

Every draft offers the same interface to the loops that run it
(:data:`engine.models.eagle.eagle3.Draft`):
``target_feature(hidden, aux)`` (the feature a target row hands the draft), ``forward`` (draft
rows -> the features the next draft step reads), ``logits(features, target)`` (float32 logits
over the *target's* vocabulary) and ``cfg.aux_layer_ids`` (the target layers whose outputs
``aux`` holds; empty for EAGLE-1/2).

Under tensor parallelism (``tp`` of several ranks) the draft's decoder layer is split like the
target's (:mod:`engine.parallel.shard`), so the draft's KV band holds each rank's own key/value
heads just as the target's layers do, and the rest is whole on every rank. ``forward`` is then three
parts: ``layer_input`` (rank 0: the rows entering the layer), ``run_layer`` (every rank, on
those rows broadcast; its collectives make the output whole) and ``finish`` (rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import TextConfig, text_config_from_dict
from engine.errors import ConfigError
from engine.models.layers import MropeRotary, RMSNorm
from engine.models.qwen2_vl.model import DecoderLayer, Qwen2VLModel
from engine.parallel.group import SINGLE, TPGroup

DRAFT_MODEL_TYPE = "qwen2_vl_eagle"
# the layout variant flags of DraftConfig (and config.json keys), with their defaults
VARIANT_DEFAULTS = {"fc_bias": False, "layer_input_norm": True, "final_norm": True}
EAGLE3_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
EAGLE3_VOCAB_KEY = "draft_vocab_size"


@dataclass(frozen=True)
class Eagle3Spec:
    """What makes a draft EAGLE-3: the target layers whose outputs it fuses (layer ``i``'s
    output is the residual stream after decoder layer ``i``, before the final norm; in the order
    the draft's ``fc`` reads them) and the size of its own vocabulary."""

    aux_layer_ids: tuple[int, int, int]
    draft_vocab_size: int

    @staticmethod
    def default_layer_ids(target_layers: int) -> tuple[int, int, int]:
        """The layers SpecForge and SGLang pick when a draft names none: low, middle, high."""
        return (1, target_layers // 2 - 1, target_layers - 4)


@dataclass(frozen=True)
class DraftConfig:
    """The draft layer's shape (``text``, one layer), the target depth its KV band sits above,
    and its layout variant (defaults: :data:`VARIANT_DEFAULTS`, pdserve's own draft)."""

    text: TextConfig
    target_num_layers: int
    fc_bias: bool = VARIANT_DEFAULTS["fc_bias"]  # fc has a bias
    # the layer normalises its input (fc's output)
    layer_input_norm: bool = VARIANT_DEFAULTS["layer_input_norm"]
    # the output features are normalised before the LM head
    final_norm: bool = VARIANT_DEFAULTS["final_norm"]
    eagle3: Eagle3Spec | None = None  # None: an EAGLE-1/2 draft

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose outputs the draft fuses (empty unless EAGLE-3)."""
        return () if self.eagle3 is None else self.eagle3.aux_layer_ids

    @property
    def layer_id(self) -> int:
        """Global layer id of the draft layer's KV (the draft band)."""
        return self.target_num_layers

    @classmethod
    def from_dict(cls, raw: Any) -> DraftConfig:
        """The config of a draft in pdserve's own layout; variant flags absent from ``raw`` take
        their defaults (so every draft written before the flags existed reads as before)."""
        if not isinstance(raw, dict) or raw.get("model_type") != DRAFT_MODEL_TYPE:
            kind = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
            raise ConfigError(f"not an EAGLE draft config (model_type {kind!r}, "
                              f"expected {DRAFT_MODEL_TYPE!r})")
        try:
            text = text_config_from_dict(dict(raw["text_config"]))
            layers = int(raw["target_num_hidden_layers"])
            eagle3 = _eagle3_spec(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"draft config.json has a bad field: {exc!r}") from exc
        flags = {key: _flag(raw, key) for key in VARIANT_DEFAULTS}
        if eagle3 is not None and flags != VARIANT_DEFAULTS:
            raise ConfigError("draft config.json: an EAGLE-3 draft has one layout (no fc bias, "
                              f"both norms); variant flags {flags} do not apply")
        return cls(text, layers, fc_bias=flags["fc_bias"],
                   layer_input_norm=flags["layer_input_norm"], final_norm=flags["final_norm"],
                   eagle3=eagle3)

    def check_target(self, target: TextConfig) -> None:
        """Raise ``ConfigError`` unless this draft fits ``target``, naming every field that
        differs: the draft shares the target's embedding and LM head (hidden and vocab size),
        mirrors its KV pool (KV heads and head size), rotates by its mrope sections and carries
        its KV in the band above the target's layers (the target's layer count)."""
        t, d = target, self.text
        fields = (
            ("hidden_size", d.hidden_size, t.hidden_size),
            ("vocab_size", d.vocab_size, t.vocab_size),
            ("num_hidden_layers (target_num_hidden_layers)", self.target_num_layers,
             t.num_hidden_layers),
            ("num_key_value_heads", d.num_key_value_heads, t.num_key_value_heads),
            ("head_dim", d.head_dim, t.head_dim),
            ("mrope_section", list(d.mrope_section), list(t.mrope_section)),
        )
        diffs = [f"{name} is {mine} in the draft, {theirs} in the target"
                 for name, mine, theirs in fields if mine != theirs]
        if self.eagle3 is not None:
            diffs += self.eagle3_misfits(target)
        if diffs:
            raise ConfigError("the EAGLE draft does not fit the target model: "
                              + "; ".join(diffs))

    def eagle3_misfits(self, target: TextConfig) -> list[str]:
        """What keeps this EAGLE-3 draft's layers and vocabulary from fitting ``target``."""
        assert self.eagle3 is not None
        layers, vocab = self.eagle3.aux_layer_ids, self.eagle3.draft_vocab_size
        diffs = []
        if any(not 0 <= i < target.num_hidden_layers for i in layers):
            diffs.append(f"{EAGLE3_LAYERS_KEY} is {list(layers)} in the draft, but the target's "
                         f"layers are 0..{target.num_hidden_layers - 1}")
        if not 0 < vocab <= target.vocab_size:
            diffs.append(f"{EAGLE3_VOCAB_KEY} is {vocab} in the draft, more than the target's "
                         f"vocab_size {target.vocab_size} (or not positive)")
        return diffs


def _eagle3_spec(raw: dict[str, Any]) -> Eagle3Spec | None:
    """The EAGLE-3 keys of pdserve's own config (both or neither)."""
    if EAGLE3_LAYERS_KEY not in raw and EAGLE3_VOCAB_KEY not in raw:
        return None
    ids = [int(i) for i in raw[EAGLE3_LAYERS_KEY]]
    if len(ids) != 3:
        raise ValueError(f"{EAGLE3_LAYERS_KEY} must name 3 target layers, got {ids}")
    return Eagle3Spec((ids[0], ids[1], ids[2]), int(raw[EAGLE3_VOCAB_KEY]))


def _flag(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, VARIANT_DEFAULTS[key])
    if not isinstance(value, bool):
        raise ConfigError(f"draft config.json: {key} must be true or false, got {value!r}")
    return value


class EagleDraft(nn.Module):
    """The draft head of ``cfg``'s layout variant (its layer split over ``tp``); a left-out norm
    is an identity (no weight)."""

    def __init__(self, cfg: DraftConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        t = cfg.text
        self.cfg = cfg
        self.fc = nn.Linear(2 * t.hidden_size, t.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(t, tp, input_norm=cfg.layer_input_norm)])
        self.norm: RMSNorm | nn.Identity = (
            RMSNorm(t.hidden_size, t.rms_norm_eps) if cfg.final_norm else nn.Identity())
        self.rotary = MropeRotary(t.head_dim, t.rope_theta, t.mrope_section)

    @property
    def layer(self) -> DecoderLayer:
        """The draft's one decoder layer (``layers.0`` in the checkpoint)."""
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer

    def fuse(self) -> None:
        self.layer.self_attn.fuse()
        self.layer.mlp.fuse()

    def forward(
        self,
        token_embeds: torch.Tensor,
        features: torch.Tensor,
        mrope_positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Rows ``(embedding of token p+1, feature of p)`` at ``mrope_positions`` ``[3, T]``;
        writes the draft KV through ``attn`` and returns the output features ``[T, H]``."""
        x = self.layer_input(token_embeds, features)
        return self.finish(self.run_layer(x, mrope_positions, attn))

    def layer_input(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The rows entering the decoder layer, ``fc`` of both ``[T, H]``."""
        return self.fc(torch.cat((token_embeds, features), dim=-1))

    def run_layer(self, x: torch.Tensor, mrope_positions: torch.Tensor,
                  attn: AttentionBackend) -> torch.Tensor:
        """The decoder layer over :meth:`layer_input`'s rows (this rank's share of it)."""
        return self.layer.forward(x, self.rotary(mrope_positions, x.dtype), attn, 0)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The output features of the layer's output: the final norm."""
        return self.norm.forward(x)

    def target_feature(self, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The feature a target row hands the draft: its final hidden state ``hidden``
        ``[T, H]`` (``aux`` is empty: this draft fuses no other layers)."""
        return hidden

    def logits(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """Float32 logits ``[n, V]`` of the draft's output ``features`` ``[n, H]``, through the
        target's LM head."""
        return target.logits(features)

    def greedy_tokens(self, features: torch.Tensor, target: Qwen2VLModel) -> torch.Tensor:
        """``logits(features, target).argmax(-1)`` ``[n]``: the draft's greedy tokens."""
        return self.logits(features, target).argmax(dim=-1)


def draft_config_dict(target_text: dict[str, Any], target_layers: int,
                      eagle3: Eagle3Spec | None = None, **variant: bool) -> dict[str, Any]:
    """``config.json`` of a draft for a target whose ``text_config`` is ``target_text``, with the
    layout ``variant`` flags given (any of :data:`VARIANT_DEFAULTS`; those not given are left out
    and read as their defaults), or an EAGLE-3 draft of ``eagle3``'s layers and vocabulary."""
    unknown = sorted(set(variant) - set(VARIANT_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown draft variant flags {unknown}")
    text = {**target_text, "num_hidden_layers": 1}
    extra: dict[str, Any] = {} if eagle3 is None else {
        EAGLE3_LAYERS_KEY: list(eagle3.aux_layer_ids),
        EAGLE3_VOCAB_KEY: eagle3.draft_vocab_size}
    return {"model_type": DRAFT_MODEL_TYPE, "architectures": ["Qwen2VLEagleDraft"],
            "text_config": text, "target_num_hidden_layers": target_layers, **variant, **extra}
