"""The built-in model shipped with the package: a trained tiny Qwen2-VL-architecture checkpoint
(with its EAGLE draft in ``draft/``) and the script that trains it (:mod:`engine.builtin.train`)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NAME = "tiny-qwen2-vl"


def builtin_model_dir() -> Path:
    """The trained tiny model's directory (it may be absent from a checkout without weights)."""
    return Path(__file__).parent / BUILTIN_MODEL_NAME
