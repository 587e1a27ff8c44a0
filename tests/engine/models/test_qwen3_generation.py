"""Greedy generation of Qwen3-VL and Qwen3.5 equals transformers' ``generate`` (float32, CPU):
text, one image, two images, a video (frames between timestamps), a batch mixing them, long
prompts split into many prefill chunks. The state pool and the pages end empty."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput, VideoInput
from tests.conftest import HF_SPECIAL

IMG, VID = HF_SPECIAL["image_token_id"], HF_SPECIAL["video_token_id"]
VS, VE = HF_SPECIAL["vision_start_token_id"], HF_SPECIAL["vision_end_token_id"]
NEW_TOKENS = 24
PATCH_DIM = 3 * 2 * 16 * 16
Visual = ImageInput | VideoInput


def patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=gen)


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    return ImageInput(patches(grid, seed), grid)


def video(grid: tuple[int, int, int], seed: int) -> VideoInput:
    return VideoInput(patches(grid, seed), grid)


def text(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 370, (n,), generator=gen).tolist()


def image_block(img: ImageInput) -> list[int]:
    t, h, w = img.grid_thw
    return [VS] + [IMG] * (t * h * w // 4) + [VE]


def video_block(v: VideoInput, seed: int) -> list[int]:
    """Each temporal patch as Qwen3-VL's processor lays it out: a timestamp (here 3 random
    text tokens), then the frame's tokens between vision start and end."""
    t, h, w = v.grid_thw
    out: list[int] = []
    for i in range(t):
        out += text(3, seed + i) + [VS] + [VID] * (h * w // 4) + [VE]
    return out


def reference(hf_model, ids: list[int], visuals: list[Visual]) -> list[int]:  # noqa: ANN001
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0,
                                **reference_inputs(ids_t, visuals))
    return out[0, len(ids):].tolist()


def reference_inputs(ids_t: torch.Tensor, visuals: list[Visual]) -> dict[str, torch.Tensor]:
    """transformers' visual inputs of a prompt: patches, grids and token types."""
    kwargs: dict[str, torch.Tensor] = {}
    images = [v for v in visuals if isinstance(v, ImageInput)]
    videos = [v for v in visuals if isinstance(v, VideoInput)]
    if images:
        kwargs["pixel_values"] = torch.cat([im.patches for im in images])
        kwargs["image_grid_thw"] = torch.tensor([im.grid_thw for im in images])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([v.patches for v in videos])
        kwargs["video_grid_thw"] = torch.tensor([v.grid_thw for v in videos])
    if visuals:
        kwargs["mm_token_type_ids"] = (ids_t == IMG).int() + 2 * (ids_t == VID).int()
    return kwargs


def cases() -> dict[str, tuple[list[int], list[Visual]]]:
    a, b, c = image((1, 4, 6), 1), image((1, 8, 4), 2), image((1, 2, 2), 3)
    v = video((2, 4, 4), 4)
    return {
        "text": (text(23, 0), []),
        "one_image": (text(3, 1) + image_block(a) + text(5, 2), [a]),
        "two_images": (text(4, 3) + image_block(b) + text(2, 4) + image_block(c) + text(6, 5),
                       [b, c]),
        "video": (text(5, 6) + video_block(v, 50) + text(4, 7), [v]),
        "image_and_video": (image_block(c) + text(3, 8) + video_block(v, 60) + text(2, 9),
                            [c, v]),
        "long_text": (text(150, 10), []),
    }


def run(model_dir: Path, prompts: list[tuple[list[int], list[Visual]]], **cfg: int
        ) -> list[list[int]]:
    engine = LLMEngine(model_dir, EngineConfig(**{"num_pages": 96, "page_size": 8, **cfg}))
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [Prompt(token_ids=ids,
                    images=[v for v in vis if isinstance(v, ImageInput)],
                    videos=[v for v in vis if isinstance(v, VideoInput)])
             for ids, vis in prompts]
    results = engine.generate(batch, greedy)
    engine.scheduler.check_no_leaks()
    assert engine.stats()["kv_pages_used"] == 0
    if engine.states is not None:
        assert engine.stats()["state_slots_used"] == 0
    return [r.token_ids for r in results]


FAMILIES = [("hf3_dir", "hf3_model"), ("hf35_dir", "hf35_model")]


@pytest.mark.parametrize("family", FAMILIES, ids=["qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("name", list(cases()))
def test_single_request_matches_transformers(name: str, family: tuple[str, str],
                                             request: pytest.FixtureRequest) -> None:
    model_dir, hf_model = (request.getfixturevalue(f) for f in family)
    ids, visuals = cases()[name]
    [ours] = run(model_dir, [(ids, visuals)])
    assert ours == reference(hf_model, ids, visuals)


@pytest.mark.parametrize("family", FAMILIES, ids=["qwen3_vl", "qwen3_5"])
def test_mixed_batch_in_small_chunks_matches_transformers(family: tuple[str, str],
                                                          request: pytest.FixtureRequest) -> None:
    """Every case at once, with a step budget of 16 tokens: prompts split into many chunks,
    the chunks of one step mixing prefill rows and decode rows of other requests."""
    model_dir, hf_model = (request.getfixturevalue(f) for f in family)
    prompts = list(cases().values())
    ours = run(model_dir, prompts, max_num_batched_tokens=16)
    assert ours == [reference(hf_model, ids, vis) for ids, vis in prompts]


@pytest.mark.parametrize("name", ["text", "one_image", "video"])
@pytest.mark.parametrize("family", FAMILIES, ids=["qwen3_vl", "qwen3_5"])
def test_bfloat16_prefill_equals_transformers_in_bfloat16(family: tuple[str, str], name: str,
                                                          request: pytest.FixtureRequest) -> None:
    """``--dtype bfloat16``: the prompt's last logits equal transformers' loaded in bfloat16
    bit for bit where the attention reads no padded page (pages of one token), and to bfloat16
    rounding (picking the same token) with pages of 8. Its rounding steps are ours (norms,
    gates, the vision tower, the delta rule's state in float32). A padded last page adds masked
    keys, which the CPU's SDPA may sum in another order than transformers' unpadded keys: on an
    AVX2 CPU "text" (23 keys, 24 with the padding) differs there in the last bit, on an AVX-512
    one "video" (27 keys, 32). Greedy continuations are not compared token for token: these
    random tiny models meet bfloat16 near-ties within a few tokens (one case has an exact tie,
    two logits of 1.59375, at its 21st token)."""
    model_dir = request.getfixturevalue(family[0])
    hf_cls = type(request.getfixturevalue(family[1]))
    hf_bf16 = hf_cls.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids, visuals = cases()[name]
    kwargs = reference_inputs(torch.tensor([ids]), visuals)
    with torch.no_grad():
        theirs = hf_bf16(input_ids=torch.tensor([ids]), **kwargs).logits[0, -1:].float()
    images = [v for v in visuals if isinstance(v, ImageInput)]
    videos = [v for v in visuals if isinstance(v, VideoInput)]
    for page_size in (1, 8):
        engine = LLMEngine(model_dir, EngineConfig(
            num_pages=96 * 8 // page_size, page_size=page_size, dtype="bfloat16",
            state_checkpoint_interval=64 * page_size))
        engine.add_request(ids, images, SamplingParams(max_new_tokens=4, ignore_eos=True),
                           videos=videos)
        fwd = engine.runner.run(engine.scheduler.schedule())
        ours = engine.model.logits(fwd.hidden[-1:])
        if page_size == 1:
            assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.0)
        assert int(ours.argmax()) == int(theirs.argmax())
