"""Reading PyTorch ``.bin`` checkpoints: one ``pytorch_model.bin``, or a sharded set listed in
``pytorch_model.bin.index.json`` (the layout EAGLE-1/EAGLE-2 drafts are published in).

Each file is read with ``torch.load(..., weights_only=True)``: only tensors and plain containers
are ever built from it, and a file holding anything else is refused, naming it. The tensors are
read whole (no partial reads, unlike safetensors), so this reader serves the small EAGLE drafts;
the target model's reader, :mod:`engine.checkpoint`, stays safetensors-only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint import indexed_files
from engine.errors import CheckpointError

BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def bin_files(model_dir: Path) -> list[Path]:
    """The ``.bin`` files of a checkpoint: the shards its index lists (every one must be there),
    or else its single ``pytorch_model.bin``."""
    index = model_dir / BIN_INDEX
    if index.is_file():
        return indexed_files(index)
    file = model_dir / BIN_FILE
    if not file.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors, {BIN_FILE} or {BIN_INDEX}")
    return [file]


def read_bin_state_dict(model_dir: Path,
                        device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of ``model_dir``'s ``.bin`` files under their stored names, on ``device``.
    ``CheckpointError`` names the file that is unreadable, holds anything but a mapping of
    names to tensors, or repeats a name another shard holds."""
    state: dict[str, torch.Tensor] = {}
    for file in bin_files(model_dir):
        part = _load(file)
        repeated = sorted(state.keys() & part.keys())
        if repeated:
            raise CheckpointError(f"{file}: holds tensors another shard holds too: "
                                  f"{repeated[:8]}")
        state.update({name: t.to(device) for name, t in part.items()})
    return state


def _load(file: Path) -> dict[str, torch.Tensor]:
    """One ``.bin`` file's tensors, on the host."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types on bad or unsafe files
        raise CheckpointError(f"{file}: unreadable, or holds more than plain tensors: "
                              f"{exc}") from exc
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{file}: not a mapping of tensor names to tensors")
    return state
