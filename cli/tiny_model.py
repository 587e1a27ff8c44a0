"""``pdserve make-tiny-model DIR``: write the built-in tiny random checkpoint (and its draft)."""

from __future__ import annotations

import argparse


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
    from engine.tiny_model import write_tiny_draft, write_tiny_eagle3_draft, write_tiny_model

    path = write_tiny_model(args.dir, seed=args.seed)
    print(f"wrote tiny Qwen2-VL checkpoint to {path}")
    if args.with_draft:
        draft = write_tiny_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE draft to {draft}")
    if args.with_eagle3_draft:
        draft = write_tiny_eagle3_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE-3 draft to {draft}")
    return 0
