"""Writes a tiny random-weight Qwen2-VL-architecture checkpoint in the Hugging Face layout.

The files (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``generation_config.json``, ``preprocessor_config.json``) load with our engine and with
transformers alike. Weights are drawn from a seeded generator, so the same seed writes the same
bytes on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.builtin.tiny_tokenizer import build_tiny_tokenizer, special_token_ids
from engine.checkpoint import save_weights
from engine.config import ModelConfig
from engine.models.eagle.draft import DraftConfig, Eagle3Spec, EagleDraft, draft_config_dict
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.qwen2_vl.model import Qwen2VLModel

TINY_VOCAB = 512
# the tiny target has two layers: an EAGLE-3 draft for it fuses them out of order, one twice
TINY_EAGLE3_LAYERS = (1, 0, 1)


def tiny_config_dict(vocab_size: int = TINY_VOCAB) -> dict[str, Any]:
    """The tiny model's ``config.json`` (special tokens are the tokenizer's last ids)."""
    special = special_token_ids(vocab_size)
    eos = special["<|im_end|>"]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "image_token_id": special["<|image_pad|>"],
        "video_token_id": special["<|video_pad|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
        "text_config": {
            "model_type": "qwen2_vl_text",
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "bos_token_id": special["<|endoftext|>"],
            "eos_token_id": eos,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]},
        },
        "vision_config": {
            "model_type": "qwen2_vl_vision",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "quick_gelu",
        },
    }


TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 64,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic init: normal(0, 0.02) matrices, zero biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def write_random_draft(draft_dir: str | Path, target_text: dict[str, Any], seed: int = 1) -> Path:
    """Write a random EAGLE draft shaped for a target whose text config (the ``text_config`` of
    its ``config.json``) is ``target_text``, to ``draft_dir``."""
    path = Path(draft_dir)
    path.mkdir(parents=True, exist_ok=True)
    raw = draft_config_dict(target_text, target_text["num_hidden_layers"])
    draft = EagleDraft(DraftConfig.from_dict(raw))
    init_weights(draft, seed)
    state = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def random_vocab_map(target_vocab: int, draft_vocab: int, seed: int) -> torch.Tensor:
    """A seeded ``d2t`` ``[draft_vocab]``: draft id ``d`` is target id ``d + d2t[d]``, the
    draft vocabulary a random sorted subset of the target's."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values
    return ids - torch.arange(draft_vocab)


def write_random_eagle3_draft(draft_dir: str | Path, target_text: dict[str, Any],
                              spec: Eagle3Spec, seed: int = 1) -> Path:
    """Write a random EAGLE-3 draft in pdserve's own layout, of ``spec``'s layers and vocabulary
    size (a random subset of the target's), for a target whose text config is
    ``target_text``, to ``draft_dir``."""
    path = Path(draft_dir)
    path.mkdir(parents=True, exist_ok=True)
    raw = draft_config_dict(target_text, target_text["num_hidden_layers"], eagle3=spec)
    draft = Eagle3Draft(DraftConfig.from_dict(raw))
    init_weights(draft, seed)
    draft.d2t.copy_(random_vocab_map(target_text["vocab_size"], spec.draft_vocab_size, seed))
    state = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def write_tiny_eagle3_draft(draft_dir: str | Path, seed: int = 1,
                            draft_vocab: int = TINY_VOCAB // 2) -> Path:
    """Write a random EAGLE-3 draft for the tiny model (layers :data:`TINY_EAGLE3_LAYERS`, a
    draft vocabulary of ``draft_vocab`` of its tokens) to ``draft_dir``."""
    spec = Eagle3Spec(TINY_EAGLE3_LAYERS, draft_vocab)
    return write_random_eagle3_draft(draft_dir, tiny_config_dict()["text_config"], spec, seed)


def write_tiny_draft(draft_dir: str | Path, seed: int = 1, vocab_size: int = TINY_VOCAB) -> Path:
    """Write a random EAGLE draft for the tiny model to ``draft_dir``."""
    return write_random_draft(draft_dir, tiny_config_dict(vocab_size)["text_config"], seed)


def write_tiny_model(model_dir: str | Path, seed: int = 0, vocab_size: int = TINY_VOCAB) -> Path:
    """Write the tiny checkpoint to ``model_dir`` (created if needed) and return its path."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(vocab_size)
    model = Qwen2VLModel(ModelConfig.from_dict(raw))
    init_weights(model, seed)
    save_weights(model, path)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    eos = raw["text_config"]["eos_token_id"]
    generation = {"eos_token_id": eos, "bos_token_id": raw["text_config"]["bos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    build_tiny_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    return path
