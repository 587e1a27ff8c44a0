"""Loading an EAGLE draft directory, in any layout :mod:`engine.models.eagle.draft` describes,
into the draft model it holds (EAGLE-1/2 or EAGLE-3), on the target's device and TP ranks."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import TextConfig
from engine.errors import CheckpointError, ConfigError
from engine.models.eagle.draft import EagleDraft
from engine.models.eagle.eagle3 import Eagle3Draft, build_draft
from engine.models.eagle.layouts import read_draft
from engine.parallel.group import SINGLE, TPGroup
from engine.parallel.shard import TextShard

HYBRID_DRAFT_REASON = (
    "speculative decoding of a hybrid model (linear-attention layers) is not supported yet: "
    "verification would leave the rejected draft tokens in the linear-attention state; run "
    "without --draft")


def check_draft_target(target: TextConfig) -> None:
    """Raise ``ConfigError`` when a draft cannot run against ``target`` at all (a hybrid
    model: :data:`HYBRID_DRAFT_REASON`)."""
    if target.is_hybrid:
        raise ConfigError(HYBRID_DRAFT_REASON)


def load_draft(
    path: str | Path, target: TextConfig, dtype: torch.dtype,
    device: str | torch.device = "cpu", tp: TPGroup = SINGLE,
) -> EagleDraft | Eagle3Draft:
    """Load an EAGLE draft directory in any accepted layout (:mod:`engine.models.eagle.draft`),
    refused unless it fits the target's text config; its weights go straight onto ``device`` (the
    target's) in ``dtype``. With ``tp`` of several ranks, its layer holds this rank's slices
    (``ConfigError`` when the layer does not split over them)."""
    check_draft_target(target)
    cfg, state = read_draft(Path(path), target, device)
    if tp.size > 1:
        state = draft_shard(state, TextShard.of(cfg.text, tp.rank, tp.size))
    with torch.device("meta"):
        draft = build_draft(cfg, tp)
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
