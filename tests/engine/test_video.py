"""Video input: greedy generation is token-for-token identical to transformers' ``generate`` on
the tiny Qwen2-VL checkpoint (float32, CPU) for a video, a video between two images, and a
mixed batch whose prompts are prefilled in chunks that cut through video blocks; bad videos are
clear request errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode_node.spec.eagle_engine import EagleEngine
from engine.builtin.tiny_model import write_random_draft
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.multimodal.inputs import ImageInput, VideoInput
from tests.conftest import HF_SPECIAL

IMG, VID = HF_SPECIAL["image_token_id"], HF_SPECIAL["video_token_id"]
VS, VE = HF_SPECIAL["vision_start_token_id"], HF_SPECIAL["vision_end_token_id"]
NEW_TOKENS = 12
PATCH_DIM = 3 * 2 * 14 * 14
Visual = ImageInput | VideoInput


def patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen)


def video(grid: tuple[int, int, int], seed: int) -> VideoInput:
    return VideoInput(patches(grid, seed), grid)


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    return ImageInput(patches(grid, seed), grid)


def block(item: Visual) -> list[int]:
    t, h, w = item.grid_thw
    pad = VID if isinstance(item, VideoInput) else IMG
    return [VS] + [pad] * (t * h * w // 4) + [VE]


def text(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 370, (n,), generator=gen).tolist()


_REFERENCES: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> tokens (one oracle model)


def reference(hf_model, ids: list[int], items: list[Visual]) -> list[int]:  # noqa: ANN001
    """transformers' greedy tokens: images and videos go in their own lists, as its processor
    gives them. Cached by prompt ids (every prompt here has its own ids)."""
    if tuple(ids) not in _REFERENCES:
        _REFERENCES[tuple(ids)] = _generate(hf_model, ids, items)
    return _REFERENCES[tuple(ids)]


def _generate(hf_model, ids: list[int], items: list[Visual]) -> list[int]:  # noqa: ANN001
    ids_t = torch.tensor([ids])
    images = [x for x in items if isinstance(x, ImageInput)]
    videos = [x for x in items if isinstance(x, VideoInput)]
    kwargs: dict[str, torch.Tensor] = {
        "mm_token_type_ids": (ids_t == IMG).int() + 2 * (ids_t == VID).int()}
    if images:
        kwargs["pixel_values"] = torch.cat([x.patches for x in images])
        kwargs["image_grid_thw"] = torch.tensor([x.grid_thw for x in images])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([x.patches for x in videos])
        kwargs["video_grid_thw"] = torch.tensor([x.grid_thw for x in videos])
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def prompt(ids: list[int], items: list[Visual]) -> Prompt:
    return Prompt(token_ids=ids,
                  images=[x for x in items if isinstance(x, ImageInput)],
                  videos=[x for x in items if isinstance(x, VideoInput)])


def cases() -> dict[str, tuple[list[int], list[Visual]]]:
    v2, v3 = video((2, 4, 4), 1), video((3, 4, 6), 2)
    a, b = image((1, 4, 6), 3), image((1, 2, 2), 4)
    return {
        "video_t2": (text(3, 1) + block(v2) + text(5, 2), [v2]),
        "image_video_image": (
            text(2, 3) + block(a) + text(3, 4) + block(v3) + text(2, 5) + block(b) + text(4, 6),
            [a, v3, b]),
    }


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name", list(cases()))
def test_video_prompt_matches_transformers(name: str, hf_dir: Path, hf_model) -> None:  # noqa: ANN001
    ids, items = cases()[name]
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8))
    [ours] = engine.generate([prompt(ids, items)], GREEDY)
    assert ours.token_ids == reference(hf_model, ids, items)
    engine.scheduler.check_no_leaks()


def test_mixed_batch_with_chunked_prefill_matches_transformers(hf_dir: Path, hf_model) -> None:  # noqa: ANN001
    v = video((3, 2, 4), 5)
    batch = [*cases().values(), (text(9, 7), []), (block(v) + text(6, 8), [v])]
    chunk = 10  # cuts through the video blocks
    assert chunk < max(len(ids) for ids, _ in batch)
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=96, page_size=4,
                                            max_num_batched_tokens=chunk))
    results = engine.generate([prompt(ids, items) for ids, items in batch], GREEDY)
    for (ids, items), ours in zip(batch, results, strict=True):
        assert ours.token_ids == reference(hf_model, ids, items)
    engine.scheduler.check_no_leaks()


def test_eagle_with_videos_matches_transformers(hf_dir: Path, hf_model, tmp_path: Path) -> None:  # noqa: ANN001
    """EAGLE over a random draft, speculating from video prompts (in chunks through the video
    blocks): greedy output equals transformers', whatever the draft proposes."""
    target_text = json.loads((hf_dir / "config.json").read_text())["text_config"]
    draft_dir = write_random_draft(tmp_path / "draft", target_text)
    k = 3
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=96, page_size=4, lookahead_tokens=k,
                                            max_num_batched_tokens=10))
    spec = EagleEngine(engine, load_draft(draft_dir, engine.model_config.text, torch.float32), k)
    batch = list(cases().values())
    results = spec.generate([prompt(ids, items) for ids, items in batch], GREEDY)
    for (ids, items), ours in zip(batch, results, strict=True):
        assert ours.token_ids == reference(hf_model, ids, items)
    assert spec.stats.rounds > 0
    engine.scheduler.check_no_leaks()


