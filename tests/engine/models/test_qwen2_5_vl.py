"""Qwen2.5-VL against transformers (float32, CPU): config parsing in both layouts, the windowed
vision tower against ``model.visual``, greedy generation token-for-token equal to ``generate``
(text, images, videos with their seconds per temporal patch, a mixed batch with chunked
prefill), and EAGLE equal to it too."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from decode_node.spec.eagle_engine import EagleEngine
from engine.builtin.tiny_model import write_random_draft
from engine.checkpoint import load_model
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import CheckpointError, ConfigError
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.models.qwen2_vl.model import Qwen2VLModel
from engine.models.qwen2_vl.vision_qwen2_5 import Qwen25VisionTower
from engine.multimodal.inputs import ImageInput, VideoInput
from tests.conftest import HF25_VISION, HF_SPECIAL, HF_TEXT

IMG, VID, VS, VE = (HF_SPECIAL[k] for k in ("image_token_id", "video_token_id",
                                            "vision_start_token_id", "vision_end_token_id"))
NEW_TOKENS = 16
PATCH_DIM = 3 * 2 * 14 * 14
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


# ---------------------------------------------------------------- config


def flat_layout(nested: dict[str, Any]) -> dict[str, Any]:
    """The published checkpoints' layout of a transformers-5 ``config.json``: text fields at the
    top, ``rope_scaling`` of type mrope with ``rope_theta`` beside it, ``in_chans``."""
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    vision = {k: v for k, v in nested["vision_config"].items() if k != "rope_parameters"}
    vision["in_chans"] = vision.pop("in_channels")
    vision["model_type"] = "qwen2_5_vl"
    return {**{k: v for k, v in nested.items() if k not in ("text_config", "vision_config")},
            **text, "model_type": "qwen2_5_vl", "vision_config": vision,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}


def test_both_layouts_parse_to_the_fields_transformers_was_given(hf25_dir: Path) -> None:
    nested = json.loads((hf25_dir / "config.json").read_text())
    cfg = ModelConfig.from_dir(hf25_dir)
    assert ModelConfig.from_dict(flat_layout(nested)) == cfg
    v = cfg.vision
    assert cfg.model_type == "qwen2_5_vl" and cfg.text.hidden_size == HF_TEXT["hidden_size"]
    assert (v.depth, v.embed_dim, v.hidden_size, v.num_heads, v.intermediate_size) == tuple(
        HF25_VISION[k] for k in ("depth", "hidden_size", "out_hidden_size", "num_heads",
                                 "intermediate_size"))
    assert (v.window_size, v.fullatt_block_indexes, v.tokens_per_second) == (
        HF25_VISION["window_size"], tuple(HF25_VISION["fullatt_block_indexes"]),
        HF25_VISION["tokens_per_second"])
    assert (v.hidden_act, v.window_merged) == ("silu", 2)


def test_qwen2_vl_configs_keep_the_qwen2_5_fields_at_their_defaults(hf_dir: Path) -> None:
    cfg = ModelConfig.from_dir(hf_dir)
    v = cfg.vision
    assert cfg.model_type == "qwen2_vl"
    assert (v.tokens_per_second, v.intermediate_size, v.window_size, v.fullatt_block_indexes) == (
        None, None, None, ())


@pytest.mark.parametrize(("field", "value", "match"), [
    ("window_size", 14, "window_size"),
    ("fullatt_block_indexes", [1, 3], r"fullatt_block_indexes \[3\]"),
    ("fullatt_block_indexes", 1, "fullatt_block_indexes"),
    ("out_hidden_size", 48, "out_hidden_size"),
    ("tokens_per_second", 0, "tokens_per_second"),
    ("intermediate_size", None, "intermediate_size"),
])
def test_bad_vision_fields_are_config_errors_naming_them(
    hf25_dir: Path, field: str, value: Any, match: str
) -> None:
    raw = json.loads((hf25_dir / "config.json").read_text())
    if value is None:
        del raw["vision_config"][field]
    else:
        raw["vision_config"][field] = value
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_weights_of_another_depth_are_named_in_the_checkpoint_error(
    hf25_dir: Path, tmp_path: Path
) -> None:
    raw = json.loads((hf25_dir / "config.json").read_text())
    raw["vision_config"]["depth"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(hf25_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"qwen2_5_vl.*unexpected \['visual\.blocks\.2\."):
        load_model(tmp_path)


# ---------------------------------------------------------------- vision tower


@pytest.fixture(scope="module")
def ours(hf25_dir: Path) -> Qwen2VLModel:
    return load_model(hf25_dir)[1]


def patches(grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


# (1, 8, 12): 2 x 3 whole windows; (1, 6, 10): windows cut short at the bottom and right;
# (2, 4, 4): a two-frame video, windows per frame; (1, 2, 2): one merge block
TOWER_GRIDS = [[(1, 8, 12)], [(1, 6, 10), (2, 4, 4)], [(2, 10, 6)], [(1, 2, 2), (1, 4, 14)]]
# float32 on both sides with the same operations in the same order; batching the equal-length
# windows into one attention call may change the kernel's summation order, a 1e-7 effect, while a
# wrong window, permutation or norm changes outputs by more than 1e-3 (checked below)
TOWER_ATOL = 1e-5


@pytest.mark.parametrize("grids", TOWER_GRIDS, ids=str)
def test_vision_tower_equals_transformers(grids: list[tuple[int, int, int]], ours: Qwen2VLModel,
                                          hf25_model) -> None:  # noqa: ANN001
    x = patches(grids, seed=len(grids))
    with torch.no_grad():
        want = hf25_model.model.visual(x, torch.tensor(grids)).pooler_output
        got = ours.visual(x, grids)
    torch.testing.assert_close(got, want, atol=TOWER_ATOL, rtol=TOWER_ATOL)


def test_windows_matter_for_the_tower_output(ours: Qwen2VLModel) -> None:
    """Not vacuous: the same weights with every block attending over whole frames differ."""
    v = ours.cfg.vision
    full = Qwen25VisionTower(dataclasses.replace(v, fullatt_block_indexes=tuple(range(v.depth))))
    full.load_state_dict(ours.visual.state_dict())
    grids = [(1, 8, 12)]
    x = patches(grids, seed=7)
    with torch.no_grad():
        assert (full(x, grids) - ours.visual(x, grids)).abs().max() > 1e-3


# ---------------------------------------------------------------- generation


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    return ImageInput(patches([grid], seed), grid)


def video(grid: tuple[int, int, int], seed: int, second_per_grid: float) -> VideoInput:
    return VideoInput(patches([grid], seed), grid, second_per_grid)


def block(item: ImageInput | VideoInput) -> list[int]:
    t, h, w = item.grid_thw
    return [VS] + [VID if isinstance(item, VideoInput) else IMG] * (t * h * w // 4) + [VE]


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 370, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cases() -> dict[str, Prompt]:
    a, b, c = image((1, 8, 12), 1), image((1, 6, 10), 2), image((1, 4, 4), 3)
    # tokens_per_second 2: temporal steps of 2 positions, and of 1.5 truncated: (0, 1, 3). With
    # these seeds the tokens change when a video's temporal positions do (checked for 0.5, 1.0
    # and 1.25 seconds in place of 0.75: (0, 1, 2), (0, 2, 4), (0, 2, 5))
    v, w = video((2, 4, 6), 4, 1.0), video((3, 4, 4), 6, 0.75)
    return {
        "text_only": Prompt(token_ids=text(23, 0)),
        "one_image": Prompt(token_ids=text(3, 1) + block(a) + text(5, 2), images=[a]),
        "two_images": Prompt(token_ids=text(4, 3) + block(b) + text(2, 4) + block(c) + text(6, 5),
                             images=[b, c]),
        "video": Prompt(token_ids=text(5, 6) + block(v) + text(4, 7), videos=[v]),
        "image_then_video": Prompt(token_ids=text(2, 8) + block(a) + text(3, 9) + block(w)
                                   + text(6, 10), images=[a], videos=[w]),
    }


@cache
def reference_tokens(name: str, hf25_model) -> tuple[int, ...]:  # noqa: ANN001
    """transformers' greedy tokens for ``cases()[name]`` (images and videos in their own lists,
    as its processor gives them)."""
    prompt = cases()[name]
    ids_t = torch.tensor([list(prompt.token_ids)])
    kwargs: dict[str, torch.Tensor] = {
        "mm_token_type_ids": (ids_t == IMG).int() + 2 * (ids_t == VID).int()}
    if prompt.images:
        kwargs["pixel_values"] = torch.cat([im.patches for im in prompt.images])
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in prompt.images])
    if prompt.videos:
        kwargs["pixel_values_videos"] = torch.cat([v.patches for v in prompt.videos])
        kwargs["video_grid_thw"] = torch.tensor([v.grid_thw for v in prompt.videos])
        kwargs["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in prompt.videos])
    with torch.no_grad():
        out = hf25_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0, **kwargs)
    return tuple(out[0, ids_t.shape[1]:].tolist())


@pytest.mark.parametrize("name", list(cases()))
def test_greedy_equals_transformers(name: str, hf25_dir: Path, hf25_model) -> None:  # noqa: ANN001
    engine = LLMEngine(hf25_dir, EngineConfig(num_pages=64, page_size=8))
    [got] = engine.generate([cases()[name]], GREEDY)
    assert tuple(got.token_ids) == reference_tokens(name, hf25_model)
    engine.scheduler.check_no_leaks()


def test_mixed_batch_with_chunked_prefill_equals_transformers(hf25_dir: Path,
                                                              hf25_model) -> None:  # noqa: ANN001
    names = ["text_only", "two_images", "video", "image_then_video"]
    prompts = [cases()[n] for n in names]
    chunk = 16
    assert chunk < max(len(p.token_ids) for p in prompts)
    engine = LLMEngine(hf25_dir, EngineConfig(num_pages=96, page_size=4,
                                              max_num_batched_tokens=chunk))
    got = engine.generate(prompts, GREEDY)
    assert [tuple(g.token_ids) for g in got] == [reference_tokens(n, hf25_model) for n in names]
    engine.scheduler.check_no_leaks()


# ---------------------------------------------------------------- EAGLE


def test_eagle_greedy_equals_transformers_with_an_image_and_a_video(
    hf25_dir: Path, tmp_path: Path, hf25_model  # noqa: ANN001
) -> None:
    """EAGLE over a random draft: greedy output equals plain decoding, whose tokens are
    transformers' (checked above), whatever the draft proposes."""
    target_text = json.loads((hf25_dir / "config.json").read_text())["text_config"]
    draft_dir = write_random_draft(tmp_path, target_text)
    names = ["one_image", "text_only", "image_then_video"]
    prompts = [cases()[n] for n in names]
    k = 3
    engine = LLMEngine(hf25_dir, EngineConfig(num_pages=64, page_size=8, lookahead_tokens=k,
                                              max_num_batched_tokens=16))
    spec = EagleEngine(engine, load_draft(draft_dir, engine.model_config.text, torch.float32), k)
    got = spec.generate(prompts, GREEDY)
    assert [tuple(g.token_ids) for g in got] == [reference_tokens(n, hf25_model) for n in names]
    assert spec.stats.rounds > 0
    engine.scheduler.check_no_leaks()
