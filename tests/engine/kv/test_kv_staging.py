"""The head staging and landing buffers (``engine/kv/staging.py``) against plain tensor
indexing: a gather is the slice of the pages, a scatter puts every slot's landed pages into its
heads, of every entry or only the entries of the layers asked for, and leaves the rest alone."""

from __future__ import annotations

import torch

from engine.kv.pool import KVPool
from engine.kv.staging import HeadLandingBuffer, HeadStagingBuffer

PAGES, PAGE, HEADS, DIM = 6, 4, 4, 2


def _pool() -> KVPool:
    pool = KVPool(PAGES, PAGE, HEADS, DIM, [0, 1], torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for e in pool.entries():
        e.copy_(torch.randn(e.shape, generator=gen))
    return pool


def test_a_gather_is_the_slice_of_the_pages() -> None:
    pool = _pool()
    staging = HeadStagingBuffer(pool.entries(), 4096)
    staging.gather([4, 1], 1, 2, offset=64)
    out = staging.buf[64 : 64 + 4 * 2 * PAGE * 2 * DIM * 4].view(torch.float32)
    want = torch.stack([e[[4, 1], :, 1:3] for e in pool.entries()])
    assert torch.equal(out.view(want.shape), want)


def test_a_scatter_fills_every_slot_and_only_the_layers_asked_for() -> None:
    pool = _pool()
    before = [e.clone() for e in pool.entries()]
    landing = HeadLandingBuffer(pool.entries(), pool.entry_layer_ids(), [(0, 2), (2, 2)], 3)
    gen = torch.Generator().manual_seed(1)
    for slot in landing.land:
        for buf in slot:
            buf.copy_(torch.randn(buf.shape, generator=gen))
    landing.scatter([2, 0], [5, 3], None, layer_ids={1})
    for e, (entry, lid) in enumerate(zip(pool.entries(), pool.entry_layer_ids(), strict=True)):
        if lid != 1:
            assert torch.equal(entry, before[e]), e
            continue
        for s, (start, count) in enumerate([(0, 2), (2, 2)]):
            assert torch.equal(entry[[5, 3], :, start : start + count],
                               landing.land[s][e][[2, 0]])
        untouched = [p for p in range(PAGES) if p not in (5, 3)]
        assert torch.equal(entry[untouched], before[e][untouched])
