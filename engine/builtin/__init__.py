"""The built-in model shipped with the package: a trained tiny Qwen2-VL-architecture checkpoint
(with its EAGLE draft in ``draft/``), beside the code that writes tiny checkpoints
(``tiny_model``), trains their tokenizer (``tiny_tokenizer``) and reads the corpus
(``stdlib_corpus``). ``scripts/train_tiny.py`` trains it (a script, not part of
the engine: its closing check runs the decode node's EAGLE loop)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NAME = "tiny-qwen2-vl"


def builtin_model_dir() -> Path:
    """The trained tiny model's directory (it may be absent from a checkout without weights)."""
    return Path(__file__).parent / BUILTIN_MODEL_NAME
