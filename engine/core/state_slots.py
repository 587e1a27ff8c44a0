"""Pure-Python allocator of linear-attention state slots.

Slots are Python ints in ``[0, num_slots)``, each indexing one conv and one recurrent state per
linear-attention layer of the state pool (``engine.kv.state_pool``). A slot is owned by exactly
one running request from :meth:`StateSlotAllocator.allocate` to :meth:`StateSlotAllocator.free`:
its state is that request's whole past, so it is never shared (no refcounts, unlike KV pages).
The allocator does not touch the states; whoever hands a slot to a new request zeroes it first
(``StatePool.reset``). The lowest free slot goes first.
"""

from __future__ import annotations

import heapq

from engine.errors import OutOfStateSlotsError


class StateSlotAllocator:
    """Hands out state slot ids, one owner each.

    Invariants: ``num_free + num_used == num_slots``; the heap holds exactly the free slots.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._used = bytearray(num_slots)  # 1 = owned by a request
        self._free = list(range(num_slots))  # sorted, hence already a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def is_free(self, slot: int) -> bool:
        self._check_slot(slot)
        return not self._used[slot]

    def allocate(self) -> int:
        """Take the lowest free slot. Raises :class:`OutOfStateSlotsError` when none is free."""
        if not self._free:
            raise OutOfStateSlotsError(
                f"all {self.num_slots} linear-attention state slots are in use")
        slot = heapq.heappop(self._free)
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises ``ValueError`` (changing nothing) on a slot outside
        ``[0, num_slots)`` or one that is not in use (a double free)."""
        self._check_slot(slot)
        if not self._used[slot]:
            raise ValueError(f"double free of state slot {slot}: it is not in use")
        self._used[slot] = 0
        heapq.heappush(self._free, slot)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot!r} is outside [0, {self.num_slots})")
