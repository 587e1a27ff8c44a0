"""``pdserve make-tiny-model DIR [--arch ARCH]``: write a tiny random checkpoint of one of
:data:`ARCHS` (Qwen2-VL, the default, with its draft if asked; Qwen3-VL; Qwen3.5)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# what make-tiny-model writes into DIR: it may write there again, over nothing else
TINY_NAMES = frozenset({"config.json", "generation_config.json", "model.safetensors",
                        "preprocessor_config.json", "video_preprocessor_config.json",
                        "tokenizer.json", "draft"})
# --arch values (the model_type written) and how the report names them
ARCHS = {"qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL", "qwen3_5": "Qwen3.5"}
# what only some archs write: the archs that write each
ARCH_ONLY = {"video_preprocessor_config.json": ("qwen3_vl", "qwen3_5"), "draft": ("qwen2_vl",)}


def add_tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=list(ARCHS), default="qwen2_vl",
                   help="the model family (default qwen2_vl; drafts are for qwen2_vl only)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--with-draft", action="store_true",
                      help="also write an EAGLE draft to DIR/draft")
    kind.add_argument("--with-eagle3-draft", action="store_true",
                      help="also write an EAGLE-3 draft (random, half the vocabulary) to "
                           "DIR/draft")
    kind.add_argument("--with-mtp", action="store_true",
                      help="(--arch qwen3_5) write a random MTP module into the checkpoint "
                           "(mtp.* tensors, for --draft mtp)")


def run_tiny_model(args: argparse.Namespace) -> int:
    """Write the ``--arch`` checkpoint (and with ``--with-draft`` or ``--with-eagle3-draft`` its
    draft, seeded ``--seed`` + 1; refused, before anything is written, for an arch other than
    qwen2_vl; ``--with-mtp``, a Qwen3.5 checkpoint's MTP module, for qwen3_5 only)."""
    from engine.builtin.tiny_model import (
        write_tiny_draft,
        write_tiny_eagle3_draft,
        write_tiny_model,
    )
    from engine.builtin.tiny_qwen3 import write_tiny_qwen3_model

    if args.arch != "qwen2_vl" and (args.with_draft or args.with_eagle3_draft):
        flag = "--with-draft" if args.with_draft else "--with-eagle3-draft"
        raise ValueError(f"{flag} writes a draft for --arch qwen2_vl only, not {args.arch}")
    if args.with_mtp and args.arch != "qwen3_5":
        raise ValueError(f"--with-mtp writes Qwen3.5's MTP module, for --arch qwen3_5 only, "
                         f"not {args.arch}")
    target = checked_dir(args.dir)
    remove_stale(target, args.arch)
    if args.arch == "qwen2_vl":
        path = write_tiny_model(target, seed=args.seed)
    else:
        path = write_tiny_qwen3_model(target, args.arch, seed=args.seed, mtp=args.with_mtp)
    print(f"wrote tiny {ARCHS[args.arch]} checkpoint to {path}"
          + (" (with its MTP module: --draft mtp)" if args.with_mtp else ""))
    if args.with_draft:
        draft = write_tiny_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE draft to {draft}")
    if args.with_eagle3_draft:
        draft = write_tiny_eagle3_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE-3 draft to {draft}")
    return 0


def remove_stale(path: Path, arch: str) -> None:
    """Remove from ``path`` what a run for another arch wrote there and ``arch`` does not write
    (a Qwen3 video processor config beside a Qwen2-VL model; a Qwen2-VL draft, which
    ``--draft auto`` would pick up, beside a Qwen3 one)."""
    for name, archs in ARCH_ONLY.items():
        stale = path / name
        if arch in archs:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()


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
