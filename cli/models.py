"""Where the ``pdserve`` command finds a model when ``--model`` is not given, and its cache."""

from __future__ import annotations

import os
from pathlib import Path

from engine.builtin import builtin_alias_dir, builtin_model_dir


def cache_dir() -> Path:
    """``$PDSERVE_CACHE`` or ``~/.cache/pdserve``: the random tiny model, and launch's state."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_model_dir() -> Path:
    """Where a random tiny model is written when the package ships no trained one."""
    return cache_dir() / "tiny-qwen2-vl"


def ensure_model(model: str | None) -> Path:
    """The model directory ``model`` names: a path, or ``builtin`` / ``builtin:NAME`` for a
    shipped trained model (``builtin:qwen2-vl``, ``builtin:hybrid``; ``ValueError`` for another
    name or one whose weights this checkout lacks); without ``model``, the shipped trained tiny
    model, else a random tiny model written on first use. A directory called ``builtin`` is
    named ``./builtin``."""
    if model:
        alias = builtin_alias_dir(model)
        if alias is None:
            return Path(model)
        if not (alias / "config.json").is_file():
            raise ValueError(f"the built-in model {model!r} is not in this checkout "
                             f"({alias} has no config.json)")
        return alias
    if (builtin_model_dir() / "config.json").is_file():
        return builtin_model_dir()
    from engine.builtin.tiny_model import write_tiny_model

    path = default_model_dir()
    if not (path / "config.json").is_file():
        write_tiny_model(path)
    return path
