"""Reading an EAGLE draft directory in any accepted layout into pdserve's draft
(:class:`~engine.models.eagle.draft.DraftConfig` and tensors under :class:`EagleDraft`'s names).

``config.json`` tells the layouts apart:

- ``model_type`` ``qwen2_vl_eagle``: pdserve's own layout, read as written.
- a flat Llama/Qwen2-style config (``model_type`` ``llama``, ``qwen2`` or none, no
  ``text_config``): the original EAGLE layout of EAGLE-1 and EAGLE-2 drafts (SafeAILab's
  ``cnets.py`` and the drafts trained with it). Its decoder layer has no input norm, there is no
  final norm (its output features go straight to the LM head), ``fc`` takes
  ``cat(token embedding, target feature)`` as pdserve's does and has a bias unless ``bias`` is
  false; it becomes pdserve's draft with ``fc_bias`` = ``bias`` and both norms left out.
  Its tensors may come in safetensors or PyTorch ``.bin`` files (one ``pytorch_model.bin`` or a
  sharded set with ``pytorch_model.bin.index.json``; :mod:`engine.checkpoint_bin`), under the
  original names or SGLang's (``architectures`` ``LlamaForCausalLMEagle`` /
  ``Qwen2ForCausalLMEagle``: a ``model.`` prefix and an ``lm_head.weight``;
  :mod:`engine.models.eagle.sglang_layout`).

Mapping the original layout's config onto the draft's:

- ``num_hidden_layers`` must be 1 (pdserve drafts have one layer); the KV band sits above the
  target's layers whatever depth the draft was trained beside.
- ``qkv_bias`` (default false, Llama's attention; true under SGLang's ``Qwen2ForCausalLMEagle``)
  says whether ``q/k/v_proj`` have biases; where they have none the draft gets zero biases,
  which add nothing.
- ``rope_theta`` defaults to 10000 (EAGLE's default); ``rope_scaling`` / ``rope_parameters``
  may only be plain or ``mrope``. Without an ``mrope_section`` the draft takes the target's: on
  text all three axes of a position are equal, so the rotation is the 1-D rope the draft was
  trained with; on image tokens it sees the target's 3-D positions (acceptance may differ
  there, the output never does: verification keeps it the target's).
- ``embed_tokens.weight``, saved along by EAGLE's training, and ``lm_head.weight``, saved by
  SGLang's classes, must have the target embedding's shape and are dropped: the draft embeds
  and predicts with the target's.
- any other tensor, a missing one, or the input norm or final norm the layout leaves out is
  refused, naming the tensors.

- a flat config marked EAGLE-3 (an ``Eagle3`` architecture or ``draft_vocab_size``): the
  SpecForge / SGLang EAGLE-3 layout, read by :mod:`engine.models.eagle.eagle3_layout`. A config not
  so marked whose tensors are EAGLE-3's (``d2t``/``t2d`` or ``midlayer.*``) is refused, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import read_state_dict
from engine.checkpoint_bin import read_bin_state_dict
from engine.config import TextConfig, read_json_object
from engine.errors import CheckpointError, ConfigError
from engine.models.eagle.draft import DRAFT_MODEL_TYPE, DraftConfig
from engine.models.eagle.eagle3_layout import eagle3_config, eagle3_signs, eagle3_state_dict
from engine.models.eagle.sglang_layout import (
    SGLANG_HEAD,
    SGLANG_PREFIX,
    sglang_qkv_bias,
    sglang_unprefixed,
)

EAGLE_MODEL_TYPES = (None, "llama", "qwen2")
EAGLE_DEFAULT_ROPE_THETA = 10000.0
_PLAIN_ROPE_TYPES = (None, "default", "mrope")
_QKV = ("q_proj", "k_proj", "v_proj")
_EAGLE3_TENSORS = ("d2t", "t2d")
# tensors a draft may carry that are the target's at run time: checked for shape, dropped
_SHARED = (("embed_tokens.weight", "embedding"), (SGLANG_HEAD, "LM head"))
# norms the original layout leaves out
_ABSENT_NORMS = ("layers.0.input_layernorm.weight", "norm.weight")
_LAYOUTS = (f"pdserve's own (model_type {DRAFT_MODEL_TYPE!r}), the original EAGLE one "
            "(a flat Llama/Qwen2 config.json with hidden_size, num_attention_heads, "
            "intermediate_size, vocab_size and num_hidden_layers 1) or SpecForge's EAGLE-3 "
            "one (the same, with draft_vocab_size)")


@dataclass(frozen=True)
class EagleLayout:
    """A draft in the original EAGLE layout: pdserve's config for it, and whether its attention
    projections have biases (its ``qkv_bias``)."""

    draft: DraftConfig
    qkv_bias: bool

    def tensor_names(self) -> set[str]:
        """The names its weight files hold (``embed_tokens.weight`` aside)."""
        layer = "layers.0."
        names = {"fc.weight", f"{layer}self_attn.o_proj.weight",
                 f"{layer}post_attention_layernorm.weight"}
        names |= {f"{layer}self_attn.{p}.weight" for p in _QKV}
        names |= {f"{layer}mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        if self.draft.fc_bias:
            names.add("fc.bias")
        if self.qkv_bias:
            names |= {f"{layer}self_attn.{p}.bias" for p in _QKV}
        return names


def read_draft(
    path: Path, target: TextConfig, device: str | torch.device,
) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and tensors (under pdserve's draft names, on ``device``) of the draft in
    ``path``, whichever accepted layout it is in. ``ConfigError`` for an unknown layout or a
    draft that does not fit ``target`` (raised before any weight is read), and for EAGLE-3
    tensors under a config not marked EAGLE-3; ``CheckpointError`` for missing, unexpected or
    misshapen tensors."""
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json (is this an EAGLE draft directory?)")
    raw = read_json_object(file)
    if raw.get("model_type") == DRAFT_MODEL_TYPE:
        cfg = DraftConfig.from_dict(raw)
        cfg.check_target(target)
        return cfg, read_weights(path, device)
    layout = eagle_layout(raw, target, str(file))
    if eagle3_signs(raw):
        cfg = eagle3_config(raw, layout.draft.text, target, str(file))
        cfg.check_target(target)
        return cfg, eagle3_state_dict(read_weights(path, device), cfg, path)
    layout.draft.check_target(target)
    return layout.draft, eagle_state_dict(read_weights(path, device), layout, path)


