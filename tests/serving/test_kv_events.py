"""Prefix-cache events (engine/core/prefix_cache.py's listener, serving/kv_events.py's fan-out): a
stream starts with a snapshot, then carries each store, eviction and clear in order; a
subscriber that falls behind is resynced with a snapshot; the router's tree built from the
stream (router/kv_events.py) matches what the cache holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.core.page_allocator import PageAllocator
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request
from proto.pdserve.v1 import worker_pb2 as wpb
from router.kv_events import SequenceGap, apply_events
from router.prefix_tree import EventTree
from serving.kv_events import KvEventHub

PS = 2


def cached(cache: PrefixCache, alloc: PageAllocator, name: str, ids: list[int]) -> Request:
    """A request whose every token is computed, inserted into ``cache``, then released."""
    req = Request(name, ids)
    req.page_ids = alloc.allocate(-(-len(ids) // PS))
    req.num_computed_tokens = len(ids)
    cache.insert(req)
    alloc.free(req.page_ids)
    cache.release(req.page_ids)
    return req


def kinds(batches: list[wpb.KvEventBatch]) -> list[str]:
    return [str(ev.WhichOneof("event")) for b in batches for ev in b.events]


async def take(stream: AsyncIterator[wpb.KvEventBatch], n: int) -> list[wpb.KvEventBatch]:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


def test_stream_snapshot_then_changes_and_the_tree_follows() -> None:
    async def main() -> None:
        alloc = PageAllocator(16)
        cache = PrefixCache(PS, alloc)
        hub = KvEventHub()
        cache.listener = hub
        cached(cache, alloc, "a", [1, 2, 3, 4, 5])  # blocks [1, 2], [3, 4]
        stream = hub.stream()
        [snap] = await take(stream, 1)
        assert kinds([snap]) == ["cleared", "stored", "stored"]
        assert {ev.seq for ev in snap.events} == {2}  # the state after 2 changes
        tree = EventTree()
        seq = apply_events(tree, snap, None)
        assert tree.match([1, 2, 3, 4, 9]) == 4 and tree.block_tokens == PS
        cached(cache, alloc, "b", [1, 2, 7, 8])  # shares block [1, 2]: one new block
        [live] = await take(stream, 1)
        assert kinds([live]) == ["stored"] and live.events[0].seq == 3
        stored = live.events[0].stored
        assert list(stored.token_ids) == [7, 8]
        assert stored.parent_hash == snap.events[1].stored.block_hash  # block [1, 2]
        seq = apply_events(tree, live, seq)
        assert tree.match([1, 2, 7, 8]) == 4
        cache.evict(16)  # tails first: [3, 4] and [7, 8], then [1, 2]
        seq = apply_events(tree, (await take(stream, 1))[0], seq)
        assert len(tree) == 0 and tree.match([1, 2, 3, 4]) == 0
        cached(cache, alloc, "c", [5, 6])
        cache.clear()
        batches = [b async for b in _until(stream, 2)]
        assert kinds(batches) == ["stored", "cleared"]
        for b in batches:
            seq = apply_events(tree, b, seq)
        assert len(tree) == 0 and seq == 6
        hub.close()
        assert [b async for b in stream] == []

    asyncio.run(main())


async def _until(stream: AsyncIterator[wpb.KvEventBatch], events: int
                 ) -> AsyncIterator[wpb.KvEventBatch]:
    """Messages of ``stream`` until ``events`` events came."""
    seen = 0
    while seen < events:
        batch = await asyncio.wait_for(anext(stream), 5)
        seen += len(batch.events)
        yield batch


def test_a_subscriber_that_falls_behind_gets_a_snapshot() -> None:
    async def main() -> None:
        alloc = PageAllocator(64)
        cache = PrefixCache(PS, alloc)
        hub = KvEventHub(max_queued=4)
        cache.listener = hub
        stream = hub.stream()
        assert kinds(await take(stream, 1)) == ["cleared"]  # an empty cache
        for i in range(10):  # 10 changes while the subscriber reads nothing
            cached(cache, alloc, f"r{i}", [100 + i, 0])
        [snap] = await take(stream, 1)
        assert kinds([snap]) == ["cleared"] + ["stored"] * 10
        assert {ev.seq for ev in snap.events} == {10}
        tree = EventTree()
        apply_events(tree, snap, None)
        assert all(tree.match([100 + i, 0]) == 2 for i in range(10))
        hub.close()

    asyncio.run(main())


def test_every_subscriber_gets_every_change() -> None:
    """Two routers in front of one worker each subscribe: both streams carry the same changes,
    and one that ends leaves the other flowing."""
    async def main() -> None:
        alloc = PageAllocator(16)
        cache = PrefixCache(PS, alloc)
        hub = KvEventHub()
        cache.listener = hub
        one, two = hub.stream(), hub.stream()
        assert kinds(await take(one, 1)) == kinds(await take(two, 1)) == ["cleared"]
        cached(cache, alloc, "a", [1, 2, 3, 4])
        trees = [EventTree(), EventTree()]
        for tree, stream in zip(trees, (one, two), strict=True):
            apply_events(tree, (await take(stream, 1))[0], 0)
            assert tree.match([1, 2, 3, 4]) == 4
        await one.aclose()  # type: ignore[attr-defined]
        cached(cache, alloc, "b", [5, 6])
        [live] = await take(two, 1)
        assert kinds([live]) == ["stored"] and list(live.events[0].stored.token_ids) == [5, 6]
        hub.close()

    asyncio.run(main())


def test_snapshot_sends_parents_first() -> None:
    async def main() -> None:
        hub = KvEventHub()
        hub.block_stored(b"p", b"", [1, 2])
        hub.block_stored(b"c", b"p", [3, 4])
        hub.blocks_removed([b"p"])  # the parent went and came back: now after its child
        hub.block_stored(b"p", b"", [1, 2])
        [snap] = await take(hub.stream(), 1)
        assert [ev.stored.block_hash for ev in snap.events[1:]] == [b"p", b"c"]
        tree = EventTree()
        apply_events(tree, snap, None)
        assert tree.match([1, 2, 3, 4]) == 4
        hub.close()

    asyncio.run(main())


def test_the_router_refuses_a_stream_that_skips_a_change() -> None:
    cleared = wpb.KvEvent(seq=4, cleared=wpb.KvCleared())
    stored = wpb.KvEvent(seq=6, stored=wpb.KvBlockStored(block_hash=b"x", token_ids=[1, 2]))
    tree = EventTree()
    with pytest.raises(SequenceGap):
        apply_events(tree, wpb.KvEventBatch(events=[stored]), None)  # no snapshot first
    with pytest.raises(SequenceGap):
        apply_events(tree, wpb.KvEventBatch(events=[cleared, stored]), None)


def test_event_tree_counts_equal_blocks_and_ignores_orphans() -> None:
    tree = EventTree()
    assert tree.store(b"a", b"", [1, 2])
    assert tree.store(b"a'", b"", [1, 2])  # same tokens, other images: one node, held twice
    assert tree.store(b"b", b"a", [3, 4])
    assert not tree.store(b"c", b"gone", [5, 6])  # its parent is unknown
    assert not tree.store(b"d", b"a", [5, 6, 7])  # another block size
    tree.remove(b"a")
    assert tree.match([1, 2, 3, 4]) == 4  # a' still stands for the first block
    tree.remove(b"a'")
    assert tree.match([1, 2, 3, 4]) == 0  # the first block is gone, so the match ends there
    tree.remove(b"b")
    assert len(tree) == 0


def test_draft_mode_ids_chain_to_the_parent_entry() -> None:
    """With EAGLE a block's key holds the token after it; a child names that exact entry."""
    async def main() -> None:
        alloc = PageAllocator(16)
        cache = PrefixCache(PS, alloc)
        cache.set_draft_mode(True)
        hub = KvEventHub()
        cache.listener = hub
        cached(cache, alloc, "a", [1, 2, 3, 4, 5, 6, 7])  # 3 blocks: the token after each known
        cached(cache, alloc, "b", [1, 2, 8, 9, 9, 9, 0])  # [1, 2] followed by 8: 3 new entries
        [snap] = await take(hub.stream(), 1)
        assert kinds([snap]) == ["cleared"] + ["stored"] * 6
        tree = EventTree()
        apply_events(tree, snap, None)
        assert len(tree) == 6  # every parent was found (b's [8, 9] names b's [1, 2] entry)
        assert tree.match([1, 2, 3, 4, 5, 6]) == 6 and tree.match([1, 2, 8, 9, 9, 9]) == 6
        hub.close()

    asyncio.run(main())
