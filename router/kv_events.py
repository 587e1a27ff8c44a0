"""Precise cache-aware routing (``--kv-events``): every worker's ``SubscribeKvEvents`` stream
builds that worker's :class:`router.prefix_tree.EventTree`.

:class:`KvEventFeeds` keeps one feed per worker of the pool, following DNS discovery (checked
every ``refresh_s``). A feed subscribes, waiting for the worker's channel (``wait_for_ready``),
and applies each message to its tree. A stream starts with a snapshot of the worker's cache
(``cleared``, then every cached block), so the tree is exact from its first message. When the
stream ends for any reason (the worker died, restarted, shuts down, refuses: a node without a
prefix cache), the tree is emptied at once, so no pick trusts a cache that may be gone, and the
feed subscribes again after a backoff (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``, back to
the minimum once a message arrives). An event whose sequence number skips a change (a node never
sends one) ends the stream the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from proto.pdserve.v1 import worker_pb2 as wpb
from router.prefix_tree import EventTree
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 10.0


class SequenceGap(Exception):
    """An event's sequence number skipped a change, or a stream did not start with a snapshot."""


class _Feed:
    """One worker's stream and tree."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.tree = EventTree()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        w, delay, last_why = self.worker, BACKOFF_MIN_S, ""
        while True:
            call = None
            seq: int | None = None  # the last event's number in this stream
            try:
                call = w.stub.SubscribeKvEvents(wpb.SubscribeKvEventsRequest(),
                                                metadata=w.metadata, wait_for_ready=True)
                async for batch in call:
                    seq = apply_events(self.tree, batch, seq)
                    delay = BACKOFF_MIN_S
                why = "the stream ended"
            except grpc.aio.AioRpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
            except (grpc.aio.UsageError, SequenceGap) as exc:  # UsageError: channel closed
                why = str(exc)
            finally:
                if call is not None:
                    call.cancel()
                self.tree.clear()
            if why != last_why:  # once per change, not once per retry
                log.warning("KV events of %s worker %s: %s", w.kind, w.address, why)
                last_why = why
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_S)


def apply_events(tree: EventTree, batch: wpb.KvEventBatch, seq: int | None) -> int | None:
    """Apply one message of a stream to ``tree``; ``seq`` is the number of the stream's last
    event so far (None before the first). Returns the number of its last event; raises
    :class:`SequenceGap` on a number that skips a change (a snapshot's events repeat one)."""
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "cleared":
            tree.clear()
        elif seq is None or not seq <= ev.seq <= seq + 1:
            raise SequenceGap(f"event {ev.seq} after {seq}")
        elif kind == "stored":
            tree.store(ev.stored.block_hash, ev.stored.parent_hash, ev.stored.token_ids)
        else:
            for block in ev.removed.block_hashes:
                tree.remove(block)
        seq = ev.seq
    return seq


class KvEventFeeds:
    """A feed per worker of a pool (see the module docstring); :meth:`start` inside the event
    loop, :meth:`close` at shutdown."""

    def __init__(self) -> None:
        self._feeds: dict[tuple[str, str], _Feed] = {}  # (kind, address) -> its feed
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, kept until they end
        self._task: asyncio.Task[None] | None = None

    async def start(self, pool: WorkerPool) -> None:
        self.sync(pool)
        self._task = asyncio.create_task(self._follow(pool))

    async def close(self) -> None:
        tasks = [*(f.task for f in self._feeds.values()), *self._ending]
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._feeds.clear()

    def tree(self, w: Worker) -> EventTree | None:
        """``w``'s tree; None when no feed follows this worker (yet)."""
        feed = self._feeds.get((w.kind, w.address))
        return feed.tree if feed is not None and feed.worker is w else None

    def sync(self, pool: WorkerPool) -> None:
        """A feed for every worker of ``pool`` and for no other."""
        current = {(w.kind, w.address): w for w in pool.all}
        for key, feed in list(self._feeds.items()):
            if current.get(key) is not feed.worker:
                feed.task.cancel()
                self._ending.add(feed.task)
                feed.task.add_done_callback(self._ending.discard)
                del self._feeds[key]
        for key, w in current.items():
            if key not in self._feeds:
                self._feeds[key] = _Feed(w)

    async def _follow(self, pool: WorkerPool) -> None:
        while True:
            await asyncio.sleep(pool.refresh_s)
            self.sync(pool)
