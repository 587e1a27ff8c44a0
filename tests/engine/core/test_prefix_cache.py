"""The prefix cache (engine/core/prefix_cache.py): greedy output is the same with it on and off, a
hit skips exactly the cached full blocks, images are part of the key, eviction under pressure
leaks nothing, aborts leave shared pages to their other holders, EAGLE reuses draft KV only
where it is the KV the draft would have written. Oracles: the engine with the cache off, and
transformers' ``generate``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from cli.engine_args import engine_config
from cli.generate import add_generate_args
from decode_node.spec.eagle_engine import EagleEngine
from engine.builtin.tiny_model import write_tiny_draft
from engine.config import EngineConfig
from engine.core.page_allocator import PageAllocator
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.multimodal.inputs import ImageInput, VideoInput
from engine.multimodal.visual_digest import visual_digest
from tests.engine.test_generation_vs_transformers import image, image_block, reference, text

PS = 8  # page size of every engine here
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def make(model_dir: Path, cache: bool = True, **kw: int) -> LLMEngine:
    cfg = {"num_pages": 96, "page_size": PS, **kw}
    return LLMEngine(model_dir, EngineConfig(enable_prefix_cache=cache, **cfg))  # type: ignore[arg-type]


def ids_of(results: list[GenerationResult]) -> list[list[int]]:
    return [r.token_ids for r in results]


def hits(engine: LLMEngine) -> int:
    return engine.stats()["prefix_cache_hit_tokens"]


def assert_clean(engine: LLMEngine) -> None:
    """Nothing held by requests; cached pages are evictable, and evicting them frees all."""
    engine.scheduler.check_no_leaks()
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    cache = engine.scheduler.prefix_cache
    assert cache is not None
    cache.clear()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages
    engine.scheduler.allocator.check_integrity()


# ---- output equal with the cache on and off --------------------------------------------------


def test_shared_prefixes_run_twice_equal_cache_off(hf_dir: Path) -> None:
    base = text(45, 1)
    prompts = [Prompt(token_ids=base + text(3 + i, 10 + i)) for i in range(4)]
    prompts.append(Prompt(token_ids=text(30, 2)))  # shares nothing
    want = ids_of(make(hf_dir, cache=False).generate(prompts, GREEDY))
    engine = make(hf_dir)
    assert ids_of(engine.generate(prompts, GREEDY)) == want
    assert hits(engine) == 0  # admitted together: nothing was cached yet
    assert ids_of(engine.generate(prompts, GREEDY)) == want
    # second run: every prompt reuses its full blocks, but never its last token
    expected = sum(((len(p.token_ids or ()) - 1) // PS) * PS for p in prompts)
    assert hits(engine) == expected
    assert_clean(engine)


def test_later_requests_reuse_a_running_requests_full_pages(hf_dir: Path) -> None:
    """Blocks enter the cache as their KV completes: a request admitted after another's prompt
    was computed shares its pages while both run."""
    base = text(40, 3)
    engine = make(hf_dir)
    first = engine.add_request(base + [5, 6], sampling=GREEDY)
    engine.step()  # first's prompt computed, still running
    second = engine.add_request(base + [7], sampling=GREEDY)
    engine.step()
    assert second.page_ids[:5] == first.page_ids[:5]
    assert all(engine.scheduler.allocator.refcount(p) == 3 for p in first.page_ids[:5])
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
    want = ids_of(make(hf_dir, cache=False).generate(
        [Prompt(token_ids=base + [5, 6]), Prompt(token_ids=base + [7])], GREEDY))
    assert [first.output_token_ids, second.output_token_ids] == want
    assert hits(engine) == 40
    assert_clean(engine)


def test_multi_turn_reuses_turn_one_and_its_answer(hf_dir: Path) -> None:
    turn1 = text(29, 4)
    engine, plain = make(hf_dir), make(hf_dir, cache=False)
    [a1] = engine.generate([Prompt(token_ids=turn1)], GREEDY)
    assert a1.token_ids == plain.generate([Prompt(token_ids=turn1)], GREEDY)[0].token_ids
    turn2 = turn1 + a1.token_ids + text(6, 5)
    [a2] = engine.generate([Prompt(token_ids=turn2)], GREEDY)
    assert a2.token_ids == plain.generate([Prompt(token_ids=turn2)], GREEDY)[0].token_ids
    # turn 1 computed 29 + 10 - 1 = 38 tokens: 4 full blocks, output tokens included
    assert hits(engine) == 32
    assert_clean(engine)


def test_image_prompts_hit_and_equal_cache_off(hf_dir: Path) -> None:
    a, b = image((1, 4, 6), 1), image((1, 8, 4), 2)
    prompts = [
        Prompt(token_ids=text(11, 6) + image_block(a) + text(13, 7), images=[a]),
        Prompt(token_ids=image_block(b) + text(4, 8) + image_block(a) + text(20, 9),
               images=[b, a]),
    ]
    want = ids_of(make(hf_dir, cache=False).generate(prompts, GREEDY))
    engine = make(hf_dir)
    assert ids_of(engine.generate(prompts, GREEDY)) == want
    assert ids_of(engine.generate(prompts, GREEDY)) == want
    assert hits(engine) == sum(((len(p.token_ids or ()) - 1) // PS) * PS for p in prompts)
    assert_clean(engine)


def test_prompts_differing_only_in_their_image_share_nothing_past_it(hf_dir: Path) -> None:
    """Same token ids, different images: block 0 (text only) is shared, nothing from the block
    of the image's first placeholder on."""
    a, b = image((1, 4, 6), 1), image((1, 4, 6), 2)
    ids = text(11, 6) + image_block(a) + text(13, 7)  # placeholders from index 12: block 1
    assert ids == text(11, 6) + image_block(b) + text(13, 7)
    pa, pb = Prompt(token_ids=ids, images=[a]), Prompt(token_ids=ids, images=[b])
    plain = make(hf_dir, cache=False)
    want_a, want_b = (plain.generate([p], GREEDY)[0].token_ids for p in (pa, pb))
    assert want_a != want_b  # the image matters to this model
    engine = make(hf_dir)
    assert engine.generate([pa], GREEDY)[0].token_ids == want_a
    assert engine.generate([pb], GREEDY)[0].token_ids == want_b
    assert hits(engine) == PS  # block 0 only
    assert engine.generate([pa], GREEDY)[0].token_ids == want_a  # a's own blocks still there
    assert hits(engine) == PS + ((len(ids) - 1) // PS) * PS
    assert_clean(engine)


def test_cached_case_matches_transformers(hf_dir: Path, hf_model) -> None:  # noqa: ANN001
    img = image((1, 4, 6), 3)
    prefix = text(19, 11) + image_block(img) + text(9, 12)
    engine = LLMEngine(hf_dir, EngineConfig(num_pages=64, page_size=PS))
    greedy = SamplingParams(max_new_tokens=32, ignore_eos=True)
    engine.generate([Prompt(token_ids=prefix + text(3, 13), images=[img])], greedy)
    ids = prefix + text(5, 14)
    [ours] = engine.generate([Prompt(token_ids=ids, images=[img])], greedy)
    assert hits(engine) == (len(prefix) // PS) * PS > 0
    assert ours.token_ids == reference(hf_model, ids, [img])
    assert_clean(engine)


def test_resumed_prompts_cache_like_any_other(hf_dir: Path) -> None:
    ids = text(37, 15)
    resumed = SamplingParams(max_new_tokens=10, ignore_eos=True, resumed_tokens=6,
                             frequency_penalty=0.5)
    want = make(hf_dir, cache=False).generate([Prompt(token_ids=ids)], resumed)[0].token_ids
    engine = make(hf_dir)
    for _ in range(2):
        assert engine.generate([Prompt(token_ids=ids)], resumed)[0].token_ids == want
    assert hits(engine) == 32
    assert_clean(engine)


def test_visual_digest_covers_patches_grid_kind_and_timing() -> None:
    gen = torch.Generator().manual_seed(0)
    patches = torch.randn(24, 1176, generator=gen)
    base = visual_digest(ImageInput(patches, (1, 4, 6)))
    assert visual_digest(ImageInput(patches.clone(), (1, 4, 6))) == base
    changed = patches.clone()
    changed[5, 7] += 1e-3
    assert visual_digest(ImageInput(changed, (1, 4, 6))) != base
    assert visual_digest(ImageInput(patches, (1, 6, 4))) != base
    video = visual_digest(VideoInput(patches, (1, 4, 6)))
    assert video != base
    assert visual_digest(VideoInput(patches, (1, 4, 6), 2.0)) != video


# ---- eviction, aborts and accounting ---------------------------------------------------------


def test_eviction_under_pressure_keeps_outputs_and_leaks_nothing(hf_dir: Path) -> None:
    prompts = [Prompt(token_ids=text(20, 100 + i % 3) + text(6, 200 + i)) for i in range(21)]
    want = ids_of(make(hf_dir, cache=False).generate(prompts, GREEDY))
    engine = make(hf_dir, num_pages=14, max_num_seqs=3)  # 5 pages per request at most
    reqs = [engine.add_request(p.token_ids or [], sampling=GREEDY) for p in prompts]
    while engine.scheduler.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
    assert [r.output_token_ids for r in reqs] == want
    stats = engine.stats()
    assert stats["prefix_cache_evicted_blocks"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0  # prompt i repeats the prefix of prompt i - 3
    assert_clean(engine)


def test_abort_while_the_shared_prefix_is_in_use(hf_dir: Path) -> None:
    base = text(33, 20)
    engine = make(hf_dir)
    engine.generate([Prompt(token_ids=base + [1])], GREEDY)  # caches base's 4 full blocks
    sched, alloc = engine.scheduler, engine.scheduler.allocator
    a = engine.add_request(base + [2, 3], sampling=GREEDY)
    b = engine.add_request(base + [4], sampling=GREEDY)
    engine.step()
    shared = a.page_ids[:4]
    assert b.page_ids[:4] == shared and all(alloc.refcount(p) == 3 for p in shared)
    engine.step()
    engine.abort(a.request_id)
    sched.check_invariants()
    assert all(alloc.refcount(p) == 2 for p in shared)  # b and the cache
    while sched.has_unfinished():
        engine.step()
        sched.check_invariants()
    want = make(hf_dir, cache=False).generate([Prompt(token_ids=base + [4])], GREEDY)
    assert b.output_token_ids == want[0].token_ids
    assert all(alloc.refcount(p) == 1 for p in shared)  # the cache only: evictable
    assert_clean(engine)


def test_stats_tell_cached_pages_from_pages_in_use(hf_dir: Path) -> None:
    engine = make(hf_dir)
    req = engine.add_request(text(30, 21), sampling=GREEDY)
    engine.step()
    stats = engine.stats()
    assert stats["kv_pages_used"] == len(req.page_ids) and stats["kv_pages_cached"] == 0
    while engine.scheduler.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0
    assert stats["kv_pages_cached"] == stats["prefix_cache_pages"] == (30 + 10 - 1) // PS
    assert_clean(engine)


def test_cache_off_and_the_flag(hf_dir: Path) -> None:
    engine = make(hf_dir, cache=False)
    engine.generate([Prompt(token_ids=text(30, 22))] * 2, GREEDY)
    assert engine.scheduler.prefix_cache is None
    assert "prefix_cache_pages" not in engine.stats()
    engine.scheduler.check_no_leaks()
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    on = parser.parse_args(["x", "--device", "cpu"])
    off = parser.parse_args(["x", "--device", "cpu", "--no-prefix-cache"])
    assert engine_config(on).enable_prefix_cache and not engine_config(off).enable_prefix_cache


# ---- the cache alone: keys, LRU order, admission accounting ----------------------------------


def _computed(req: Request, n: int, pages: list[int]) -> Request:
    req.page_ids, req.num_computed_tokens = pages, n
    return req


def test_keys_chain_the_prefix_and_lru_evicts_tails_first() -> None:
    alloc = PageAllocator(8)
    cache = PrefixCache(2, alloc)
    x = _computed(Request("x", [1, 2, 3, 4, 5]), 4, alloc.allocate(3))
    y = _computed(Request("y", [9, 9, 3, 4, 5]), 4, alloc.allocate(3))  # block 1 equal to x's
    for req in (x, y):
        cache.insert(req)
    assert cache.num_cached_pages == 4
    assert cache.match(Request("q", [9, 9, 3, 4, 7])) == y.page_ids[:2]
    assert cache.match(Request("q", [1, 2, 3, 4])) == x.page_ids[:1]  # last token computed
    assert cache.match(Request("q", [1, 2, 3, 4], visual_keys=((1, b"img"),))) == []
    for req in (x, y):
        alloc.free(req.page_ids)
        cache.release(req.page_ids)
    cache.check()
    assert cache.num_evictable == 4
    assert cache.evict(1) == 1 and alloc.is_free(x.page_ids[1])  # x's tail went first
    assert cache.match(Request("q", [1, 2, 3, 4, 5])) == x.page_ids[:1]
    cache.clear()
    assert alloc.num_free == 8


def test_admission_counts_evictable_pages_and_pins_what_it_takes() -> None:
    alloc = PageAllocator(6)
    cache = PrefixCache(4, alloc)
    sched = Scheduler(SchedulerConfig(num_pages=6, page_size=4, max_model_len=64), alloc, cache)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = Request("a", list(range(1, 14)), params)
    sched.add(first)
    out = sched.schedule()
    sched.update(out, [(7, 0.0)])
    while not first.is_finished:
        sched.update(sched.schedule(), [(7, 0.0)])
    assert alloc.num_free == 2 and cache.num_evictable == 4  # 16 computed tokens cached
    # 5 pages in the worst case: 2 free + 4 evictable, less the 3 it pins, plus those 3 held
    second = Request("b", list(range(1, 13)) + [50], params)
    sched.add(second)
    out = sched.schedule()
    assert [(it.start, it.num_tokens) for it in out.items] == [(12, 1)]
    assert cache.num_evictable == 1  # first's last block; the other three are pinned
    sched.update(out, [(7, 0.0)])
    sched.check_invariants()
    # 2 pages in the worst case, but only 1 free + 1 evictable, and second may still need 1
    third = Request("c", [60, 61, 62], params)
    sched.add(third)
    out = sched.schedule()
    assert [it.request for it in out.items] == [second] and sched.num_waiting == 1
    sched.update(out, [(7, 0.0)])
    sched.abort("b")
    sched.abort("c")
    sched.check_no_leaks()


# ---- EAGLE: the draft's KV is reused only where it is what the draft would write --------------


@pytest.fixture(scope="module")
def eagle_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_draft(tmp_path_factory.mktemp("prefix_draft") / "draft")


def spec_engine(model_dir: Path, draft_dir: Path, cache: bool, k: int = 3) -> EagleEngine:
    engine = make(model_dir, cache=cache, lookahead_tokens=k, max_num_batched_tokens=24)
    return EagleEngine(engine, load_draft(draft_dir, engine.model_config.text, torch.float32), k)


def test_eagle_hits_reuse_draft_kv_consistently(tiny_dir: Path, eagle_dir: Path) -> None:
    base = list(range(1, 41))  # 5 full blocks
    prompts = [Prompt(token_ids=base + [60 + i, 70 + i, 80]) for i in range(3)]
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = ids_of(make(tiny_dir, cache=False).generate(prompts, greedy))
    off = spec_engine(tiny_dir, eagle_dir, cache=False)
    assert ids_of(off.generate(prompts, greedy)) == plain
    on = spec_engine(tiny_dir, eagle_dir, cache=True)
    cache = on.engine.scheduler.prefix_cache
    assert cache is not None and cache.draft_mode
    assert ids_of(on.generate(prompts, greedy)) == plain
    first, first_hits = on.stats.accepted, hits(on.engine)
    assert first == off.stats.accepted
    assert first_hits > 0  # chunked prefill: later prompts reuse the first one's finished blocks
    assert ids_of(on.generate(prompts, greedy)) == plain
    assert hits(on.engine) - first_hits == 3 * 40  # every prompt hit its own 5 blocks
    # the reused draft KV is the draft's own: acceptance is what it was without the cache
    assert on.stats.accepted - first == off.stats.accepted
    on.engine.scheduler.check_no_leaks()


def test_eagle_keys_a_block_by_the_token_after_it(tiny_dir: Path, eagle_dir: Path) -> None:
    """Block 4's last draft row pairs with token 40: a prompt that differs there reuses blocks
    0-3 only (without a draft it would reuse block 4 too)."""
    base = list(range(1, 41))
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    spec = spec_engine(tiny_dir, eagle_dir, cache=True)
    spec.generate([Prompt(token_ids=base + [90, 91])], greedy)
    spec.generate([Prompt(token_ids=base + [92, 93])], greedy)
    assert hits(spec.engine) == 32
    plain = make(tiny_dir)
    plain.generate([Prompt(token_ids=base + [90, 91])], greedy)
    plain.generate([Prompt(token_ids=base + [92, 93])], greedy)
    assert hits(plain) == 40
