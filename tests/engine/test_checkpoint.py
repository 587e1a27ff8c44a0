"""Checkpoint loading: clear errors for bad model directories and weight files; sharded, tied and
tokenizer-less checkpoints load; our tiny model is a valid transformers checkpoint and is written
deterministically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.builtin.tiny_model import write_tiny_model
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import CheckpointError, ConfigError, InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from tests.conftest import HF_SPECIAL, write_hf_checkpoint

PATCH_DIM = 3 * 2 * 14 * 14
NEW_TOKENS = 16
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def text_ids(n: int, seed: int, high: int = 370) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), generator=gen).tolist()


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen), grid)


def ours(model_dir: Path, ids: list[int], images: list[ImageInput] | None = None) -> list[int]:
    engine = LLMEngine(model_dir, EngineConfig(num_pages=64, page_size=8))
    [res] = engine.generate([Prompt(token_ids=ids, images=images or [])], GREEDY)
    engine.scheduler.check_no_leaks()
    return res.token_ids


def transformers_greedy(
    hf_model, ids: list[int], images: list[ImageInput], image_token_id: int  # noqa: ANN001
) -> list[int]:
    ids_t = torch.tensor([ids])
    kwargs: dict[str, Any] = {}
    if images:
        kwargs = {
            "pixel_values": torch.cat([im.patches for im in images]),
            "image_grid_thw": torch.tensor([im.grid_thw for im in images]),
            "mm_token_type_ids": (ids_t == image_token_id).int(),
        }
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def load_hf(model_dir: Path):  # noqa: ANN201 - transformers model
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()


# ---- config errors ----------------------------------------------------------------------------


def test_unknown_model_type_is_a_config_error_naming_it(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    edit_config(ckpt, model_type="llama")
    with pytest.raises(ConfigError, match="llama"):
        ModelConfig.from_dir(ckpt)
    with pytest.raises(ConfigError, match="llama"):
        load_model(ckpt)


def test_missing_model_type_is_a_config_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["model_type"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="model_type"):
        load_model(ckpt)


def test_missing_config_json_is_a_config_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(ckpt)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(ckpt)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path / "does-not-exist")


def test_config_json_that_is_not_json_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_dir(tmp_path)


def test_config_without_vision_config_is_a_config_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["vision_config"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="vision_config"):
        ModelConfig.from_dir(ckpt)


@pytest.mark.parametrize("content", ["[]", '"qwen2_vl"', "null"])
def test_config_json_that_is_not_an_object_is_a_config_error(content: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError):
        ModelConfig.from_dir(tmp_path)


def test_short_mrope_section_is_a_config_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [4, 4]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig.from_dir(ckpt)


def test_generation_config_that_is_not_an_object_is_a_config_error(
    hf_dir: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    (ckpt / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="generation_config"):
        ModelConfig.from_dir(ckpt)


def test_inconsistent_config_is_a_config_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]  # head_dim is 16
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="mrope_section"):
        ModelConfig.from_dir(ckpt)


# ---- weight file errors -----------------------------------------------------------------------


def weights(ckpt: Path) -> Path:
    [path] = ckpt.glob("*.safetensors")
    return path


def test_truncated_safetensors_is_a_checkpoint_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    path = weights(ckpt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(ckpt)


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 7, b"not a safetensors file at all" * 10,
                                     (2**40).to_bytes(8, "little") + b"{}"])
def test_garbage_safetensors_is_a_checkpoint_error(
    garbage: bytes, hf_dir: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    weights(ckpt).write_bytes(garbage)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(ckpt)


def test_missing_tensor_is_a_checkpoint_error_naming_it(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    path = weights(ckpt)
    state = load_file(str(path))
    victim = next(k for k in state if "layers.1.mlp.up_proj" in k)
    del state[victim]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.mlp\.up_proj"):
        load_model(ckpt)


def test_unexpected_tensor_is_a_checkpoint_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    path = weights(ckpt)
    state = load_file(str(path))
    state["model.extra.weight"] = torch.zeros(2, 2)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(ckpt)


def test_wrong_tensor_shape_is_a_checkpoint_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    path = weights(ckpt)
    state = load_file(str(path))
    name = next(k for k in state if k.endswith("embed_tokens.weight"))
    state[name] = state[name][:-1].clone()
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="shape"):
        load_model(ckpt)


def test_no_weight_files_is_a_checkpoint_error(hf_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(hf_dir, tmp_path / "c")
    weights(ckpt).unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(ckpt)


# ---- layouts that must load -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    load_hf(hf_dir).save_pretrained(path, max_shard_size="50KB")
    return path


def test_sharded_checkpoint_generates_like_the_unsharded_one(
    hf_dir: Path, sharded_dir: Path
) -> None:
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    assert not (sharded_dir / "model.safetensors").exists()
    img = image((1, 4, 6), 1)
    ids = text_ids(5, 1) + [HF_SPECIAL["vision_start_token_id"]] + [HF_SPECIAL["image_token_id"]] \
        * 6 + [HF_SPECIAL["vision_end_token_id"]] + text_ids(4, 2)
    assert ours(sharded_dir, ids, [img]) == ours(hf_dir, ids, [img])
    assert ours(sharded_dir, text_ids(9, 3)) == ours(hf_dir, text_ids(9, 3))


def test_sharded_checkpoint_with_a_missing_shard_is_a_checkpoint_error(
    sharded_dir: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(sharded_dir, tmp_path / "c")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(ckpt)


def test_sharded_checkpoint_with_a_bad_index_is_a_checkpoint_error(
    sharded_dir: Path, tmp_path: Path
) -> None:
    ckpt = copy_ckpt(sharded_dir, tmp_path / "c")
    (ckpt / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="index"):
        load_model(ckpt)


def test_checkpoint_without_tokenizer_serves_token_ids_only(hf_dir: Path) -> None:
    assert not (hf_dir / "tokenizer.json").exists()
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64))
    assert engine.tokenizer is None
    [res] = engine.generate([Prompt(token_ids=[3, 4, 5])], SamplingParams(max_new_tokens=5,
                                                                           ignore_eos=True))
    assert len(res.token_ids) == 5
    assert res.text is None
    with pytest.raises(InvalidRequestError, match="token_ids"):
        engine.generate([Prompt(text="hello")], GREEDY)
    engine.scheduler.check_no_leaks()


def test_tied_embedding_checkpoint_matches_transformers(tmp_path: Path) -> None:
    ckpt = write_hf_checkpoint(tmp_path / "tied", seed=3, tie=True)
    cfg, model = load_model(ckpt)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf_model = load_hf(ckpt)
    ids = text_ids(13, 4)
    assert ours(ckpt, ids) == transformers_greedy(hf_model, ids, [], HF_SPECIAL["image_token_id"])


def test_tiny_model_loads_in_transformers_and_generates_the_same(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    hf_model = load_hf(tiny_dir)
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=64, page_size=8))
    assert engine.tokenizer is not None
    text_prompt = engine.tokenizer.encode("The character 'a' is called latin small letter a")
    img = image((1, 4, 4), 7)
    image_prompt = [1, 2, cfg.vision_start_token_id, *[cfg.image_token_id] * 4,
                    cfg.vision_end_token_id, *text_prompt[:6]]
    for ids, images in ((text_prompt, []), (image_prompt, [img])):
        [res] = engine.generate([Prompt(token_ids=ids, images=images)], GREEDY)
        assert res.token_ids == transformers_greedy(hf_model, ids, images, cfg.image_token_id)
    engine.scheduler.check_no_leaks()


def test_write_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", seed=0)
    b = write_tiny_model(tmp_path / "b", seed=0)
    c = write_tiny_model(tmp_path / "c", seed=1)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()


def test_a_layer_range_reads_only_those_layers(tiny_dir: Path, tmp_path: Path) -> None:
    """A pipeline stage's load: the other layers' tensors are never read (a checkpoint without
    them still loads for the range), the kept layers equal a full load's, the rest are empty."""
    ckpt = copy_ckpt(tiny_dir, tmp_path / "partial")
    weights = ckpt / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if not k.startswith("model.layers.1.")},
              str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing"):
        load_model(ckpt)
    _, part = load_model(ckpt, layers=range(0, 1))
    _, whole = load_model(tiny_dir)
    assert isinstance(part.model.layers[1], torch.nn.Module) and not list(
        part.model.layers[1].parameters())
    for (name, a), (_, b) in zip(part.model.layers[0].state_dict().items(),
                                 whole.model.layers[0].state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    engine = LLMEngine(ckpt, EngineConfig(num_pages=16, layers=range(0, 1)))
    assert engine.pool.layer_ids == [0]
