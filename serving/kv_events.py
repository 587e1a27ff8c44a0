"""A worker's prefix-cache events for the router: the ``SubscribeKvEvents`` stream of both worker
services (see ``KvEventBatch`` in ``proto/pdserve/v1/worker.proto``).

:class:`KvEventHub` is the cache's listener (``engine.core.prefix_cache.CacheListener``). On the
engine thread, under the loop lock, it numbers each change, applies it to a mirror of the cached
blocks (id -> parent id and tokens: a few dozen bytes per cached page) and appends it to every
subscriber's queue; nothing else happens there (no protobuf, one wake-up per subscriber until it
drains). Each stream first sends a snapshot of the mirror (``cleared``, then every block, parents
first), then the changes in order. A queue holds at most ``max_queued`` changes: a subscriber
that falls that far behind loses them and gets a fresh snapshot instead, so a slow router costs
bounded memory and still ends up with the cache's true contents.
"""

from __future__ import annotations

import asyncio
import threading
from array import array
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from proto.pdserve.v1 import worker_pb2 as wpb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MAX_QUEUED = 65536  # changes a subscriber may lag behind before it is resynced by a snapshot
SNAPSHOT_BATCH = 1024  # blocks per message of a snapshot


@dataclass(frozen=True, slots=True)
class _Change:
    """One numbered change: blocks stored (one, with its parent and tokens), removed, or all
    cleared (``ids`` empty, ``tokens`` None)."""

    seq: int
    stored: bool
    ids: tuple[bytes, ...] = ()
    parent: bytes = b""
    tokens: array[int] | None = None

    def message(self) -> wpb.KvEvent:
        if self.stored:
            return wpb.KvEvent(seq=self.seq, stored=wpb.KvBlockStored(
                block_hash=self.ids[0], parent_hash=self.parent, token_ids=self.tokens))
        if self.ids:
            return wpb.KvEvent(seq=self.seq, removed=wpb.KvBlocksRemoved(block_hashes=self.ids))
        return wpb.KvEvent(seq=self.seq, cleared=wpb.KvCleared())


@dataclass(eq=False)
class _Subscriber:
    aio: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    queue: deque[_Change] = field(default_factory=deque)
    resync: bool = True  # the next drain sends a snapshot (the first one does)
    woken: bool = False  # a wake-up is on its way (guarded by the hub's lock)


class KvEventHub:
    """The fan-out of one node's prefix-cache changes (see the module docstring)."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._blocks: dict[bytes, tuple[bytes, array[int]]] = {}  # id -> (parent id, tokens)
        self._subs: list[_Subscriber] = []
        self._seq = 0
        self._closed = False

    # ---- the listener (engine thread) -----------------------------------------------------

    def block_stored(self, block_id: bytes, parent_id: bytes, token_ids: list[int]) -> None:
        tokens = array("I", token_ids)
        with self._lock:
            self._blocks[block_id] = (parent_id, tokens)
            self._push(True, (block_id,), parent_id, tokens)

    def blocks_removed(self, block_ids: list[bytes]) -> None:
        with self._lock:
            for block in block_ids:
                self._blocks.pop(block, None)
            self._push(False, tuple(block_ids))

    def cleared(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._push(False)

    def _push(self, stored: bool, ids: tuple[bytes, ...] = (), parent: bytes = b"",
              tokens: array[int] | None = None) -> None:
        """Number a change and queue it for every subscriber (lock held)."""
        self._seq += 1
        if not self._subs:
            return
        change = _Change(self._seq, stored, ids, parent, tokens)
        for sub in self._subs:
            if sub.resync:
                continue  # its snapshot will include this change
            if len(sub.queue) >= self.max_queued:
                sub.queue.clear()
                sub.resync = True
            else:
                sub.queue.append(change)
            self._wake(sub)

    @staticmethod
    def _wake(sub: _Subscriber) -> None:
        if not sub.woken:
            sub.woken = True
            sub.aio.call_soon_threadsafe(sub.wake.set)

    # ---- the streams (event loop) ---------------------------------------------------------

    async def stream(self) -> AsyncIterator[wpb.KvEventBatch]:
        """One subscriber's messages until :meth:`close` (or the caller stops iterating)."""
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            if self._closed:
                return
            self._subs.append(sub)
            self._wake(sub)
        try:
            while True:
                await sub.wake.wait()
                sub.wake.clear()
                with self._lock:
                    if self._closed:
                        return
                    sub.woken = False
                    snapshot = list(self._blocks.items()) if sub.resync else None
                    seq, sub.resync = self._seq, False
                    changes = list(sub.queue)
                    sub.queue.clear()
                if snapshot is not None:
                    for batch in _snapshot(seq, snapshot):
                        yield batch
                if changes:
                    yield wpb.KvEventBatch(events=[c.message() for c in changes])
        finally:
            with self._lock:
                self._subs.remove(sub)

    def close(self) -> None:
        """End every stream (at shutdown: an open stream would hold the server's grace)."""
        with self._lock:
            self._closed = True
            for sub in self._subs:
                self._wake(sub)


def _snapshot(seq: int, blocks: list[tuple[bytes, tuple[bytes, array[int]]]]
              ) -> Iterable[wpb.KvEventBatch]:
    """``cleared`` and every block of ``blocks``, parents before children, in messages of at
    most ``SNAPSHOT_BATCH`` events, all numbered ``seq``."""
    events = [wpb.KvEvent(seq=seq, cleared=wpb.KvCleared())]
    known = dict(blocks)
    done: set[bytes] = set()
    for block in known:
        chain = []  # block and its ancestors not sent yet, child first
        up = block
        while up in known and up not in done:
            chain.append(up)
            done.add(up)
            up = known[up][0]
        for b in reversed(chain):
            parent, tokens = known[b]
            events.append(wpb.KvEvent(seq=seq, stored=wpb.KvBlockStored(
                block_hash=b, parent_hash=parent, token_ids=tokens)))
            if len(events) == SNAPSHOT_BATCH:
                yield wpb.KvEventBatch(events=events)
                events = []
    if events:
        yield wpb.KvEventBatch(events=events)


def kv_event_hub(engine: LLMEngine) -> KvEventHub | None:
    """A hub listening to ``engine``'s prefix cache (call before its thread starts); None when
    the engine keeps no prefix cache."""
    cache = engine.scheduler.prefix_cache
    if cache is None:
        return None
    hub = KvEventHub()
    cache.listener = hub
    return hub


async def kv_event_stream(hub: KvEventHub | None, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[wpb.KvEventBatch]:
    """The ``SubscribeKvEvents`` handler of a node whose cache ``hub`` follows (None: refused
    with ``FAILED_PRECONDITION``, the node keeps no prefix cache)."""
    if hub is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "this node keeps no prefix cache (no KV events)")
        return
    async for batch in hub.stream():
        yield batch
