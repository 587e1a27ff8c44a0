"""Original-layout (EAGLE-1/EAGLE-2) drafts as people have them load into pdserve's draft.

PyTorch ``.bin`` files (one ``pytorch_model.bin``, or shards listed in
``pytorch_model.bin.index.json``, as SafeAILab publishes EAGLE drafts) and SGLang's names
(``model.``-prefixed tensors beside ``lm_head.weight``, ``architectures``
``LlamaForCausalLMEagle`` / ``Qwen2ForCausalLMEagle``), in safetensors or ``.bin``. The oracle is
the same draft written in pdserve's own layout: config and weights must be equal bit for bit.
Missing shards, files holding more than tensors and tensors the layout has no place for are
refused, naming them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
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
from engine.models.eagle.loader import load_draft

Tensors = dict[str, torch.Tensor]
SHARDS = 3
# SGLang's Qwen2 draft class: its config need not say qkv_bias, its layer always has the biases
SGLANG_QWEN2: dict[str, Any] = {"architectures": ["Qwen2ForCausalLMEagle"],
                                "model_type": "qwen2"}


def sglang_names(tensors: Tensors, config: dict[str, Any]) -> Tensors:
    """``tensors`` as SGLang's EAGLE draft classes name them: ``model.`` before every name, and
    their own ``lm_head.weight`` (random: the target's head serves at run time)."""
    head = torch.randn(config["vocab_size"], config["hidden_size"],
                       generator=torch.Generator().manual_seed(3))
    return {**{f"model.{n}": t for n, t in tensors.items()}, "lm_head.weight": head}


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
# (config changes, tensor-generating config changes, SGLang names?, writer)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], bool, Writer]] = {
    "bin": ({}, {}, False, write_bin),
    "bin_shards": (VARIANTS["qwen2"], VARIANTS["qwen2"], False, write_bin_shards),
    "sglang_llama_safetensors": ({"architectures": ["LlamaForCausalLMEagle"]}, {}, True,
                                 write_st),
    "sglang_qwen2_bin": (SGLANG_QWEN2, {"qkv_bias": True}, True, write_bin),
    "sglang_bin_shards": ({"architectures": ["LlamaForCausalLMEagle"], "bias": False},
                          {"bias": False}, True, write_bin_shards),
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
    changes, generated, sglang, write = CASES[case]
    config = eagle_config(**changes)
    tensors = eagle_tensors(eagle_config(**generated))
    stored = sglang_names(tensors, config) if sglang else tensors
    draft_dir = write(tmp_path / "draft", config, stored)
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


def _input_norm(t: Tensors) -> None:
    t["model.layers.0.input_layernorm.weight"] = torch.ones(64)


def _final_norm(t: Tensors) -> None:
    t["model.norm.weight"] = torch.ones(64)


def _stray(t: Tensors) -> None:
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)


def _no_post_norm(t: Tensors) -> None:
    del t["model.layers.0.post_attention_layernorm.weight"]


def _mixed(t: Tensors) -> None:
    t["fc.weight"] = t.pop("model.fc.weight")


def _small_head(t: Tensors) -> None:
    t["lm_head.weight"] = t["lm_head.weight"][:100]


def _misshapen(t: Tensors) -> None:
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)


PREFIX_NOTE = " \\(names read without SGLang's 'model.' prefix\\)"
NORMS = "; the original EAGLE layout has no input norm and no final norm, but "
BAD_SGLANG = [
    (_input_norm, f"unexpected \\['layers.0.input_layernorm.weight'\\]{PREFIX_NOTE}{NORMS}"
                  "\\['layers.0.input_layernorm.weight'\\] are there"),
    (_final_norm, f"unexpected \\['norm.weight'\\]{PREFIX_NOTE}{NORMS}\\['norm.weight'\\]"),
    (_stray, "unexpected \\['layers.0.self_attn.rotary_emb.inv_freq'\\]" + PREFIX_NOTE + "$"),
    (_no_post_norm, "missing \\['layers.0.post_attention_layernorm.weight'\\], unexpected "
                    "\\[\\]"),
    (_mixed, "tensor names mix SGLang's 'model.' prefix \\(as in '.*'\\) and the original "
             "EAGLE names: \\['fc.weight'\\] lack it"),
    (_small_head, "lm_head.weight has shape \\[100, 64\\], not the target LM head's "
                  "\\[512, 64\\]"),
    (_misshapen, "(?s)draft tensor shapes do not match.*up_proj"),
]


@pytest.mark.parametrize(("change", "message"), BAD_SGLANG,
                         ids=["input_norm", "final_norm", "stray", "no_post_norm", "mixed",
                              "head_shape", "layer_shape"])
def test_sglang_names_that_do_not_fit_are_refused_saying_what_differs(
        tmp_path: Path, change: Callable[[Tensors], None], message: str) -> None:
    config = eagle_config(architectures=["LlamaForCausalLMEagle"])
    tensors = sglang_names(eagle_tensors(config), config)
    change(tensors)
    with pytest.raises(CheckpointError, match=message):
        load_draft(write_bin(tmp_path, config, tensors), TARGET, torch.float32)


def test_sglang_qwen2_without_qkv_biases_is_refused_naming_the_config_key(
        tmp_path: Path) -> None:
    config = eagle_config(**SGLANG_QWEN2)
    tensors = sglang_names(eagle_tensors(config), config)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="q/k/v biases True \\(config 'qkv_bias'\\): "
                                              "missing \\['layers.0.self_attn.k_proj.bias'"):
        load_draft(tmp_path, TARGET, torch.float32)
