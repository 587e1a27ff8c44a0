"""``pdserve make-tiny-model DIR``: write the built-in tiny random checkpoint (and its draft)."""

from __future__ import annotations

import argparse
from pathlib import Path

# what make-tiny-model writes into DIR: it may write there again, over nothing else
TINY_NAMES = frozenset({"config.json", "generation_config.json", "model.safetensors",
                        "preprocessor_config.json", "tokenizer.json", "draft"})


def add_tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--with-draft", action="store_true",
                      help="also write an EAGLE draft to DIR/draft")
    kind.add_argument("--with-eagle3-draft", action="store_true",
                      help="also write an EAGLE-3 draft (random, half the vocabulary) to "
                           "DIR/draft")


def run_tiny_model(args: argparse.Namespace) -> int:
    """Write the checkpoint (and with ``--with-draft`` or ``--with-eagle3-draft`` its draft,
    seeded ``--seed`` + 1)."""
    from engine.builtin.tiny_model import (
        write_tiny_draft,
        write_tiny_eagle3_draft,
        write_tiny_model,
    )

    path = write_tiny_model(checked_dir(args.dir), seed=args.seed)
    print(f"wrote tiny Qwen2-VL checkpoint to {path}")
    if args.with_draft:
        draft = write_tiny_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE draft to {draft}")
    if args.with_eagle3_draft:
        draft = write_tiny_eagle3_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE-3 draft to {draft}")
    return 0


def checked_dir(text: str) -> Path:
    """``DIR`` if the checkpoint may be written there: a new or empty directory, or one holding
    only what this command writes (so a re-run, such as a restarted init container's, works);
    raises ValueError otherwise (an empty DIR was the current directory, and a model
    directory's files were overwritten)."""
    if not text.strip():
        raise ValueError("DIR must not be empty")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    others = sorted(p.name for p in path.iterdir() if p.name not in TINY_NAMES) \
        if path.is_dir() else []
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise ValueError(f"{path} holds files the tiny checkpoint does not write ({shown}): "
                         "give a new or empty directory")
    return path
