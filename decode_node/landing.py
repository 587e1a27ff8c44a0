"""Rank 0's landing buffers: where prefill ranks that each hold a slice of its KV heads (a
prefill of larger TP) write whole pages, which the bootstrap client scatters into the pool on
``Success`` (:mod:`transfer.heads`). Without one those slices go one block per token.

A decode learns a prefill's TP layout from its registration reply
(``RegisterReply.prefill_head_ranges``); :meth:`Landings.for_prefill` then gives the landing
buffer for that layout (one slot per prefill rank that writes rank 0, in rank order), made and
registered with rank 0's manager the first time, and the free-page list every client of that
layout shares. A buffer holds enough pages for one request of the longest allowed prompt (and
no more than the pool), so a room that waits for landing pages is admitted once the rooms
before it landed.
"""

from __future__ import annotations

from engine.kv_cache import KVPool
from engine.kv_staging import HeadLandingBuffer
from transfer.base import KVManager
from transfer.errors import HeadLayoutError
from transfer.heads import HeadLayout, landing_slices, receivers
from transfer.staging import LandingPages


class Landings:
    """The landing buffers of rank 0 (``pool``, whose heads are ``heads.ranges[0]``), made on
    demand per prefill layout, each of ``num_pages`` pages."""

    def __init__(self, pool: KVPool, manager: KVManager, heads: HeadLayout,
                 num_pages: int) -> None:
        self.pool, self.manager, self.heads, self.num_pages = pool, manager, heads, num_pages
        self._made: dict[tuple[tuple[int, int], ...], tuple[HeadLandingBuffer, LandingPages]] = {}

    def for_prefill(self, ranges: tuple[tuple[int, int], ...]
                    ) -> tuple[HeadLandingBuffer, LandingPages] | None:
        """The landing buffer (every slot) and its free pages for a prefill whose ranks hold
        ``ranges``; None when its ranks write rank 0's pages themselves (equal or smaller TP,
        or a prefill that describes no heads)."""
        if not ranges:
            return None
        h = self.heads
        src = HeadLayout(h.num_kv_heads, h.head_dim, h.dtype, h.page_size, ranges)
        try:
            slices = landing_slices(src, h, 0)
            writers = receivers(src, h)[0]
        except HeadLayoutError:
            return None  # the handshake refuses such a prefill anyway
        if not slices or len(slices) != len(writers):
            return None
        key = tuple(slices)
        if key not in self._made:
            buffer = HeadLandingBuffer(self.pool.entries(), self.pool.entry_layer_ids(), slices,
                                       self.num_pages)
            self.manager.register_landing(buffer.buffer_infos())
            self._made[key] = (buffer, LandingPages(self.num_pages))
        return self._made[key]