def eagle_layout(raw: dict[str, Any], target: TextConfig, source: str) -> EagleLayout:
    """pdserve's reading of the original EAGLE ``config.json`` ``raw`` (from ``source``) for a
    draft beside ``target``; not yet checked against it."""
    kind = raw.get("model_type")
    if "text_config" in raw or kind not in EAGLE_MODEL_TYPES or "hidden_size" not in raw:
        raise ConfigError(f"{source}: unknown draft layout (model_type {kind!r}"
                          f"{', a nested text_config' if 'text_config' in raw else ''}): "
                          f"pdserve reads {_LAYOUTS}")
    try:
        text, fc_bias, qkv_bias = _eagle_text(raw, target)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: the EAGLE draft config is missing or has a bad field: "
                          f"{exc!r}") from exc
    draft = DraftConfig(text, target.num_hidden_layers, fc_bias=fc_bias,
                        layer_input_norm=False, final_norm=False)
    return EagleLayout(draft, qkv_bias)


def _eagle_text(raw: dict[str, Any], target: TextConfig) -> tuple[TextConfig, bool, bool]:
    """The draft layer's text config, ``fc``'s bias flag and the attention's bias flag."""
    layers = int(raw["num_hidden_layers"])
    if layers != 1:
        raise ConfigError(f"num_hidden_layers is {layers} in the draft: pdserve drafts have "
                          "exactly one decoder layer")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads <= 0 or hidden % heads or kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f"the draft's hidden_size {hidden}, num_attention_heads {heads} and "
                          f"num_key_value_heads {kv_heads} do not divide evenly")
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) != hidden // heads:
        raise ConfigError(f"head_dim is {head_dim} in the draft, but hidden_size / "
                          f"num_attention_heads is {hidden // heads}: pdserve's draft layer "
                          "has head_dim = hidden_size / num_attention_heads")
    theta, section = _eagle_rope(raw)
    text = TextConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=section or target.mrope_section,
        hidden_act=str(raw.get("hidden_act", "silu")),
    )
    return text, _bool(raw, "bias", True), _bool(raw, "qkv_bias", sglang_qkv_bias(raw))


