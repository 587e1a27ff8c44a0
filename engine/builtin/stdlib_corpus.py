"""The text corpus of the built-in model: the running interpreter's standard library.

``scripts/train_tiny.py`` trains on the top-level ``*.py`` files of ``sysconfig``'s ``stdlib`` path,
in sorted order, except every :data:`HOLDOUT_EVERY`-th file (from :data:`HOLDOUT_AT`), which it
holds out. Benchmarks cut real-text prompts from those held-out files
(:func:`heldout_prompts`), so the built-in model never saw them in training.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

HOLDOUT_EVERY = 8  # file i of the sorted list is held out when i % HOLDOUT_EVERY == HOLDOUT_AT
HOLDOUT_AT = 3


def stdlib_files() -> list[Path]:
    """Top-level ``*.py`` files of the running interpreter's standard library, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files)."""
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_AT]
    return [f for f in files if f not in held], held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def heldout_prompts(encode: Callable[[str], list[int]], n: int = 16, length: int = 48,
                    held: list[Path] | None = None) -> list[list[int]]:
    """``n`` prompts of up to ``length`` token ids cut from the held-out files at fixed offsets:
    prompt ``i`` comes from file ``i mod F``; the first two passes over the ``F`` files start a
    third and two thirds into a file, later passes ``length`` tokens further each time."""
    files = split_files(stdlib_files())[1] if held is None else held
    encoded: dict[Path, list[int]] = {}
    prompts: list[list[int]] = []
    for i in range(n):
        path = files[i % len(files)]
        ids = encoded.setdefault(path, encode(read_text(path)))
        rnd = i // len(files)
        start = (len(ids) // 3) * (1 + rnd % 2) + (rnd // 2) * length
        prompts.append(ids[start : start + length] or ids[:length])
    return prompts
