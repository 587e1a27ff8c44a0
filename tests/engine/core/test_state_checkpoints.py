"""State checkpoints of a hybrid model's prefix cache (engine/core/state_checkpoints.py) and the
scheduler's use of them: prefill chunks end at every checkpoint boundary inside the prompt, a
chunk ending at one saves into a reserved slot that the update commits, a hit is cut back to the
last boundary holding a checkpoint and its first chunk restores from it; eviction is LRU and
nothing is left reserved."""

from __future__ import annotations

import pytest

from engine.core.page_allocator import PageAllocator
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.state_checkpoints import StateCheckpoints
from engine.core.state_slots import StateSlotAllocator

PS = 4


def test_reserve_commit_release_and_lru_eviction() -> None:
    ck = StateCheckpoints(2, first_slot=10, interval=8, page_size=PS)
    a, b = ck.reserve(), ck.reserve()
    assert (a, b) == (10, 11) and ck.reserve() is None  # both reserved, nothing to evict
    ck.commit("ka", a)
    ck.commit("kb", b)
    assert ck.get("ka") == a  # ka is now the most recently used
    c = ck.reserve()
    assert c == b and "kb" not in ck and ck.stats.evicted == 1
    ck.commit("ka", c)  # a key cached already keeps its slot; the new one is free again
    assert ck.get("ka") == a and ck.num_cached == 1 and ck.num_reserved == 0
    d = ck.reserve()
    ck.release(d)
    ck.check()
    assert ck.stats.saved == 2


def test_boundaries_and_bad_intervals() -> None:
    ck = StateCheckpoints(1, first_slot=0, interval=8, page_size=PS)
    assert [ck.next_boundary(s) for s in (0, 7, 8, 9)] == [8, 8, 16, 16]
    assert ck.is_boundary(16) and not ck.is_boundary(12) and not ck.is_boundary(0)
    assert not StateCheckpoints(0, 0, 8, PS).is_boundary(8)
    with pytest.raises(ValueError, match="multiple of the page size 4"):
        StateCheckpoints(1, 0, 6, PS)


def hybrid_scheduler(num_checkpoints: int = 4, budget: int = 64
                     ) -> tuple[Scheduler, StateCheckpoints]:
    alloc = PageAllocator(64)
    ck = StateCheckpoints(num_checkpoints, first_slot=4, interval=8, page_size=PS)
    cfg = SchedulerConfig(num_pages=64, page_size=PS, max_model_len=512,
                          max_num_batched_tokens=budget)
    return Scheduler(cfg, alloc, PrefixCache(PS, alloc, ck), StateSlotAllocator(4)), ck


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))


def run(sched: Scheduler) -> list[tuple[str, int, int, int, int]]:
    """Run every request to the end; each item as (id, start, tokens, restore, save)."""
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        trace += [(it.request.request_id, it.start, it.num_tokens, it.restore_from, it.save_to)
                  for it in out.items]
        sched.update(out, [(5, 0.0) for it in out.items if it.needs_sample])
        sched.check_invariants()
    sched.check_no_leaks()
    return trace


def test_chunks_end_at_boundaries_and_a_hit_restores_the_last_checkpoint() -> None:
    sched, ck = hybrid_scheduler()
    shared = list(range(1, 23))  # 22 tokens: 5 full pages, boundaries 8 and 16 inside
    sched.add(request("a", [*shared, 90, 91]))
    first = run(sched)
    # prompt chunks 0-8, 8-16, 16-24 (saves at 8 and 16), then one decode token
    assert [t[1:] for t in first[:3]] == [(0, 8, -1, 4), (8, 8, -1, 5), (16, 8, -1, -1)]
    assert ck.num_cached == 2
    sched.add(request("b", [*shared, 70, 71, 72]))
    second = run(sched)
    # KV of 5 shared pages is cached, but the state only at 16: the hit is cut back to 16;
    # its first chunk restores slot 5, ends at b's own boundary 24 and saves there
    assert second[0][1:] == (16, 8, 5, 6)
    assert sched.prefix_cache is not None and sched.prefix_cache.stats.hit_tokens == 16
    assert ck.stats.restored == 1


def test_no_checkpoint_means_no_hit_but_a_kv_only_match_still_finds_the_pages() -> None:
    sched, ck = hybrid_scheduler(num_checkpoints=0)
    prompt = list(range(1, 30))
    sched.add(request("a", prompt))
    assert all(t[3] == t[4] == -1 for t in run(sched))
    cache = sched.prefix_cache
    assert cache is not None
    again = request("b", prompt)
    assert cache.match(again) == []
    assert len(cache.match(again, kv_only=True)) == 7  # a decode gets the state by transfer


def test_an_evicted_checkpoint_is_never_a_hit() -> None:
    sched, ck = hybrid_scheduler(num_checkpoints=2)
    one = list(range(1, 20))  # checkpoints at 8 (slot 4) and 16 (slot 5)
    sched.add(request("a", one))
    run(sched)
    sched.add(request("b", [200, *range(2, 12)]))  # its boundary 8 evicts a's, the oldest
    assert run(sched)[0][1:] == (0, 8, -1, 4) and ck.stats.evicted == 1
    sched.add(request("c", [*one, 3]))  # a's checkpoint at 16 is still there
    assert run(sched)[0][1:4] == (16, 4, 5)
    sched.add(request("d", one[:14]))  # 3 cached pages of a, but no state at 8 any more
    assert run(sched)[0][1:4] == (0, 8, -1)


def test_an_aborted_chunk_gives_its_reserved_slot_back() -> None:
    sched, ck = hybrid_scheduler()
    sched.add(request("a", list(range(1, 30))))
    out = sched.schedule()
    assert out.items[0].save_to >= 0 and ck.num_reserved == 1
    sched.abort("a")
    sched.update(out, [])
    assert ck.num_reserved == 0 and ck.num_cached == 0
    sched.check_no_leaks()
