"""Loading a draft into the model it holds, on the target's device and TP ranks: an EAGLE draft
directory, in any layout :mod:`engine.models.eagle.draft` describes (EAGLE-1/2 or EAGLE-3), or a
Qwen3.5 checkpoint, whose ``mtp.*`` module is the draft (:mod:`engine.models.eagle.mtp`).
``--draft mtp`` (:data:`MTP_DRAFT`) names the target checkpoint itself (:func:`draft_source`)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import TextConfig
from engine.errors import CheckpointError
from engine.models.eagle.eagle3 import Draft, build_draft
from engine.models.eagle.layouts import read_draft
from engine.models.eagle.mtp import MtpDraft, is_mtp_checkpoint, read_mtp
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard

MTP_DRAFT = "mtp"  # --draft mtp: the target checkpoint's own MTP module


def draft_source(draft: str | Path, model_dir: str | Path) -> Path:
    """The directory a ``--draft`` value names beside the target ``model_dir``: the target's own
    checkpoint for :data:`MTP_DRAFT` (its MTP module), else ``draft`` itself."""
    return Path(model_dir) if str(draft) == MTP_DRAFT else Path(draft)


def load_draft(
    path: str | Path, target: TextConfig, dtype: torch.dtype,
    device: str | torch.device = "cpu", tp: TPGroup = SINGLE,
) -> Draft:
    """Load the draft in ``path``: an EAGLE draft directory in any accepted layout
    (:mod:`engine.models.eagle.draft`) or a Qwen3.5 checkpoint's MTP module
    (:func:`~engine.models.eagle.mtp.read_mtp`), refused unless it fits the target's text config;
    its weights go straight onto ``device`` (the target's) in ``dtype``. With ``tp`` of several
    ranks, its layer holds this rank's slices (``ConfigError`` when the layer does not split over
    them)."""
    path = Path(path)
    draft: Draft
    if is_mtp_checkpoint(path):
        mtp, state = read_mtp(path, target, device)
        text = mtp.text
        with torch.device("meta"):
            draft = MtpDraft(mtp, tp)
    else:
        cfg, state = read_draft(path, target, device)
        text = cfg.text
        with torch.device("meta"):
            draft = build_draft(cfg, tp)
    if tp.size > 1:
        state = draft_shard(state, TextShard.of(text, tp.rank, tp.size))
    expected = set(draft.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"{path}: draft weights do not match: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    try:
        draft.load_state_dict(state, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: draft tensor shapes do not match: {exc}") from exc
    draft = draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
    draft.fuse()
    return draft


def draft_shard(state: dict[str, torch.Tensor], shard: TextShard) -> dict[str, torch.Tensor]:
    """``state`` (pdserve's draft names) with the layer's tensors cut to ``shard``'s slices."""
    out = {}
    for name, tensor in state.items():
        part = shard.layer_slice(name.split(".", 2)[2]) if name.startswith("layers.") else None
        if part is not None:
            dim, start, stop = part
            tensor = tensor.narrow(dim, start, stop - start).contiguous()
        out[name] = tensor
    return out
