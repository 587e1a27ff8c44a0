"""Head-sliced KV transfer between sides of different tensor-parallel (TP) size: the plan.

A side with TP size ``n`` over ``H`` KV heads gives rank ``r`` the heads of the engine's rule
(:mod:`engine.parallel.shard`, restated by :func:`tp_head_ranges`): with ``H >= n`` and ``n | H``,
``[r * H/n, (r+1) * H/n)``; with ``H < n`` and ``H | n``, the single head ``r // (n/H)``,
replicated on ``n/H`` ranks. A :class:`HeadLayout` is one side's description: the geometry both
sides must share (KV heads, head dim, dtype, page size) and every rank's ``(start, count)``.

:func:`plan_head_copies` gives, for one source rank, what it writes into each destination rank:
the intersection of the two head ranges as local offsets (:class:`HeadCopy`). Each destination
rank receives exactly its heads, each head once: where the source replicates a head, only the
lowest source rank holding it writes it; where the destination replicates, every replica gets
it. Every refusal (geometry differs, a layout the TP rule does not give) raises
:class:`~transfer.errors.HeadLayoutError` naming the numbers, before any byte moves.

Pages stay token-major, ``[page_size, heads_local, head_dim]``: a slice of heads is
``page_size`` strided pieces of a page. How :class:`~transfer.base.KVManager` moves them:

- equal ranges (``HeadCopy.whole``): the plain page copy, one block per run of pages;
- the destination rank holds exactly the slice (``HeadCopy.dst_contiguous``: the destination's
  TP is at least the source's): the source gathers the slice of every page into its registered
  staging buffer (:class:`~transfer.tp.staging.HeadStaging`), where it is a whole destination
  page, and writes one block per run of destination pages, as many blocks as equal TP;
- the source rank holds exactly the slice but the destination rank holds more heads
  (``HeadCopy.lands``: the destination's TP is smaller, several source ranks fill one page):
  when the destination registered a landing buffer (``engine.kv.staging.HeadLandingBuffer``:
  per incoming slice, pool-shaped entries of that slice's heads, :func:`landing_slices`), the
  source writes whole pages into its slice's landing entries, the plain page copy, and the
  destination scatters them into its pool pages once they arrived;
- otherwise: one block per token and page, written straight from the pool into the strided
  destination. Correct, but the engine pays per block (about 60 us over loopback TCP), so it is
  tens of times slower than page-sized blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.errors import HeadLayoutError


def tp_head_ranges(num_kv_heads: int, tp_size: int) -> tuple[tuple[int, int], ...]:
    """``(start, count)`` of every rank's KV heads under the engine's TP rule.

    Raises :class:`HeadLayoutError` when ``tp_size`` neither divides ``num_kv_heads`` nor is a
    multiple of it.
    """
    if num_kv_heads < 1 or tp_size < 1:
        raise HeadLayoutError(
            f"KV heads and TP size must be positive, got {num_kv_heads} heads, TP {tp_size}"
        )
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return tuple((r * per, per) for r in range(tp_size))
    if tp_size % num_kv_heads == 0:
        reps = tp_size // num_kv_heads
        return tuple((r // reps, 1) for r in range(tp_size))
    raise HeadLayoutError(
        f"TP {tp_size} neither divides the {num_kv_heads} KV heads nor is a multiple of them: "
        "its ranks cannot each hold whole heads"
    )


@dataclass(frozen=True)
class HeadLayout:
    """One side's KV heads: shared geometry and every TP rank's ``(start, count)`` of heads."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def tensor_parallel(
        cls, num_kv_heads: int, tp_size: int, *, head_dim: int, dtype: str, page_size: int
    ) -> HeadLayout:
        """The layout the engine's TP rule gives ``tp_size`` ranks."""
        return cls(num_kv_heads, head_dim, dtype, page_size,
                   tp_head_ranges(num_kv_heads, tp_size))

    @property
    def tp_size(self) -> int:
        return len(self.ranges)


