"""A gathered head-sliced send, pipelined: gather a round while the previous round is written.

The staging buffer is split in two halves. Round ``k`` is gathered into half ``k % 2`` and then
handed to a writer thread; the next round's gather runs while it is written (the engine and
torch both let go of the GIL while they copy). A half is reused only after the write that read
it returned, so a gather never overwrites bytes still in flight. Rounds are at most
:data:`ROUND_BYTES`, so a large send overlaps even when it would fit the buffer at once.

Every round's write is waited for before this returns or raises: no write is left in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from transfer.plan.head_blocks import pages_per_round, staged_blocks
from transfer.plan.heads import HeadCopy
from transfer.tp.staging import HeadStaging

ROUND_BYTES = 16 << 20  # per round of every entry's pages (4 MiB measured slower: more calls)
T = TypeVar("T")
Write = Callable[[list[int], list[int], list[int]], T]


def send_staged(
    write: Write[T], staging: HeadStaging, writer: ThreadPoolExecutor,
    pairs: Sequence[tuple[int, int]], num_entries: int, dst_ptrs: Sequence[int],
    src: Sequence[int], dst: Sequence[int], copy: HeadCopy, slice_page: int,
) -> list[T]:
    """Gather ``src``'s slice ``copy`` round by round and ``write`` each round's blocks into
    ``dst`` on ``writer``; returns every round's result in order."""
    half = staging.nbytes // 128 * 64  # two halves, each 64-byte aligned
    step = pages_per_round(len(src), num_entries, slice_page, min(half, ROUND_BYTES))
    results: list[T] = []
    pending: Future[T] | None = None
    try:
        for n, k in enumerate(range(0, len(src), step)):
            offset = (n % 2) * half
            staging.gather(src[k : k + step], copy.src_head, copy.count, offset)
            if pending is not None:
                results.append(pending.result())
                pending = None
            blocks = staged_blocks(pairs, staging.ptr + offset, dst_ptrs, dst[k : k + step],
                                   slice_page)
            pending = writer.submit(write, *blocks)
        if pending is not None:
            results.append(pending.result())
            pending = None
    finally:
        if pending is not None:  # a gather failed: let the write in flight finish first
            pending.exception()
    return results
