"""A worker's load figures, readable without waiting behind a step.

The figures of an engine (pages, requests, rooms) are read under the lock its step holds
throughout, and a step can take seconds (a 2,048-token float32 prefill chunk of a 0.5B model
takes about 7 s on 2 cores). A router polls ``GetLoad`` with a deadline (5 s by default) and
takes a worker whose poll failed for a dead one: with a single worker, the pool then is not
ready and new requests are refused with 503. So ``GetLoad`` reads :meth:`FigureBoard.now`:
the figures as they are when the lock is free, else as they stood after the last step (the
step holding the lock refreshes them, under it, before releasing it). ``Admin.GetStats`` and
leak checks read :meth:`FigureBoard.exact`, which waits for the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Figures = dict[str, Any]


class FigureBoard:
    """The figures ``compute`` returns (called with ``lock`` held), and their last copy."""

    def __init__(self, lock: threading.Condition | threading.Lock,
                 compute: Callable[[], Figures]) -> None:
        self._lock, self._compute = lock, compute
        self._last: Figures | None = None

    def refresh(self) -> Figures:
        """Compute the figures and keep them (``lock`` held by the caller)."""
        self._last = self._compute()
        return dict(self._last)

    def exact(self) -> Figures:
        """The figures now: waits for the lock."""
        with self._lock:
            return self.refresh()

    def now(self) -> Figures:
        """The figures now if the lock is free, else as the last step left them (waiting for
        the lock only when no step has refreshed them yet)."""
        if self._lock.acquire(blocking=False):
            try:
                return self.refresh()
            finally:
                self._lock.release()
        last = self._last
        return dict(last) if last is not None else self.exact()
