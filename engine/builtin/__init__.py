"""The built-in models shipped with the package: a trained tiny Qwen2-VL-architecture checkpoint
(with its EAGLE draft in ``draft/``) and its hybrid sibling, a trained tiny Qwen3.5-shaped
checkpoint (Gated DeltaNet and gated full-attention layers, with a trained MTP head inside its
weights), beside the code that writes tiny checkpoints (``tiny_model``, ``tiny_qwen3``), trains
their tokenizer (``tiny_tokenizer``) and reads the corpus (``stdlib_corpus``).
``scripts/train_tiny.py`` and ``scripts/train_tiny_hybrid.py`` train them (scripts, not part of
the engine: their closing checks run the decode node's EAGLE loop)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NAME = "tiny-qwen2-vl"
BUILTIN_HYBRID_MODEL_NAME = "tiny-qwen3_5"
# ``--model builtin:NAME`` -> the directory of this package it names (``builtin`` alone: the first)
BUILTIN_MODELS = {"qwen2-vl": BUILTIN_MODEL_NAME, "hybrid": BUILTIN_HYBRID_MODEL_NAME}
BUILTIN_PREFIX = "builtin"


def builtin_model_dir() -> Path:
    """The trained tiny model's directory (it may be absent from a checkout without weights)."""
    return Path(__file__).parent / BUILTIN_MODEL_NAME


def builtin_hybrid_model_dir() -> Path:
    """The trained tiny hybrid (Qwen3.5-shaped, MTP head) model's directory."""
    return Path(__file__).parent / BUILTIN_HYBRID_MODEL_NAME


def builtin_alias_dir(model: str) -> Path | None:
    """The directory ``model`` names when it is ``builtin`` or ``builtin:NAME`` (a name of
    :data:`BUILTIN_MODELS`), None when it is not of that form. Raises ``ValueError`` for an
    unknown ``NAME``."""
    prefix, sep, name = model.partition(":")
    if prefix != BUILTIN_PREFIX:
        return None
    if not sep:
        return builtin_model_dir()
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {model!r}: expected {BUILTIN_PREFIX} or one of "
                         + ", ".join(f"{BUILTIN_PREFIX}:{n}" for n in BUILTIN_MODELS))
    return Path(__file__).parent / BUILTIN_MODELS[name]
