"""Checkpoints, prompts and the transformers oracle of ``scripts/device_check.py``.

* :func:`write_tiny_hf` writes a tiny random Qwen2-VL checkpoint with transformers' own
  ``save_pretrained`` (float32, seeded), plus our tiny ``tokenizer.json`` and
  ``preprocessor_config.json``; its special ids are the tokenizer's last ids.
* :func:`tiny_cases` builds text and image prompts for it: token ids, with each image a real PNG
  turned into patches by our image processor and its placeholder block already expanded.
* :func:`hf_greedy` is the oracle: transformers' ``generate``, greedy, batch 1, exactly
  ``new_tokens`` tokens (end-of-sequence suppressed).
* :func:`compare` is one prompt's verdict: equal or not, and the first index that differs.

Only public transformers APIs are used (``Qwen2VLConfig``, the ``*ForConditionalGeneration``
classes, ``from_pretrained``, ``generate``), so any transformers 5.x works.
"""

from __future__ import annotations

import inspect
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.builtin.tiny_model import TINY_PREPROCESSOR
from engine.builtin.tiny_tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, special_token_ids
from engine.device import DTYPES
from engine.multimodal.image_processor import ImageProcessorConfig, process_image
from engine.multimodal.inputs import ImageInput
from engine.multimodal.mrope import num_image_tokens

TINY_VOCAB = 384
TINY_TEXT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    "eos_token_id": None,
    "bos_token_id": None,
}
TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def special_config(vocab_size: int) -> dict[str, Any]:
    """The config's vision token ids: the tiny tokenizer's own special ids."""
    ids = special_token_ids(vocab_size)
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"]}


def write_tiny_hf(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL checkpoint written by transformers (weights ~N(0, 0.08), so greedy
    logits are far from ties), with our tokenizer and preprocessor files beside it."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(text_config=dict(TINY_TEXT), vision_config=dict(TINY_VISION),
                        tie_word_embeddings=False, **special_config(TINY_VOCAB))
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    build_tiny_tokenizer(TINY_VOCAB).save(str(path / "tokenizer.json"))
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class Case:
    """One prompt: token ids (image blocks expanded) and the images' patches, in order."""

    name: str
    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)


def text_ids(n: int, seed: int, vocab_size: int = TINY_VOCAB) -> list[int]:
    """``n`` random ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size - len(SPECIAL_TOKENS), (n,), generator=gen).tolist()


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A random RGB picture, PNG-encoded."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_block(img: ImageInput, vocab_size: int = TINY_VOCAB, merge: int = 2) -> list[int]:
    """``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>``."""
    ids = special_config(vocab_size)
    pads = [ids["image_token_id"]] * num_image_tokens(img.grid_thw, merge)
    return [ids["vision_start_token_id"], *pads, ids["vision_end_token_id"]]


@dataclass(frozen=True)
class TinyPrompts:
    """The tiny model's prompts: text cases, and image cases that all use ``pngs`` in order
    (as ``pdserve generate --image`` gives every prompt the same images)."""

    text: list[Case]
    image: list[Case]
    pngs: list[bytes]


def tiny_cases(model_dir: Path, text_lengths: tuple[int, ...] = (23, 61, 5, 130)) -> TinyPrompts:
    """Text prompts of ``text_lengths`` tokens, and two prompts holding two PNG images each."""
    cfg = ImageProcessorConfig.from_dir(model_dir)
    pngs = [png_bytes(84, 56, 1), png_bytes(60, 100, 2)]
    a, b = (ImageInput(torch.from_numpy(p.patches), p.grid_thw)
            for p in (process_image(x, cfg) for x in pngs))
    texts = [Case(f"text_{n}", text_ids(n, seed)) for seed, n in enumerate(text_lengths)]
    images = [
        Case("text_image_text_image_text",
             text_ids(4, 10) + image_block(a) + text_ids(3, 11) + image_block(b) + text_ids(6, 12),
             [a, b]),
        Case("image_first", image_block(a) + text_ids(9, 13) + image_block(b) + text_ids(2, 14),
             [a, b]),
    ]
    return TinyPrompts(texts, images, pngs)


def hf_load(model_dir: Path, dtype: str, device: str,
            class_name: str = "Qwen2VLForConditionalGeneration") -> Any:  # noqa: ANN401
    """transformers' model ``class_name`` of ``model_dir`` in ``dtype`` on ``device``, with sdpa
    attention."""
    import transformers

    model: Any = getattr(transformers, class_name).from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device).eval()


def hf_greedy(model: Any, case: Case, new_tokens: int, image_token_id: int) -> list[int]:  # noqa: ANN401
    """transformers' greedy continuation of one prompt: exactly ``new_tokens`` ids."""
    device = model.device
    ids = torch.tensor([case.token_ids], device=device)
    kwargs: dict[str, Any] = {}
    if case.images:
        kwargs["pixel_values"] = torch.cat([im.patches for im in case.images]).to(device,
                                                                                   model.dtype)
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in case.images],
                                                device=device)
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers>=5.x
            kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    return [int(t) for t in out[0, len(case.token_ids):].tolist()]


def compare(name: str, ours: list[int], ref: list[int], prompt_len: int) -> dict[str, Any]:
    """One prompt's verdict: equal, first differing index (None if equal) and both token lists."""
    first = next((i for i, (x, y) in enumerate(zip(ours, ref, strict=False)) if x != y), None)
    if first is None and len(ours) != len(ref):
        first = min(len(ours), len(ref))
    return {"name": name, "prompt_len": prompt_len, "equal": first is None,
            "first_diff": first, "ours": ours, "ref": ref}
