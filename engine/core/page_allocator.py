"""Pure-Python KV page allocator: a free list with reference counts that prefers contiguous runs.

Pages are Python ints in ``[0, num_pages)``. A page is *used* while its refcount is positive and
*free* at zero. Contiguous runs matter because the transfer layer sends runs of consecutive pages
as one block, so :meth:`PageAllocator.allocate` tries, in order:

1. with ``after``: continue the caller's run at ``after + 1`` while those pages are free;
2. the lowest-address run of the (remaining) pages that is entirely free;
3. the lowest free pages.

Bookkeeping: ``_free_map`` is a bytearray (1 = free) so that finding a run of ``n`` free pages is
one C-level ``find``; ``_heap`` is a min-heap of candidate free pages with lazy deletion (an entry
is stale while its page is used; ``_in_heap`` keeps one entry per page at most), which makes the
single-page path O(log n).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

from engine.errors import OutOfPagesError

_FREE = 1
_USED = 0


class PageAllocator:
    """Hands out KV page ids with refcounts.

    Invariants (checked by :meth:`check_integrity`): ``num_free + num_used == num_pages``; a page is
    free iff its refcount is 0; every free page is reachable from the heap.
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free_map = bytearray([_FREE]) * num_pages
        self._heap = list(range(num_pages))  # sorted, hence already a heap
        self._in_heap = bytearray([1]) * num_pages
        self._num_free = num_pages

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refcount[page]

    def is_free(self, page: int) -> bool:
        self._check_page(page)
        return self._free_map[page] == _FREE

    # ---- allocation ----------------------------------------------------------------------------

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free pages (refcount 1 each), preferring contiguous runs.

        Raises :class:`OutOfPagesError` (taking nothing) if fewer than ``n`` pages are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._num_free:
            raise OutOfPagesError(f"asked for {n} KV pages but only {self._num_free} are free")
        if n == 0:
            return []
        pages: list[int] = []
        if after is not None:
            pages = self._extend_run(after, n)
        rest = n - len(pages)
        if rest == 1:
            pages.append(self._pop_lowest())
        elif rest > 1:
            pages.extend(self._take_run(rest) or self._take_lowest(rest))
        return pages

    def _extend_run(self, after: int, n: int) -> list[int]:
        start = after + 1
        if not 0 <= start < self.num_pages or self._free_map[start] != _FREE:
            return []
        end = min(start + n, self.num_pages)
        used_at = self._free_map.find(_USED, start, end)
        end = end if used_at < 0 else used_at
        self._mark_used(range(start, end))
        return list(range(start, end))

    def _take_run(self, n: int) -> list[int]:
        start = self._free_map.find(bytes([_FREE]) * n)
        if start < 0:
            return []
        self._mark_used(range(start, start + n))
        return list(range(start, start + n))

    def _take_lowest(self, n: int) -> list[int]:
        return [self._pop_lowest() for _ in range(n)]

    def _pop_lowest(self) -> int:
        heap, free_map, in_heap = self._heap, self._free_map, self._in_heap
        while True:
            page = heapq.heappop(heap)
            in_heap[page] = 0
            if free_map[page] == _FREE:
                self._mark_used((page,))
                return page

    def _mark_used(self, pages: Iterable[int]) -> None:
        for page in pages:
            self._free_map[page] = _USED
            self._refcount[page] = 1
            self._num_free -= 1

    # ---- release and sharing -------------------------------------------------------------------

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; a page at refcount 0 becomes free.

        Raises ``ValueError`` (changing nothing) on a page that is out of range or would be freed
        more times than it is referenced (double free).
        """
        self._check_releasable(pages)
        refcount = self._refcount
        for page in pages:
            refcount[page] -= 1
            if refcount[page] == 0:
                self._free_map[page] = _FREE
                self._num_free += 1
                if not self._in_heap[page]:
                    self._in_heap[page] = 1
                    heapq.heappush(self._heap, page)

    def share(self, pages: list[int]) -> None:
        """Add one reference to each (used) page."""
        for page in pages:
            self._check_page(page)
            if self._refcount[page] == 0:
                raise ValueError(f"cannot share page {page}: it is free")
        for page in pages:
            self._refcount[page] += 1

    def _check_releasable(self, pages: list[int]) -> None:
        for page in pages:
            self._check_page(page)
        for page, times in Counter(pages).items():
            if self._refcount[page] < times:
                raise ValueError(
                    f"double free of KV page {page} (refcount {self._refcount[page]}, "
                    f"freed {times} time(s))"
                )

    def _check_page(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page!r} is outside [0, {self.num_pages})")

    # ---- checks --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the invariants above (O(num_pages); for tests and debugging)."""
        free = [p for p in range(self.num_pages) if self._free_map[p] == _FREE]
        assert len(free) == self._num_free, (len(free), self._num_free)
        assert self._num_free + self.num_used == self.num_pages
        for page in range(self.num_pages):
            rc = self._refcount[page]
            assert rc >= 0, (page, rc)
            assert (rc == 0) == (self._free_map[page] == _FREE), (page, rc)
        assert len(self._heap) == sum(self._in_heap) <= self.num_pages
        heaped = set(self._heap)
        assert len(heaped) == len(self._heap), "duplicate heap entries"
        assert all(p in heaped for p in free), "free page missing from the heap"
