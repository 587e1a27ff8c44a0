"""The one thread a worker's engine computes on: it is built there, warmed up there and stepped
there (:class:`serving.engine_thread.EngineThread` runs its loop on it).

Why one thread: PyTorch's CPU operators run their parallel regions on OpenMP, and GNU OpenMP
(the runtime the PyTorch wheel ships) keeps a pool of worker threads *per thread that starts a
region*. An engine built on the server's main thread (loading, packing the weights) leaves a
pool there; stepped on another thread, it starts a second pool. With more OpenMP threads than
CPUs in the process, libgomp stops spinning between regions (``GOMP_SPINCOUNT``: 100 spins
then, 300,000 otherwise, by its documentation) and puts its workers to sleep after each one, so
every one of a decode step's ~1,000 regions pays a futex wake-up: on 2 cores a bfloat16 batch-1
step of a 0.5B model took 51.7-54.9 ms stepped on another thread than the one that built it,
against 45-47 ms built and stepped on one thread (2026-12-06; ``docs/performance.md``). Tasks
run in submission order; the engine loop, once submitted, holds the thread until it stops.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_Task = tuple[Callable[[], Any], "Future[Any]"]


class ComputeThread:
    """A single daemon thread (started on first use) that runs what it is given, in order; a
    process ends without waiting for it, as for any daemon thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._start = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the thread once the tasks before it ended."""
        future: Future[T] = Future()
        self._tasks.put((fn, future))
        with self._start:
            if not self._thread.is_alive() and self._thread.ident is None:
                self._thread.start()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the thread, awaited (its exception re-raised here)."""
        return await asyncio.wrap_future(self.submit(fn))

    def shutdown(self) -> None:
        """End the thread once the tasks given before have."""
        self._tasks.put(None)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after :meth:`shutdown`); at once if it never started."""
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(exc)
