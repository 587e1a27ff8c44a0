"""SGLang's names for original-layout (EAGLE-1/EAGLE-2) drafts.

SGLang serves these drafts with its ``LlamaForCausalLMEagle`` and ``Qwen2ForCausalLMEagle``
classes (the ``architectures`` of their ``config.json``). Those classes hold the draft's
tensors under ``model.`` (``model.fc.weight``, ``model.layers.0.self_attn.q_proj.weight``,
``model.embed_tokens.weight``) beside ``lm_head.weight``, and a draft saved from them keeps
those names; the drafts SGLang reads may also carry the original names, which it prefixes itself.
Either way the embedding and the LM head are the target's at run time. Here the ``model.``
prefix is read away, so :func:`~engine.models.eagle.layouts.eagle_state_dict` sees the original
layout's names. SGLang's Qwen2 layer always has q/k/v biases, so under ``Qwen2ForCausalLMEagle``
a config without ``qkv_bias`` means biases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.errors import CheckpointError

SGLANG_PREFIX = "model."
SGLANG_HEAD = "lm_head.weight"
SGLANG_QWEN2 = "Qwen2ForCausalLMEagle"


def sglang_qkv_bias(raw: dict[str, Any]) -> bool:
    """Whether a flat ``config.json`` ``raw`` without ``qkv_bias`` means q/k/v biases: under
    SGLang's Qwen2 draft class, whose attention always has them."""
    archs = raw.get("architectures")
    return isinstance(archs, list) and SGLANG_QWEN2 in archs


def sglang_unprefixed(tensors: dict[str, torch.Tensor],
                      path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """``tensors`` (from ``path``) with SGLang's ``model.`` prefix read away, and whether any
    name had it. ``CheckpointError`` if some names have it and others (the LM head aside)
    do not: a draft is saved under one naming."""
    prefixed = [n for n in tensors if n.startswith(SGLANG_PREFIX)]
    if not prefixed:
        return dict(tensors), False
    bare = sorted(n for n in tensors if not n.startswith(SGLANG_PREFIX) and n != SGLANG_HEAD)
    if bare:
        raise CheckpointError(f"{path}: tensor names mix SGLang's {SGLANG_PREFIX!r} prefix "
                              f"(as in {prefixed[0]!r}) and the original EAGLE names: "
                              f"{bare[:8]} lack it")
    return {n.removeprefix(SGLANG_PREFIX): t for n, t in tensors.items()}, True