@dataclass(frozen=True)
class HeadCopy:
    """What one source rank writes into destination rank ``dst_rank``: ``count`` heads from its
    local head ``src_head`` into the destination's local head ``dst_head``; ``src_heads`` and
    ``dst_heads`` are the heads per token in a page on each side."""

    dst_rank: int
    src_head: int
    dst_head: int
    count: int
    src_heads: int
    dst_heads: int
    page_size: int

    @property
    def whole(self) -> bool:
        """Both ranks hold the same heads: a plain page copy."""
        return self.count == self.src_heads == self.dst_heads

    @property
    def dst_contiguous(self) -> bool:
        """The destination rank holds exactly the slice: its page is the slice, contiguous."""
        return self.count == self.dst_heads

    @property
    def lands(self) -> bool:
        """The source rank holds exactly the slice, the destination rank more heads: the slice
        can go as whole pages into a landing buffer on the destination."""
        return self.count == self.src_heads and self.count < self.dst_heads


def check_layout(side: str, layout: HeadLayout) -> None:
    """Raise :class:`HeadLayoutError` unless ``layout`` is what the TP rule gives its size."""
    if not layout.ranges:
        raise HeadLayoutError(f"the {side} describes no TP ranks")
    expected = tp_head_ranges(layout.num_kv_heads, layout.tp_size)
    for rank, (got, want) in enumerate(zip(layout.ranges, expected, strict=True)):
        if tuple(got) != want:
            raise HeadLayoutError(
                f"{side} rank {rank} of TP {layout.tp_size} claims KV heads "
                f"[{got[0]}, {got[0] + got[1]}) of {layout.num_kv_heads}, but TP "
                f"{layout.tp_size} gives it [{want[0]}, {want[0] + want[1]})"
            )


def check_pair(src: HeadLayout, dst: HeadLayout) -> None:
    """Raise :class:`HeadLayoutError` unless the two sides can exchange head slices."""
    for name, mine, theirs in (
        ("KV heads", src.num_kv_heads, dst.num_kv_heads),
        ("head_dim", src.head_dim, dst.head_dim),
        ("dtype", src.dtype, dst.dtype),
        ("page size", src.page_size, dst.page_size),
    ):
        if mine != theirs:
            raise HeadLayoutError(
                f"{name} differs: prefill has {mine!r}, decode has {theirs!r} "
                f"(prefill TP {src.tp_size}, decode TP {dst.tp_size})"
            )
    check_layout("prefill", src)
    check_layout("decode", dst)


def plan_head_copies(src: HeadLayout, dst: HeadLayout, src_rank: int) -> list[HeadCopy]:
    """What source rank ``src_rank`` writes into every destination rank (see the module
    docstring); empty when another source replica of its heads writes them."""
    check_pair(src, dst)
    if not 0 <= src_rank < src.tp_size:
        raise HeadLayoutError(f"prefill rank {src_rank} is outside TP {src.tp_size}")
    mine = src.ranges[src_rank]
    if src.ranges.index(mine) != src_rank:  # a lower replica writes these heads
        return []
    s0, sc = mine
    copies = []
    for j, (d0, dc) in enumerate(dst.ranges):
        lo, hi = max(s0, d0), min(s0 + sc, d0 + dc)
        if lo < hi:
            copies.append(HeadCopy(j, lo - s0, lo - d0, hi - lo, sc, dc, src.page_size))
    return copies


def receivers(src: HeadLayout, dst: HeadLayout) -> list[list[tuple[int, HeadCopy]]]:
    """For every destination rank, the ``(source rank, copy)`` pairs that fill it; together
    they cover each of its heads exactly once (checked: a gap or overlap is a bug here)."""
    out: list[list[tuple[int, HeadCopy]]] = [[] for _ in dst.ranges]
    for r in range(src.tp_size):
        for copy in plan_head_copies(src, dst, r):
            out[copy.dst_rank].append((r, copy))
    for j, got in enumerate(out):
        heads = sorted(h for _, c in got for h in range(c.dst_head, c.dst_head + c.count))
        if heads != list(range(dst.ranges[j][1])):
            raise HeadLayoutError(f"decode rank {j} would receive heads {heads}")
    return out



def landing_slices(src: HeadLayout, dst: HeadLayout, dst_rank: int) -> list[tuple[int, int]]:
    """``(dst_head, count)`` of every slice that lands on decode rank ``dst_rank`` (one landing
    entry set each, in this order); a source rank's slot is the index of its copy's
    ``(dst_head, count)``."""
    return [(c.dst_head, c.count) for _, c in receivers(src, dst)[dst_rank] if c.lands]
