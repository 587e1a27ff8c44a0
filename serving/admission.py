"""Bounded admission for a worker's request calls: refuse new work while the node's queue is full.

A worker service admits each new room through one :class:`AdmissionGate`. The gate reads the
node's queue depth (off the event loop: the figure sits behind the engine thread's lock), adds
the calls that passed the check but have not reached the queue yet, and refuses the call with
``RESOURCE_EXHAUSTED`` and a retry hint (:func:`serving.overload.abort_overloaded`) when that
sum reaches ``max_waiting``. So a flood queues at the router's clients, not in the node's memory.

Counters (``requests_total``: admitted, ``requests_rejected``: refused here) exist from the
start, since ``Admin.GetStats`` copies them from another thread.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

# grpc only where a call is refused: the command line reads DEFAULT_MAX_WAITING from here and
# builds every parser without grpc
if TYPE_CHECKING:
    import grpc

DEFAULT_MAX_WAITING = 256  # a worker's bound when --max-waiting is not given


class AdmissionGate:
    """At most ``max_waiting`` requests wait on a node. ``queued`` (blocking) is the node's
    queue depth; ``what`` words it for the refusal, e.g. ``"prefill node: {queued} rooms wait"``.

    Invariant: :attr:`admitting` counts the calls between their depth check and the end of
    their enqueue, so calls admitted at the same time count each other.
    """

    def __init__(self, max_waiting: int, queued: Callable[[], int], what: str) -> None:
        if max_waiting < 1:  # 0 or less would refuse every request
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.counters: Counter[str] = Counter(requests_total=0, requests_rejected=0)
        self.admitting = 0
        self._queued = queued
        self._what = what

    async def admit(self, context: grpc.aio.ServicerContext,
                    enqueue: Callable[[], Awaitable[None]]) -> None:
        """Check the bound, then run ``enqueue`` (which aborts the call when it refuses the
        request); counts the call as admitted once ``enqueue`` returned."""
        self.admitting += 1
        try:
            queued = await asyncio.to_thread(self._queued)
            if queued + self.admitting - 1 >= self.max_waiting:
                self.counters["requests_rejected"] += 1
                from serving.overload import abort_overloaded

                await abort_overloaded(context, f"{self._what.format(queued=queued)} "
                                                f"(--max-waiting {self.max_waiting})")
            await enqueue()
            self.counters["requests_total"] += 1
        finally:
            self.admitting -= 1
