"""Contiguous-run grouping of page lists, block building and batch splitting.

A run is a stretch where the source page ids and the destination page ids both go up by one;
each (entry pair, run) becomes one block ``(src_addr, dst_addr, nbytes)``. Blocks are handed to
the engine in batches of at most the engine's batch limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from transfer.errors import PageListError


def as_page_list(pages: Sequence[int], name: str) -> list[int]:
    """Page ids as plain ints (accepts lists, tuples, arrays, tensors); rejects negative ids."""
    out = [int(p) for p in pages]
    if any(p < 0 for p in out):
        raise PageListError(f"{name} holds a negative page id")
    return out


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs over equal-length page lists, in order."""
    if len(src) != len(dst):
        raise PageListError(f"{len(src)} source pages but {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    start = 0
    for k in range(1, len(src) + 1):
        if k == len(src) or src[k] != src[k - 1] + 1 or dst[k] != dst[k - 1] + 1:
            runs.append((src[start], dst[start], k - start))
            start = k
    return runs


def build_blocks(
    pairs: Sequence[tuple[int, int]],
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    bytes_per_page: Sequence[int],
    runs: Sequence[tuple[int, int, int]],
) -> tuple[list[int], list[int], list[int]]:
    """Parallel lists (src addresses, dst addresses, lengths), one block per (pair, run).

    ``bytes_per_page`` is indexed by source entry; pairing has checked the destination's match.
    """
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for i, j in pairs:
        bpp, sp, dp = bytes_per_page[i], src_ptrs[i], dst_ptrs[j]
        for s, d, n in runs:
            srcs.append(sp + s * bpp)
            dsts.append(dp + d * bpp)
            lens.append(n * bpp)
    return srcs, dsts, lens


def batches(num_blocks: int, limit: int) -> Iterator[slice]:
    """Slices covering ``range(num_blocks)`` in as few pieces of at most ``limit`` as possible."""
    if limit <= 0:
        raise ValueError(f"batch limit must be positive, got {limit}")
    for start in range(0, num_blocks, limit):
        yield slice(start, min(start + limit, num_blocks))