BAD: dict[str, tuple[list[int], list[VideoInput], str]] = {
    "no_video_tokens": ([1, 2], [video((2, 2, 2), 0)], "1 videos given"),
    "no_videos": ([1, VID, 2], [], "video tokens"),
    "bad_grid": ([1, VID], [VideoInput(torch.zeros(6, PATCH_DIM), (2, 3, 1))], "video 0: grid"),
    "bad_shape": ([1, VID], [VideoInput(torch.zeros(3, PATCH_DIM), (2, 2, 2))], "shape"),
    "nan_patches": ([1, VID], [VideoInput(torch.full((8, PATCH_DIM), float("nan")), (2, 2, 2))],
                    "NaN"),
    "float64_patches": ([1, VID], [VideoInput(torch.zeros(8, PATCH_DIM, dtype=torch.float64),
                                              (2, 2, 2))], "float32"),
    "zero_seconds": ([1, VID], [VideoInput(torch.zeros(8, PATCH_DIM), (2, 2, 2), 0.0)],
                     "second_per_grid"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_videos_are_request_errors(name: str, hf_dir: Path) -> None:
    ids, videos, words = BAD[name]
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=8, page_size=8))
    with pytest.raises(InvalidRequestError, match=words):
        engine.generate([Prompt(token_ids=ids, videos=videos)], GREEDY)
    assert not engine.scheduler.has_unfinished()


def test_text_prompt_expands_video_placeholders(tiny_dir: Path) -> None:
    """``<|video_pad|>`` becomes the video's tokens; without one the video block goes first."""
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=8))
    assert engine.tokenizer is not None
    cfg = engine.model_config
    grid = (2, 4, 4)
    v = VideoInput(torch.zeros(32, cfg.vision.patch_dim), grid)
    with_pad = engine.prepare(Prompt(text="<|vision_start|><|video_pad|><|vision_end|>hi",
                                     videos=[v]))
    without = engine.prepare(Prompt(text="hi", videos=[v]))
    want = [cfg.vision_start_token_id, *[cfg.video_token_id] * 8, cfg.vision_end_token_id,
            *engine.tokenizer.encode("hi")]
    assert with_pad.token_ids == without.token_ids == want
    assert [x.grid_thw for x in with_pad.videos] == [grid] and not with_pad.images
    with pytest.raises(InvalidRequestError, match="video placeholders"):
        engine.prepare(Prompt(text="<|video_pad|><|video_pad|>", videos=[v]))
