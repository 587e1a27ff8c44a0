"""Reading an EAGLE-3 draft in the layout SpecForge and SGLang write into pdserve's EAGLE-3 draft
(:class:`~engine.models.eagle.eagle3.Eagle3Draft`).

The layout: a flat Llama-style ``config.json`` (``architectures``
``["LlamaForCausalLMEagle3"]``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``, rope settings,
``vocab_size`` (the target's), ``draft_vocab_size``, ``num_hidden_layers`` 1, maybe
``eagle_aux_hidden_state_layer_ids`` at the top level or in an ``eagle_config`` object), and the
tensors ``fc.weight`` ``[H, 3H]``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``
(int64), ``t2d`` (bool over the target vocabulary), maybe ``embed_tokens.weight``.

Mapping onto pdserve's names: ``midlayer.`` becomes ``layers.0.``; q/k/v get zero biases (the
layout has none: ``attention_bias`` true, which would also bias ``o_proj``, is refused); ``t2d``
must agree with ``d2t`` (exactly the draft vocabulary's target ids) and is dropped, as is
``embed_tokens.weight`` once its shape matches the target's embedding (the draft embeds with the
target's). Without layer ids the draft takes SpecForge's default for the target's depth
(:meth:`~engine.models.eagle.draft.Eagle3Spec.default_layer_ids`). Rope and head settings read as
for the original EAGLE layout (:mod:`engine.models.eagle.layouts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import TextConfig
from engine.errors import CheckpointError, ConfigError
from engine.models.eagle.draft import EAGLE3_LAYERS_KEY, EAGLE3_VOCAB_KEY, DraftConfig, Eagle3Spec

FOREIGN_LAYER = "midlayer."
PDSERVE_LAYER = "layers.0."
_QKV = ("q_proj", "k_proj", "v_proj")


def eagle3_signs(raw: dict[str, Any]) -> list[str]:
    """What in a flat ``config.json`` marks an EAGLE-3 draft (empty: none)."""
    archs = raw.get("architectures")
    signs = [f"architecture {a!r}" for a in (archs if isinstance(archs, list) else [])
             if "eagle3" in str(a).lower()]
    return signs + ([EAGLE3_VOCAB_KEY] if EAGLE3_VOCAB_KEY in raw else [])


def eagle3_config(raw: dict[str, Any], text: TextConfig, target: TextConfig,
                  source: str) -> DraftConfig:
    """pdserve's config of the EAGLE-3 draft whose flat ``config.json`` is ``raw`` (from
    ``source``; ``text`` its layer shape as the original EAGLE layout reads it), beside
    ``target``; not yet checked against it."""
    if raw.get("attention_bias", False) is not False:
        raise ConfigError(f"{source}: attention_bias is set: pdserve's EAGLE-3 draft layer has "
                          "no o_proj bias")
    fused = raw.get("target_hidden_size")
    if fused is not None and fused != target.hidden_size:
        raise ConfigError(f"{source}: target_hidden_size is {fused} in the draft, "
                          f"{target.hidden_size} in the target: its fc fuses another model's "
                          "layers")
    if EAGLE3_VOCAB_KEY not in raw:
        raise ConfigError(f"{source}: an EAGLE-3 draft config needs {EAGLE3_VOCAB_KEY}")
    nested = raw.get("eagle_config")
    ids = raw.get(EAGLE3_LAYERS_KEY)
    if ids is None and isinstance(nested, dict):
        ids = nested.get(EAGLE3_LAYERS_KEY)
    try:
        layers = (Eagle3Spec.default_layer_ids(target.num_hidden_layers) if ids is None
                  else tuple(int(i) for i in ids))
        vocab = int(raw[EAGLE3_VOCAB_KEY])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: bad EAGLE-3 field: {exc!r}") from exc
    if len(layers) != 3:
        raise ConfigError(f"{source}: {EAGLE3_LAYERS_KEY} must name 3 target layers, got "
                          f"{list(layers)}")
    spec = Eagle3Spec((layers[0], layers[1], layers[2]), vocab)
    return DraftConfig(text, target.num_hidden_layers, eagle3=spec)


def eagle3_state_dict(tensors: dict[str, torch.Tensor], cfg: DraftConfig,
                      path: Path) -> dict[str, torch.Tensor]:
    """The SpecForge layout's ``tensors`` (from ``path``) under pdserve's EAGLE-3 names; raises
    ``CheckpointError`` naming missing, unexpected or inconsistent tensors."""
    assert cfg.eagle3 is not None
    text, vocab = cfg.text, cfg.eagle3.draft_vocab_size
    tensors = dict(tensors)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (text.vocab_size, text.hidden_size):
        raise CheckpointError(f"{path}: embed_tokens.weight has shape {list(embed.shape)}, not "
                              f"the target embedding's [{text.vocab_size}, {text.hidden_size}]")
    t2d = tensors.pop("t2d", None)
    out = {(PDSERVE_LAYER + k[len(FOREIGN_LAYER):] if k.startswith(FOREIGN_LAYER) else k): v
           for k, v in tensors.items()}
    missing = sorted(_names() - out.keys())
    unexpected = sorted(out.keys() - _names())
    if missing or unexpected:
        raise CheckpointError(f"{path}: not the tensors of a SpecForge EAGLE-3 draft: missing "
                              f"{missing[:8]}, unexpected {unexpected[:8]} (under pdserve's "
                              f"names, {FOREIGN_LAYER!r} read as {PDSERVE_LAYER!r})")
    d2t = out["d2t"]
    if tuple(d2t.shape) != (vocab,) or d2t.is_floating_point():
        raise CheckpointError(f"{path}: d2t must be {vocab} integers ({EAGLE3_VOCAB_KEY}), got "
                              f"{d2t.dtype} {list(d2t.shape)}")
    out["d2t"] = d2t.to(torch.int64)
    if t2d is not None:
        _check_t2d(t2d, out["d2t"], text.vocab_size, path)
    for proj in _QKV:
        weight = out[f"{PDSERVE_LAYER}self_attn.{proj}.weight"]
        out[f"{PDSERVE_LAYER}self_attn.{proj}.bias"] = weight.new_zeros(weight.shape[0])
    return out


def _names() -> set[str]:
    """The tensors of a SpecForge EAGLE-3 draft, under pdserve's names (no q/k/v biases)."""
    layer = PDSERVE_LAYER
    names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t",
             f"{layer}self_attn.o_proj.weight"}
    names |= {f"{layer}{n}.weight" for n in ("input_layernorm", "hidden_norm",
                                             "post_attention_layernorm")}
    names |= {f"{layer}self_attn.{p}.weight" for p in _QKV}
    names |= {f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    return names


def _check_t2d(t2d: torch.Tensor, d2t: torch.Tensor, target_vocab: int, path: Path) -> None:
    """``t2d`` must mark exactly the target ids of the draft vocabulary."""
    if tuple(t2d.shape) != (target_vocab,):
        raise CheckpointError(f"{path}: t2d has shape {list(t2d.shape)}, not the target "
                              f"vocabulary's [{target_vocab}]")
    ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
    if ids.min() < 0 or ids.max() >= target_vocab:
        raise CheckpointError(f"{path}: d2t maps draft ids outside the target's vocabulary")
    marked = torch.zeros(target_vocab, dtype=torch.bool, device=d2t.device)
    marked[ids] = True
    if not torch.equal(marked, t2d.to(device=d2t.device, dtype=torch.bool)):
        raise CheckpointError(f"{path}: t2d does not mark exactly the target ids d2t maps the "
                              "draft vocabulary onto")
