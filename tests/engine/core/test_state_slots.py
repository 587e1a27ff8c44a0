"""StateSlotAllocator: lowest slot first, exhaustion, double free and unknown slots."""

from __future__ import annotations

import pytest

from engine.core.state_slots import StateSlotAllocator
from engine.errors import OutOfPagesError, OutOfStateSlotsError


def test_hands_out_the_lowest_free_slot() -> None:
    alloc = StateSlotAllocator(4)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    assert (alloc.num_free, alloc.num_used, alloc.num_slots) == (1, 3, 4)
    alloc.free(1)
    assert alloc.is_free(1) and not alloc.is_free(0)
    assert alloc.allocate() == 1
    assert alloc.allocate() == 3


def test_exhaustion_raises_and_a_freed_slot_comes_back() -> None:
    alloc = StateSlotAllocator(2)
    alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfStateSlotsError, match="all 2 linear-attention state slots"):
        alloc.allocate()
    assert issubclass(OutOfStateSlotsError, OutOfPagesError)  # RESOURCE_EXHAUSTED on the wire
    alloc.free(0)
    assert alloc.allocate() == 0
    assert StateSlotAllocator(0).num_free == 0


def test_double_free_and_unknown_slots_change_nothing() -> None:
    alloc = StateSlotAllocator(3)
    slot = alloc.allocate()
    alloc.free(slot)
    with pytest.raises(ValueError, match="double free of state slot 0"):
        alloc.free(slot)
    with pytest.raises(ValueError, match="double free of state slot 2"):
        alloc.free(2)  # never handed out
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="outside"):
            alloc.free(bad)
    assert (alloc.num_free, alloc.num_used) == (3, 0)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        StateSlotAllocator(-1)
