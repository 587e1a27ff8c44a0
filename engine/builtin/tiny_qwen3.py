"""Writes tiny random-weight Qwen3-VL and Qwen3.5 checkpoints in the Hugging Face layout.

The files are those of a published checkpoint of the family: ``config.json`` in the nested
layout transformers 5 writes (``text_config`` with ``rope_parameters``, ``vision_config``),
``model.safetensors`` under the published names (``model.language_model.*``, ``model.visual.*``,
``lm_head.*``), the tiny tokenizer (:mod:`engine.builtin.tiny_tokenizer`) whose special ids the
config names, ``generation_config.json``, and Qwen3-VL's processor settings (patch 16, mean and
std 0.5) in ``preprocessor_config.json`` and ``video_preprocessor_config.json``. They load with
our engine and with transformers alike. The weights come from our own model classes
(:class:`Qwen3VLModel`, :class:`Qwen35Model`), drawn from a seeded generator: the same seed
writes the same bytes on every machine. A Qwen3.5 checkpoint may also carry a random MTP module
(``mtp.*`` tensors of :class:`~engine.models.eagle.mtp.MtpDraft`, ``mtp_num_hidden_layers: 1``),
as published ones do; transformers ignores it. :func:`make_mtp_predictable` turns such a
checkpoint into one whose MTP drafts are accepted part of the time (the oracle of the MTP
tests and of the GPU check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.builtin.tiny_model import TINY_VOCAB
from engine.builtin.tiny_tokenizer import build_tiny_tokenizer, special_token_ids
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.models.eagle.mtp import MTP_PREFIX, MtpConfig, MtpDraft
from engine.models.layers import OffsetRMSNorm
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.qwen3_5.model import Qwen35Model
from engine.models.qwen3_vl.model import Qwen3VLModel

QWEN3_ARCHS = ("qwen3_vl", "qwen3_5")
# larger than tiny_model's 0.02: logits far enough apart that greedy decoding neither repeats
# one token nor hangs on near-ties between two implementations' rounding
WEIGHT_STD = 0.08
_ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
                  "qwen3_5": "Qwen3_5ForConditionalGeneration"}
_MODELS: dict[str, type[Qwen2VLModel]] = {"qwen3_vl": Qwen3VLModel, "qwen3_5": Qwen35Model}
# our module names -> the published ones (the inverse of engine.checkpoint.canonical_name)
_PUBLISHED = (("model.", "model.language_model."), ("visual.", "model.visual."))
# a tiny image is at least 2 x 2 merged blocks of 32 px and at most 64 of them (a video frame 16)
_MERGED_BLOCK = 32
_PROCESSOR_COMMON = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
TINY_QWEN3_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 4 * _MERGED_BLOCK**2, "longest_edge": 64 * _MERGED_BLOCK**2},
    **_PROCESSOR_COMMON,
}
TINY_QWEN3_VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4 * _MERGED_BLOCK**2, "longest_edge": 16 * _MERGED_BLOCK**2},
    "fps": 2.0,
    **_PROCESSOR_COMMON,
}


def _text_config(arch: str, vocab_size: int) -> dict[str, Any]:
    special = special_token_ids(vocab_size)
    text: dict[str, Any] = {
        "model_type": f"{arch}_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special["<|im_end|>"],
    }
    if arch == "qwen3_vl":
        # 8 rotary frequencies, interleaved t h w t h w t h
        return {**text, "num_hidden_layers": 2, "head_dim": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
    # Qwen3.5's pattern (three Gated DeltaNet layers, then one gated full-attention layer) and
    # its quarter-width rotation: 4 of a 32-wide head's 16 frequencies turn
    return {**text, "num_hidden_layers": 4, "head_dim": 32, "tie_word_embeddings": False,
            "layer_types": [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                "partial_rotary_factor": 0.25}}


def _vision_config(arch: str) -> dict[str, Any]:
    vision: dict[str, Any] = {
        "model_type": f"{arch}_vision",
        "depth": 3,
        "hidden_size": 32,
        "out_hidden_size": 64,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": 64,  # an 8 x 8 table
    }
    if arch == "qwen3_vl":
        vision["deepstack_visual_indexes"] = [0, 1]  # into decoder layers 0 and 1
    return vision


def tiny_qwen3_config_dict(arch: str, vocab_size: int = TINY_VOCAB) -> dict[str, Any]:
    """The ``config.json`` of the tiny ``arch`` model (one of :data:`QWEN3_ARCHS`); special
    tokens are the tokenizer's last ids. Raises ValueError for another ``arch``."""
    if arch not in QWEN3_ARCHS:
        raise ValueError(f"unknown tiny Qwen3 architecture {arch!r}: expected one of "
                         f"{', '.join(QWEN3_ARCHS)}")
    special = special_token_ids(vocab_size)
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "dtype": "float32",
        "tie_word_embeddings": False,
        "image_token_id": special["<|image_pad|>"],
        "video_token_id": special["<|video_pad|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
        "text_config": _text_config(arch, vocab_size),
        "vision_config": _vision_config(arch),
    }


