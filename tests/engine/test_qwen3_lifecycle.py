"""Qwen3-VL and Qwen3.5 through the engine's lifecycle: the prefix cache (Qwen3-VL's,
the hybrid Qwen3.5's with its state checkpoints), cancel storms over a state pool smaller than
the queue, sampling with penalties; every run ends with no page and no state slot held."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from tests.conftest import HF_SPECIAL

IMG, VS, VE = (HF_SPECIAL["image_token_id"], HF_SPECIAL["vision_start_token_id"],
               HF_SPECIAL["vision_end_token_id"])


def text(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 370, (n,), generator=gen).tolist()


def image(grid: tuple[int, int, int], seed: int) -> ImageInput:
    gen = torch.Generator().manual_seed(seed)
    return ImageInput(torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16, generator=gen),
                      grid)


def with_image(prefix: list[int], img: ImageInput, suffix: list[int]) -> list[int]:
    t, h, w = img.grid_thw
    return prefix + [VS] + [IMG] * (t * h * w // 4) + [VE] + suffix


def generate(engine: LLMEngine, prompts: list[tuple[list[int], list[ImageInput]]],
             params: SamplingParams) -> list[list[int]]:
    out = [engine.generate([Prompt(token_ids=ids, images=ims)], params)[0].token_ids
           for ids, ims in prompts]  # one at a time: later prompts may hit earlier ones' pages
    engine.scheduler.check_no_leaks()
    return out


def test_qwen3_vl_prefix_cache_on_equals_off(hf3_dir: Path) -> None:
    """Prompts sharing a long prefix (an image in it, and one after it): the hits skip the
    shared pages, and the DeepStack features of the image after the hit stay aligned."""
    shared = with_image(text(20, 1), image((1, 4, 4), 1), text(21, 2))
    late = image((1, 4, 6), 2)
    prompts = [(shared + text(5, 3), [image((1, 4, 4), 1)]),
               (shared + text(7, 4), [image((1, 4, 4), 1)]),
               (with_image(shared + text(3, 5), late, text(4, 6)), [image((1, 4, 4), 1), late])]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cached = LLMEngine(hf3_dir, EngineConfig(num_pages=64, page_size=8))
    plain = LLMEngine(hf3_dir, EngineConfig(num_pages=64, page_size=8, enable_prefix_cache=False))
    assert generate(cached, prompts, greedy) == generate(plain, prompts, greedy)
    # the shared 47 tokens fill 5 pages of 8: both later prompts hit them
    assert cached.stats()["prefix_cache_hit_tokens"] == 2 * 40


def test_qwen3_5_prefix_cache_serves_kv_with_its_state_checkpoint(hf35_dir: Path) -> None:
    """A hybrid model's prefix hit ends at the last state checkpoint of the shared prefix (never
    a hit without its state) and its output equals the cache off: the shared 30 tokens fill 3
    pages of 8, but checkpoints sit every 16 tokens, so the later prompts hit 16 tokens."""
    prompts = [(text(30, 1) + text(5, 2), []), (text(30, 1) + text(6, 3), []),
               (text(30, 1) + text(4, 4), [])]
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(num_pages=64, page_size=8, state_checkpoint_interval=16)
    engine = LLMEngine(hf35_dir, config)
    off = LLMEngine(hf35_dir, replace(config, enable_prefix_cache=False))
    assert generate(engine, prompts, greedy) == generate(off, prompts, greedy)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 2 * 16
    # boundaries 16 (shared) and 32 (each prompt's own) inside the prompts: 1 + 3 states
    assert stats["state_checkpoints_saved"] == 4
    assert stats["state_checkpoints_restored"] == 2
    assert stats["state_checkpoint_bytes"] == engine.states.pool.bytes_per_slot > 0


def test_qwen3_5_prefix_cache_without_checkpoint_slots_never_hits(hf35_dir: Path) -> None:
    """No checkpoint slot: the KV pages are cached, yet no request takes a hit (no state)."""
    prompts = [(text(30, 1) + text(5, 2), []), (text(30, 1) + text(6, 3), [])]
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    config = EngineConfig(num_pages=64, page_size=8, state_checkpoints=0,
                          state_checkpoint_interval=8)
    engine = LLMEngine(hf35_dir, config)
    off = LLMEngine(hf35_dir, replace(config, enable_prefix_cache=False))
    assert generate(engine, prompts, greedy) == generate(off, prompts, greedy)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    assert engine.stats()["prefix_cache_pages"] > 0


def test_qwen3_5_cancel_storm_leaves_nothing_held(hf35_dir: Path) -> None:
    """Twelve requests through 3 state slots, a third of them aborted at random moments
    (waiting, mid-prefill, decoding): the survivors' outputs equal their solo runs (a slot
    handed on is zeroed), and at the end no page and no slot is held."""
    prompts = [text(5 + 7 * i, 10 + i) for i in range(12)]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    solo = LLMEngine(hf35_dir, EngineConfig(num_pages=96, page_size=8, max_num_seqs=1))
    expected = [solo.generate([Prompt(token_ids=p)], greedy)[0].token_ids for p in prompts]
    engine = LLMEngine(hf35_dir, EngineConfig(num_pages=96, page_size=8, max_num_seqs=3,
                                               max_num_batched_tokens=24))
    assert engine.stats()["state_slots_total"] == 3
    reqs = [engine.add_request(p, sampling=greedy) for p in prompts]
    rng = random.Random(0)
    doomed = set(rng.sample(range(12), 4))
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
        live = [i for i in doomed if reqs[i].finish_reason is None]
        if live and rng.random() < 0.5:
            engine.abort(reqs[live[0]].request_id)
            doomed.discard(live[0])
    for i, req in enumerate(reqs):
        if req.finish_reason is not None and req.finish_reason.value != "abort":
            assert req.output_token_ids == expected[i], f"request {i}"
    engine.scheduler.check_no_leaks()
    stats = engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_pages_used"] == 0


@pytest.mark.parametrize("model_dir", ["hf3_dir", "hf35_dir"])
def test_sampling_with_penalties_is_reproducible(model_dir: str,
                                                 request: pytest.FixtureRequest) -> None:
    """Seeded sampling with penalties gives the same tokens alone and in a batch."""
    path = request.getfixturevalue(model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                            repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True)
    ids = text(17, 3)
    alone = LLMEngine(path, EngineConfig(num_pages=64, page_size=8))
    [a] = alone.generate([Prompt(token_ids=ids)], params)
    batch = LLMEngine(path, EngineConfig(num_pages=64, page_size=8))
    outs = batch.generate([Prompt(token_ids=text(9, 4)), Prompt(token_ids=ids)],
                          [SamplingParams(max_new_tokens=5), params])
    assert outs[1].token_ids == a.token_ids
    batch.scheduler.check_no_leaks()
