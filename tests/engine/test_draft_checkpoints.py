"""Original-layout (EAGLE-1/EAGLE-2) drafts as people have them load into pdserve's draft.

PyTorch ``.bin`` files: one ``pytorch_model.bin``, or shards listed in
``pytorch_model.bin.index.json``, as SafeAILab publishes EAGLE drafts. The oracle is the same
draft written in pdserve's own layout: config and weights must be equal bit for bit. Missing
shards and files holding more than tensors are refused, naming them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_draft_layouts import (
    TARGET,
    VARIANTS,
    NotATensor,
    eagle_config,
    eagle_tensors,
    write_eagle_draft,
    write_pdserve_twin,
)

from engine.errors import CheckpointError
from engine.models.eagle import load_draft

Tensors = dict[str, torch.Tensor]
SHARDS = 3
def write_bin_shards(path: Path, config: dict[str, Any], tensors: Tensors) -> Path:
    """A draft whose ``tensors`` lie in :data:`SHARDS` ``.bin`` files and an index, named as
    transformers' ``save_pretrained`` names them."""
    path.mkdir(parents=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(SHARDS):
        file = f"pytorch_model-{i + 1:05d}-of-{SHARDS:05d}.bin"
        part = {n: tensors[n] for n in names[i::SHARDS]}
        torch.save(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_st(path: Path, config: dict[str, Any], tensors: Tensors) -> Path:
    return write_eagle_draft(path, config, tensors)


def write_bin(path: Path, config: dict[str, Any], tensors: Tensors) -> Path:
    return write_eagle_draft(path, config, tensors, bin_file=True)


Writer = Callable[[Path, dict[str, Any], Tensors], Path]
# (config changes, tensor-generating config changes, writer)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], Writer]] = {
    "bin": ({}, {}, write_bin),
    "bin_shards": (VARIANTS["qwen2"], VARIANTS["qwen2"], write_bin_shards),
}


def assert_loads_as_twin(draft_dir: Path, twin_dir: Path) -> None:
    draft = load_draft(draft_dir, TARGET, torch.float32)
    twin = load_draft(twin_dir, TARGET, torch.float32)
    assert draft.cfg == twin.cfg
    mine, theirs = draft.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("case", list(CASES))
def test_a_draft_as_published_loads_as_its_pdserve_twin(tmp_path: Path, case: str) -> None:
    changes, generated, write = CASES[case]
    config = eagle_config(**changes)
    tensors = eagle_tensors(eagle_config(**generated))
    draft_dir = write(tmp_path / "draft", config, tensors)
    assert_loads_as_twin(draft_dir, write_pdserve_twin(tmp_path / "twin", config, tensors))


def test_safetensors_win_over_bin_files(tmp_path: Path) -> None:
    config = eagle_config()
    tensors = eagle_tensors(config)
    draft_dir = write_st(tmp_path / "draft", config, tensors)
    torch.save({"stale": torch.zeros(1)}, draft_dir / "pytorch_model.bin")
    assert_loads_as_twin(draft_dir, write_pdserve_twin(tmp_path / "twin", config, tensors))


def test_a_pdserve_layout_draft_may_come_as_a_bin_file(tmp_path: Path) -> None:
    config = eagle_config()
    tensors = eagle_tensors(config)
    twin_dir = write_pdserve_twin(tmp_path / "twin", config, tensors)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((twin_dir / "config.json").read_text())
    torch.save(load_file(twin_dir / "model.safetensors"), bin_dir / "pytorch_model.bin")
    assert_loads_as_twin(bin_dir, twin_dir)


def shards_of(tmp_path: Path) -> tuple[Path, list[Path]]:
    config = eagle_config()
    path = write_bin_shards(tmp_path / "draft", config, eagle_tensors(config))
    return path, sorted(path.glob("pytorch_model-*.bin"))


def test_a_missing_shard_is_refused_by_name(tmp_path: Path) -> None:
    path, files = shards_of(tmp_path)
    files[1].unlink()
    with pytest.raises(CheckpointError, match="shards listed in the index are missing: "
                                              f"\\['{files[1].name}'\\]"):
        load_draft(path, TARGET, torch.float32)


def test_a_shard_holding_more_than_tensors_is_refused_by_name(tmp_path: Path) -> None:
    path, files = shards_of(tmp_path)
    torch.save({"extra": NotATensor()}, files[2])
    with pytest.raises(CheckpointError, match=f"{files[2].name}: unreadable, or holds more "
                                              "than plain tensors"):
        load_draft(path, TARGET, torch.float32)


def test_a_bin_file_that_is_not_a_tensor_mapping_is_refused(tmp_path: Path) -> None:
    path, files = shards_of(tmp_path)
    torch.save([torch.zeros(2)], files[0])
    with pytest.raises(CheckpointError, match=f"{files[0].name}: not a mapping of tensor "
                                              "names to tensors"):
        load_draft(path, TARGET, torch.float32)


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    path, files = shards_of(tmp_path)
    first = torch.load(files[0], weights_only=True)
    torch.save({**torch.load(files[1], weights_only=True), **first}, files[1])
    with pytest.raises(CheckpointError, match=f"{files[1].name}: holds tensors another shard "
                                              "holds too"):
        load_draft(path, TARGET, torch.float32)


def test_no_weight_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(eagle_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors, pytorch_model.bin or "
                                              "pytorch_model.bin.index.json"):
        load_draft(tmp_path, TARGET, torch.float32)