def _eagle_rope(raw: dict[str, Any]) -> tuple[float, tuple[int, int, int] | None]:
    """``(rope_theta, mrope_section or None)`` of a flat config; scaled ropes are refused."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in _PLAIN_ROPE_TYPES:
        raise ConfigError(f"the draft's rope type {kind!r} is not supported: pdserve's draft "
                          "rotates with plain or multimodal (mrope) rope, unscaled")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", EAGLE_DEFAULT_ROPE_THETA)))
    section = rope.get("mrope_section")
    if section is None:
        return theta, None
    if not isinstance(section, list) or len(section) != 3:
        raise ValueError(f"mrope_section must be a list of 3 ints, got {section!r}")
    return theta, (int(section[0]), int(section[1]), int(section[2]))


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def refuse_eagle3(path: Path, signs: list[str]) -> None:
    """Raise ``ConfigError`` if ``signs`` (EAGLE-3 tensors found in the draft in ``path``, whose
    config is not marked EAGLE-3) is not empty."""
    if signs:
        raise ConfigError(f"{path}: EAGLE-3 tensors ({', '.join(signs)}) in a draft whose "
                          "config.json is not marked EAGLE-3: add draft_vocab_size and the "
                          "architecture LlamaForCausalLMEagle3 (an EAGLE-1/2 draft reads the "
                          "target's last hidden state over the target's vocabulary)")


def read_weights(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """The tensors of ``path``'s safetensors files or, when it has none, of its PyTorch ``.bin``
    files (single or sharded: :mod:`engine.checkpoint_bin`, plain tensors only), on
    ``device``, under their stored names."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return read_state_dict(path, device=device)
    return read_bin_state_dict(path, device)


def eagle_state_dict(
    tensors: dict[str, torch.Tensor], layout: EagleLayout, path: Path,
) -> dict[str, torch.Tensor]:
    """The original layout's ``tensors`` (from ``path``; under its names or SGLang's, see
    :mod:`engine.models.eagle.sglang_layout`) under pdserve's draft names: ``embed_tokens.weight``
    and ``lm_head.weight`` dropped once their shapes are checked, zero q/k/v biases added where the
    attention has none. Raises unless exactly the layout's tensors are there."""
    tensors, renamed = sglang_unprefixed(tensors, path)
    refuse_eagle3(path, [f"tensor {n!r}" for n in sorted(tensors)
                         if n in _EAGLE3_TENSORS or n.startswith("midlayer.")])
    text = layout.draft.text
    for name, what in _SHARED:
        shared = tensors.pop(name, None)
        if shared is not None and tuple(shared.shape) != (text.vocab_size, text.hidden_size):
            raise CheckpointError(f"{path}: {name} has shape {list(shared.shape)}, not the "
                                  f"target {what}'s [{text.vocab_size}, {text.hidden_size}]")
    expected = layout.tensor_names()
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: not the tensors of an EAGLE draft with fc bias {layout.draft.fc_bias} "
            f"(config 'bias') and q/k/v biases {layout.qkv_bias} (config 'qkv_bias'): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}{_notes(unexpected, renamed)}")
    if not layout.qkv_bias:
        for proj in _QKV:
            weight = tensors[f"layers.0.self_attn.{proj}.weight"]
            tensors[f"layers.0.self_attn.{proj}.bias"] = weight.new_zeros(weight.shape[0])
    return tensors


def _notes(unexpected: list[str], renamed: bool) -> str:
    """What a refusal of the original layout's tensors adds: how the names were read, and which
    of the unexpected tensors are norms the layout leaves out."""
    notes = [f" (names read without SGLang's {SGLANG_PREFIX!r} prefix)"] if renamed else []
    norms = [n for n in _ABSENT_NORMS if n in unexpected]
    if norms:
        notes.append(f"; the original EAGLE layout has no input norm and no final norm, but "
                     f"{norms} are there")
    return "".join(notes)
