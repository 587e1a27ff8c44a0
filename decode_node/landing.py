"""Landing buffers: where prefill ranks that each hold a slice of a decode rank's KV heads (a
prefill of larger TP) write whole pages, which that rank's bootstrap client scatters into its
pool on ``Success`` (:mod:`transfer.plan.heads`). Without one those slices go one block per token.

A decode learns a prefill's TP layout from its registration reply
(``RegisterReply.prefill_head_ranges``); :meth:`Landings.for_prefill` then gives a rank's landing
buffer for that layout (one slot per prefill rank that writes that decode rank, in rank order),
made and registered the first time, and the free-page list every client of that layout and rank
shares. Rank 0's buffers live here, registered with its manager; another rank's live in its own
process, made and scattered there by its agent (:mod:`decode_node.rank_landing`). A buffer covers
every KV entry (a draft's band too) and holds enough pages for one request of the longest
allowed prompt (and no more than the pool), so a room that waits for landing pages is admitted
once the rooms before it landed.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_node.rank_landing import RankLandingAgent
from engine.kv.pool import KVPool
from engine.kv.staging import HeadLandingBuffer
from transfer.base import KVManager
from transfer.errors import HeadLayoutError
from transfer.plan.heads import HeadLayout, landing_slices, receivers
from transfer.tp.staging import HeadLanding, LandingPages


class Landings:
    """The landing buffers of every rank, made on demand per prefill layout, each of
    ``num_pages`` pages: rank 0's over ``pools`` (the target's, then a draft's) registered with
    ``manager``; rank ``r``'s through ``agents[r - 1]``. ``heads``: the decode's KV heads over
    its ranks."""

    def __init__(self, pools: Sequence[KVPool], manager: KVManager, heads: HeadLayout,
                 num_pages: int, agents: Sequence[RankLandingAgent] = ()) -> None:
        self.entries = [e for pool in pools for e in pool.entries()]
        self.layer_ids = [i for pool in pools for i in pool.entry_layer_ids()]
        self.manager, self.heads, self.num_pages = manager, heads, num_pages
        self.agents = list(agents)
        self._made: dict[tuple[int, tuple[tuple[int, int], ...]],
                         tuple[HeadLanding, LandingPages]] = {}

    def for_prefill(self, ranges: tuple[tuple[int, int], ...], rank: int = 0
                    ) -> tuple[HeadLanding, LandingPages] | None:
        """Decode rank ``rank``'s landing buffer (every slot) and its free pages for a prefill
        whose ranks hold ``ranges``; None when its ranks write that rank's pages themselves
        (equal or smaller TP, or a prefill that describes no heads), or when the rank has no
        agent. ``TransferError`` when another rank's agent fails to make it."""
        if not ranges or not 0 <= rank <= len(self.agents):
            return None
        h = self.heads
        src = HeadLayout(h.num_kv_heads, h.head_dim, h.dtype, h.page_size, ranges)
        try:
            slices = landing_slices(src, h, rank)
            writers = receivers(src, h)[rank]
        except HeadLayoutError:
            return None  # the handshake refuses such a prefill anyway
        if not slices or len(slices) != len(writers):
            return None
        key = (rank, tuple(slices))
        if key not in self._made:
            buffer: HeadLanding
            if rank == 0:
                local = HeadLandingBuffer(self.entries, self.layer_ids, slices, self.num_pages)
                self.manager.register_landing(local.buffer_infos())
                buffer = local
            else:
                buffer = self.agents[rank - 1].landing(slices, self.num_pages)
            self._made[key] = (buffer, LandingPages(self.num_pages))
        return self._made[key]

    def close(self) -> None:
        """Close the connections to the other ranks' agents."""
        for agent in self.agents:
            agent.close()
