"""PageAllocator: refcounts, double free, contiguity preference, and random-trace integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.page_allocator import PageAllocator
from engine.errors import OutOfPagesError


def test_fresh_allocator_hands_out_lowest_contiguous_run() -> None:
    alloc = PageAllocator(10)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(1) == [3]
    assert alloc.num_free == 6 and alloc.num_used == 4
    alloc.check_integrity()


def test_allocate_zero_and_negative() -> None:
    alloc = PageAllocator(4)
    assert alloc.allocate(0) == []
    with pytest.raises(ValueError):
        alloc.allocate(-1)


def test_out_of_pages_takes_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.check_integrity()


def test_after_continues_the_run() -> None:
    alloc = PageAllocator(16)
    a = alloc.allocate(2)  # [0, 1]
    b = alloc.allocate(2)  # [2, 3]
    alloc.free(b)
    assert alloc.allocate(1, after=a[-1]) == [2]
    assert alloc.allocate(2, after=2) == [3, 4]


def test_after_partial_run_then_lowest_run_for_the_rest() -> None:
    alloc = PageAllocator(16)
    alloc.allocate(16)
    alloc.free([1, 2, 5, 8, 9, 10, 11])
    # continues 1, 2 after page 0, then the lowest run of 3 free pages: 8, 9, 10
    assert alloc.allocate(5, after=0) == [1, 2, 8, 9, 10]
    alloc.check_integrity()


def test_after_taken_falls_back_to_lowest() -> None:
    alloc = PageAllocator(8)
    alloc.allocate(8)
    alloc.free([2, 6])
    assert alloc.allocate(1, after=3) == [2]  # page 4 is used
    assert alloc.allocate(1, after=7) == [6]  # past the end


def test_prefers_contiguous_run_over_lowest_pages() -> None:
    alloc = PageAllocator(12)
    alloc.allocate(12)
    alloc.free([0, 2, 4, 7, 8, 9, 11])
    assert alloc.allocate(3) == [7, 8, 9]
    # no run of 3 left: lowest free pages
    assert alloc.allocate(3) == [0, 2, 4]
    alloc.check_integrity()


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([pages[0]])
    other = alloc.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([other[0], other[0]])
    assert alloc.refcount(other[0]) == 1
    alloc.check_integrity()


def test_free_out_of_range_raises() -> None:
    alloc = PageAllocator(4)
    with pytest.raises(ValueError):
        alloc.free([4])
    with pytest.raises(ValueError):
        alloc.free([-1])


def test_share_keeps_page_until_last_reference() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.share(pages)
    assert alloc.refcount(pages[0]) == 2
    alloc.free(pages)
    assert alloc.num_free == 2 and alloc.refcount(pages[1]) == 1
    alloc.free(pages)
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.share([pages[0]])
    alloc.check_integrity()


def test_single_page_churn_keeps_heap_bounded() -> None:
    alloc = PageAllocator(64)
    base = alloc.allocate(1)
    for _ in range(1000):
        p = alloc.allocate(1, after=base[0])
        alloc.free(p)
    assert len(alloc._heap) <= alloc.num_pages
    alloc.check_integrity()


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple[str, int]]:
    kinds = st.sampled_from(["alloc", "alloc_after", "free", "share"])
    return draw(st.lists(st.tuples(kinds, st.integers(0, 40)), max_size=60))


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 48), ops=_ops())
def test_random_traces_keep_integrity_and_return_all_pages(
    num_pages: int, ops: list[tuple[str, int]]
) -> None:
    alloc = PageAllocator(num_pages)
    owned: list[list[int]] = []
    for kind, arg in ops:
        if kind.startswith("alloc"):
            n = arg % 6
            after = owned[arg % len(owned)][-1] if kind == "alloc_after" and owned else None
            if n > alloc.num_free:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n, after=after)
            elif n:
                pages = alloc.allocate(n, after=after)
                assert len(pages) == len(set(pages)) == n
                owned.append(pages)
        elif kind == "free" and owned:
            alloc.free(owned.pop(arg % len(owned)))
        elif kind == "share" and owned:
            pages = owned[arg % len(owned)]
            alloc.share(pages)
            owned.append(list(pages))
        alloc.check_integrity()
        assert alloc.num_used == len({p for pages in owned for p in pages})
    for pages in owned:
        alloc.free(pages)
    assert alloc.num_free == num_pages
    alloc.check_integrity()
