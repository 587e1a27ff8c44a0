"""Greedy generation is token-for-token identical to transformers' ``generate`` (float32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from tests.conftest import HF_SPECIAL

IMG, VS, VE = HF_SPECIAL["image_token_id"], HF_SPECIAL["vision_start_token_id"], HF_SPECIAL[
    "vision_end_token_id"]
NEW_TOKENS = 32
PATCH_DIM = 3 * 2 * 14 * 14


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1] * grid[2]
    return ImageInput(torch.randn(n, PATCH_DIM, generator=gen), grid)


def image_block(img: ImageInput) -> list[int]:
    t, h, w = img.grid_thw
    return [VS] + [IMG] * (t * h * w // 4) + [VE]


def text(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 370, (n,), generator=gen).tolist()


def reference(hf_model, ids: list[int], images: list[ImageInput]) -> list[int]:  # noqa: ANN001
    ids_t = torch.tensor([ids])
    kwargs = {}
    if images:
        kwargs = {
            "pixel_values": torch.cat([im.patches for im in images]),
            "image_grid_thw": torch.tensor([im.grid_thw for im in images]),
            "mm_token_type_ids": (ids_t == IMG).int(),
        }
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def cases() -> dict[str, tuple[list[int], list[ImageInput]]]:
    a, b, c = image((1, 4, 6), 1), image((1, 8, 4), 2), image((1, 2, 2), 3)
    return {
        "text_only": (text(23, 0), []),
        "one_image": (text(3, 1) + image_block(a) + text(5, 2), [a]),
        "two_images_of_different_sizes": (
            text(4, 3) + image_block(b) + text(2, 4) + image_block(c) + text(6, 5), [b, c]),
        "image_in_the_middle": (text(17, 6) + image_block(a) + text(19, 7), [a]),
        "image_first": (image_block(b) + text(9, 8), [b]),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_single_request_matches_transformers(name: str, hf_dir: Path, hf_model) -> None:  # noqa: ANN001
    ids, images = cases()[name]
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=8))
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [ours] = engine.generate([Prompt(token_ids=ids, images=images)], greedy)
    assert ours.token_ids == reference(hf_model, ids, images)
    engine.scheduler.check_no_leaks()


@pytest.mark.slow
def test_mixed_batch_of_8_with_chunked_prefill_matches_transformers(hf_dir: Path, hf_model) -> None:  # noqa: ANN001,E501
    all_cases = list(cases().values())
    prompts = [*all_cases, (text(61, 9), []), (text(2, 10), []),
               (text(40, 11) + image_block(image((1, 6, 6), 4)), [image((1, 6, 6), 4)])]
    assert len(prompts) == 8
    longest = max(len(ids) for ids, _ in prompts)
    chunk = 24
    assert chunk < longest
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=128, page_size=4,
                                            max_num_batched_tokens=chunk))
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    results = engine.generate([Prompt(token_ids=ids, images=ims) for ids, ims in prompts], greedy)
    for (ids, images), ours in zip(prompts, results, strict=True):
        assert ours.token_ids == reference(hf_model, ids, images)
    engine.scheduler.check_no_leaks()
