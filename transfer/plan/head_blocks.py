"""Blocks of a head-sliced send (:mod:`transfer.plan.heads` says when each kind is used).

Pages are token-major, ``[page_size, heads, head_dim]``; a token's slice of ``count`` heads is
``count * head_bytes`` contiguous bytes, so a page's slice is ``page_size`` strided pieces.

- :func:`strided_blocks`: one block per (entry pair, page, token), pool to pool;
- :func:`staged_blocks`: the slices were gathered (:mod:`transfer.tp.staging`) into whole
  destination pages, one block per (entry pair, run of pages consecutive on the destination).
"""

from __future__ import annotations

from collections.abc import Sequence

from transfer.errors import HeadLayoutError, LayerPairingError
from transfer.plan.blocks import contiguous_runs
from transfer.plan.heads import HeadCopy


def head_geometry(
    pairs: Sequence[tuple[int, int]], src_bpp: Sequence[int], copy: HeadCopy,
    dst_bpp: Sequence[int] | None,
) -> tuple[int, int]:
    """``(head_bytes, destination bytes per page)``, the same in every entry.

    ``head_bytes`` is one token's one head (``head_dim * itemsize``), the same in every entry.
    The destination's page is ``page_size * dst_heads * head_bytes``; ``dst_bpp`` (the peer's
    published values, when given) must say so. Raises before any byte moves.
    """
    if not (0 <= copy.src_head and copy.src_head + copy.count <= copy.src_heads
            and 0 <= copy.dst_head and copy.dst_head + copy.count <= copy.dst_heads
            and copy.count > 0):
        raise HeadLayoutError(f"head slice outside the ranks' heads: {copy}")
    per_head_page = {src_bpp[i] // copy.src_heads for i, _ in pairs}
    if len(per_head_page) > 1 or any(src_bpp[i] % (copy.src_heads * copy.page_size)
                                     for i, _ in pairs):
        raise HeadLayoutError(
            f"local pages ({sorted(set(src_bpp))} bytes) do not split into {copy.src_heads} "
            f"heads of {copy.page_size} tokens"
        )
    head_bytes = per_head_page.pop() // copy.page_size if pairs else 0
    dst_page = copy.page_size * copy.dst_heads * head_bytes
    if dst_bpp is not None:
        for i, j in pairs:
            if dst_bpp[j] != dst_page:
                raise LayerPairingError(
                    f"bytes per page differ: source entry {i} with {copy.src_heads} heads has "
                    f"{src_bpp[i]}, so destination entry {j} with {copy.dst_heads} heads needs "
                    f"{dst_page}, but has {dst_bpp[j]}"
                )
    return head_bytes, dst_page


def strided_blocks(
    pairs: Sequence[tuple[int, int]], src_ptrs: Sequence[int], dst_ptrs: Sequence[int],
    src_bpp: Sequence[int], dst_page: int, src: Sequence[int], dst: Sequence[int],
    copy: HeadCopy, head_bytes: int,
) -> tuple[list[int], list[int], list[int]]:
    """One block per (entry pair, page, token): the slice's bytes of that token."""
    srcs: list[int] = []
    dsts: list[int] = []
    piece = copy.count * head_bytes
    src_tok, dst_tok = copy.src_heads * head_bytes, copy.dst_heads * head_bytes
    src_off, dst_off = copy.src_head * head_bytes, copy.dst_head * head_bytes
    for i, j in pairs:
        for s, d in zip(src, dst, strict=True):
            s_base = src_ptrs[i] + s * src_bpp[i] + src_off
            d_base = dst_ptrs[j] + d * dst_page + dst_off
            for t in range(copy.page_size):
                srcs.append(s_base + t * src_tok)
                dsts.append(d_base + t * dst_tok)
    return srcs, dsts, [piece] * len(srcs)


def pages_per_round(num_pages: int, num_entries: int, slice_page: int, capacity: int) -> int:
    """How many pages of every entry one gather into ``capacity`` bytes holds (at least 1)."""
    per_page = num_entries * slice_page
    if per_page > capacity:
        raise HeadLayoutError(
            f"the staging buffer ({capacity} bytes) cannot hold one page of every entry "
            f"({per_page} bytes)"
        )
    return max(1, min(num_pages, capacity // per_page))


def staged_blocks(
    pairs: Sequence[tuple[int, int]], staging_ptr: int, dst_ptrs: Sequence[int],
    dst: Sequence[int], slice_page: int,
) -> tuple[list[int], list[int], list[int]]:
    """Blocks from a gather of ``len(dst)`` pages (entry-major) into destination pages ``dst``;
    pages consecutive on the destination go as one block."""
    m = len(dst)
    runs = contiguous_runs(range(m), dst)
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for i, j in pairs:
        base = staging_ptr + i * m * slice_page
        for k, d, n in runs:
            srcs.append(base + k * slice_page)
            dsts.append(dst_ptrs[j] + d * slice_page)
            lens.append(n * slice_page)
    return srcs, dsts, lens
