"""Linear-attention state checkpoints of the prefix cache (hybrid models): which block boundary
each checkpoint slot holds the state at, evicted LRU.

A hybrid model's request state (``engine/kv/state_pool.py``) is valid only after the request's
last computed token, so a KV prefix hit is of use only where the state after that prefix is kept
too. The state pool therefore holds, after the requests' slots, ``num_slots`` *checkpoint slots*
(pool slots ``first_slot .. first_slot + num_slots - 1``). A checkpoint is the state after the
first ``j * page_size`` tokens of some prompt, keyed by the prefix cache's key of block ``j - 1``
(``engine/core/prefix_cache.py``: the chain hash covers every token and image before the
boundary, so equal keys mean equal states). Checkpoints sit at every ``interval`` tokens of a
prompt (a multiple of the page size): the scheduler ends prefill chunks there and, after the
forward, the chunk's request slot is copied into a checkpoint slot.

A slot moves ``free -> reserved`` (:meth:`StateCheckpoints.reserve`, at schedule time, evicting
the least recently used checkpoint when none is free) ``-> cached`` (:meth:`commit`, once the
forward wrote it; a key cached already keeps its slot and the new one goes back to free). A
reserved slot a step never filled goes back with :meth:`release`. Reading a checkpoint
(:meth:`get`) marks it recently used; its copy into a request's slot runs before the next
forward, ahead of that forward's own writes into checkpoint slots, so a checkpoint evicted in
the step that reads it is still read whole.

Invariants (:meth:`check`): free, reserved and cached slots are disjoint and together all the
slots; ``_by_key`` and ``_key_of`` are inverse maps. Pure Python: no torch here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class CheckpointStats:
    """Counters since the checkpoints were made."""

    saved: int = 0  # checkpoints committed (a duplicate key is not counted)
    restored: int = 0  # prefix hits served from a checkpoint
    evicted: int = 0


class StateCheckpoints:
    """``num_slots`` checkpoint slots from pool slot ``first_slot`` on, one every ``interval``
    tokens of a prompt (see the module docstring)."""

    def __init__(self, num_slots: int, first_slot: int, interval: int, page_size: int) -> None:
        if num_slots < 0 or first_slot < 0:
            raise ValueError(f"checkpoint slots {num_slots} from {first_slot}")
        if interval < page_size or interval % page_size:
            raise ValueError(f"a state checkpoint interval of {interval} tokens is not a "
                             f"positive multiple of the page size {page_size}")
        self.num_slots = num_slots
        self.interval = interval
        self.stats = CheckpointStats()
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop(): lowest
        self._reserved: set[int] = set()
        self._by_key: OrderedDict[Hashable, int] = OrderedDict()  # least recently used first
        self._key_of: dict[int, Hashable] = {}

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    @property
    def num_reserved(self) -> int:
        """Slots a scheduled step will fill (0 between steps)."""
        return len(self._reserved)

    def is_boundary(self, tokens: int) -> bool:
        """Whether a checkpoint may sit after the first ``tokens`` tokens (a positive multiple
        of the interval) and any slot exists to hold it."""
        return self.num_slots > 0 and tokens > 0 and tokens % self.interval == 0

    def next_boundary(self, start: int) -> int:
        """The first checkpoint boundary after token ``start``."""
        return (start // self.interval + 1) * self.interval

    def get(self, key: Hashable) -> int | None:
        """The slot holding the state at ``key``'s boundary, or None; marks it recently used."""
        slot = self._by_key.get(key)
        if slot is not None:
            self._by_key.move_to_end(key)
        return slot

    def __contains__(self, key: Hashable) -> bool:
        return key in self._by_key

    def reserve(self) -> int | None:
        """A slot to save a state into: a free one, else the least recently used checkpoint's
        (evicted); None when every slot is reserved (or there are none)."""
        if not self._free and self._by_key:
            _, slot = self._by_key.popitem(last=False)
            del self._key_of[slot]
            self._free.append(slot)
            self.stats.evicted += 1
        if not self._free:
            return None
        slot = self._free.pop()
        self._reserved.add(slot)
        return slot

    def commit(self, key: Hashable, slot: int) -> None:
        """Reserved ``slot`` now holds the state at ``key``'s boundary. A key cached already
        keeps its slot, and ``slot`` goes back to free."""
        self._reserved.remove(slot)
        if key in self._by_key:
            self._free.append(slot)
            return
        self._by_key[key] = slot
        self._key_of[slot] = key
        self.stats.saved += 1

    def release(self, slot: int) -> None:
        """Give back a reserved ``slot`` that holds no checkpoint."""
        self._reserved.remove(slot)
        self._free.append(slot)

    def clear(self) -> None:
        """Forget every checkpoint (reserved slots stay reserved)."""
        self.stats.evicted += len(self._by_key)
        self._free.extend(self._by_key.values())
        self._by_key.clear()
        self._key_of.clear()

    def check(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        cached = set(self._by_key.values())
        free = set(self._free)
        assert len(free) == len(self._free), "a checkpoint slot is free twice"
        assert not (free & cached or free & self._reserved or cached & self._reserved)
        assert len(free) + len(cached) + len(self._reserved) == self.num_slots
        assert all(self._by_key[k] == s for s, k in self._key_of.items())
        assert len(self._key_of) == len(self._by_key)