def init_qwen3_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic init: normal(0, :data:`WEIGHT_STD`) matrices, zero biases, identity norms
    (weight 1, or 0 for Qwen3.5's zero-centred ones), Gated DeltaNet decays in range
    (``A_log = log(uniform(1, 16))``, ``dt_bias`` 1)."""
    gen = torch.Generator().manual_seed(seed)
    offset = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, OffsetRMSNorm)}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("bias") and not name.endswith("dt_bias"):
                param.zero_()
            elif name in offset:
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)


def published_name(name: str) -> str:
    """The published Qwen3 checkpoint's name of our module's tensor ``name``."""
    for ours, theirs in _PUBLISHED:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def write_tiny_qwen3_model(model_dir: str | Path, arch: str, seed: int = 0,
                           vocab_size: int = TINY_VOCAB, *, mtp: bool = False) -> Path:
    """Write the tiny ``arch`` checkpoint (one of :data:`QWEN3_ARCHS`) to ``model_dir``
    (created if needed) and return its path; ``mtp``: with a random MTP module (Qwen3.5 only,
    drawn from ``seed + 1``)."""
    if mtp and arch != "qwen3_5":
        raise ValueError(f"an MTP module is Qwen3.5's, not {arch}'s")
    raw = tiny_qwen3_config_dict(arch, vocab_size)
    if mtp:
        raw["text_config"]["mtp_num_hidden_layers"] = 1
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(raw)
    model = _MODELS[arch](cfg)
    init_qwen3_weights(model, seed)
    module = None
    if mtp:
        module = MtpDraft(MtpConfig.of(cfg.text))
        init_qwen3_weights(module, seed + 1)
    text = raw["text_config"]
    generation = {"eos_token_id": text["eos_token_id"], "bos_token_id": text["bos_token_id"]}
    write_qwen3_checkpoint(path, model, module, raw, generation)
    build_tiny_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    return path


def write_qwen3_checkpoint(path: Path, model: Qwen2VLModel, mtp: MtpDraft | None,
                           raw: dict[str, Any], generation: dict[str, Any], *,
                           tied: bool = False) -> None:
    """A Qwen3-family checkpoint of ``model`` in ``path`` (which must exist), all but the
    tokenizer: ``model.safetensors`` under the published names, ``mtp``'s tensors beside them
    as ``mtp.*`` and, with ``tied``, no ``lm_head`` (the embedding serves); ``config.json``
    (``raw``), ``generation_config.json`` (``generation``) and the tiny processors' settings."""
    state = {published_name(k): v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    if mtp is not None:
        state.update({MTP_PREFIX + k: v.detach().contiguous()
                      for k, v in mtp.state_dict().items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    files = {"config.json": raw, "generation_config.json": generation,
             "preprocessor_config.json": TINY_QWEN3_PREPROCESSOR,
             "video_preprocessor_config.json": TINY_QWEN3_VIDEO_PREPROCESSOR}
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2) + "\n")


def make_mtp_predictable(model: Path) -> Path:
    """Turn the Qwen3.5 checkpoint ``model`` (one ``model.safetensors``, random weights) into
    one whose MTP module is accepted part of the time, in place: unit-RMS token embeddings, no
    MLP in the linear layers (their token mixing stays whole), and an MTP module
    (``mtp_num_hidden_layers: 1``) that is its full-attention layer again over the token's
    embedding (``fc`` passes it through, identity norms). The linear layers' contribution is
    what the module cannot know, so drafts are accepted part of the time and rejected the
    rest. transformers still reads the checkpoint (it ignores ``mtp.*``)."""
    config = model / "config.json"
    raw = json.loads(config.read_text())
    text = raw["text_config"]
    text["mtp_num_hidden_layers"] = 1
    config.write_text(json.dumps(raw, indent=2))
    file = model / "model.safetensors"
    state = {k: v for k, v in load_file(str(file)).items() if not k.startswith("mtp.")}
    pre = "model.language_model."
    embed = state[pre + "embed_tokens.weight"]
    state[pre + "embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    full = text["layer_types"].index("full_attention")
    for i, kind in enumerate(text["layer_types"]):
        if kind == "linear_attention":
            state[f"{pre}layers.{i}.mlp.down_proj.weight"].zero_()
    h = text["hidden_size"]
    state["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        state[f"mtp.{name}.weight"] = torch.zeros(h)
    layer = f"{pre}layers.{full}."
    for key in [k for k in state if k.startswith(layer)]:
        state["mtp.layers.0." + key[len(layer):]] = state[key].clone()
    state["mtp.norm.weight"] = state[pre + "norm.weight"].clone()
    save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})
    return model
