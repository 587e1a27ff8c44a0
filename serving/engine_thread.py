"""The engine thread of a worker node: one background thread steps an engine while the gRPC
handlers submit, abort and read figures from other threads. The loop runs on a
:class:`~serving.compute_thread.ComputeThread`: the node's, on which it built its engine (the
same thread must build and step an engine on the CPU, see there), or one of its own.

Locking discipline: all engine state (scheduler, rooms, transfer queues) is touched under one
lock, :attr:`EngineThread.lock` (a ``threading.Condition``). The thread holds it for each poll
and step; other threads take it briefly (submit, abort, stats) and ``notify()`` it when they add
work, so an idle thread wakes at once. Between passes the thread releases the lock and yields
(``time.sleep(0)``): a lock released and at once retaken by the same thread would starve them.

One pass of the thread, every hook but :meth:`EngineThread.publish` called with the lock held:

1. return if :meth:`EngineThread.stop` was called;
2. :meth:`EngineThread.poll`: work due whether or not a step runs (bootstrap gates, transfers);
3. if :meth:`EngineThread.has_work` is false, wait for :meth:`EngineThread.idle_wait_s`
   seconds (``None``: until notified) and start the next pass;
4. :meth:`EngineThread.step`; if it raises, the exception is logged and
   :meth:`EngineThread.fail_all` ends every request: a bug fails the requests, never hangs them;
   then the node's :meth:`EngineThread.figures` are kept for :meth:`EngineThread.load`;
5. release the lock and :meth:`EngineThread.publish` what the step (or ``fail_all``) returned.

An exception :meth:`EngineThread.fatal` names (the engine cannot step again: a tensor-parallel
rank died) is recorded in :attr:`EngineThread.dead` before ``fail_all`` runs (which may then
fail requests differently), stops the thread and ends the process as a failure
(:func:`serving.process_exit.end_with_failure`) once the failed requests are published.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Generic, TypeVar

from serving.compute_thread import ComputeThread
from serving.figures import FigureBoard, Figures
from serving.process_exit import end_with_failure

log = logging.getLogger(__name__)
Out = TypeVar("Out")


class EngineThread(ABC, Generic[Out]):
    """The thread, its lock and its run loop; a node's loop provides the hooks. ``Out`` is what
    a step hands to :meth:`publish` (``None`` when a step publishes nothing)."""

    def __init__(self, name: str, failure: str, compute: ComputeThread | None = None) -> None:
        """``name`` names the thread and its log lines; ``failure`` is the reason
        :meth:`fail_all` gets when a step raises; ``compute``: the thread the engine was built
        on (a thread of its own when None)."""
        self.name = name
        self.failure = failure
        self.lock = threading.Condition(threading.Lock())
        self._stopping = False
        self.dead: str | None = None  # why the engine cannot step again (see fatal)
        self.compute = compute or ComputeThread(name)
        self._done: Future[None] | None = None
        self.board = FigureBoard(self.lock, self.figures)  # refreshed by every step

    def start(self) -> None:
        self._done = self.compute.submit(self._run)
        self._done.add_done_callback(self._log_end)

    def stop(self) -> None:
        """End the thread after its current pass and wait for it."""
        with self.lock:
            self._stopping = True
            self.lock.notify()
        if self._done is not None:
            self._done.exception()  # waits; an error was logged by _log_end
        self.compute.shutdown()
        self.compute.join()

    def _log_end(self, done: Future[None]) -> None:
        """Log the loop's end by an error outside a step (a step's own is handled there)."""
        exc = done.exception()
        if exc is not None:
            log.error("%s: the engine loop ended", self.name, exc_info=exc)

    def stats(self) -> Figures:
        """The node's figures now (``Admin.GetStats``, leak checks): waits for a step to end."""
        return self.board.exact()

    def load(self) -> Figures:
        """The figures without waiting behind a step (``GetLoad``: :mod:`serving.figures`)."""
        return self.board.now()

    # ---- hooks ---------------------------------------------------------------------------

    def figures(self) -> Figures:
        """The node's figures (lock held); none by default."""
        return {}

    def poll(self) -> None:  # noqa: B027 - a hook that does nothing unless overridden
        """Work due on every pass before the idle check (lock held); nothing by default."""

    @abstractmethod
    def has_work(self) -> bool:
        """Whether a step has anything to do (lock held)."""

    @abstractmethod
    def idle_wait_s(self) -> float | None:
        """How long an idle pass sleeps unless notified (lock held); None: until notified."""

    @abstractmethod
    def step(self) -> Out:
        """Run one engine step (lock held)."""

    @abstractmethod
    def fail_all(self, reason: str) -> Out:
        """End every request after a step raised (lock held)."""

    def publish(self, out: Out) -> None:  # noqa: B027 - a hook that does nothing by default
        """Hand on what :meth:`step` or :meth:`fail_all` returned, with the lock released."""

    def fatal(self, exc: Exception) -> bool:
        """Whether ``exc``, raised by a step, leaves an engine that cannot step again; False by
        default."""
        return False

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while self._pass():
            time.sleep(0)  # let submit/abort/stats threads take the lock between passes

    def _pass(self) -> bool:
        """One pass (see the module docstring); False once stopped."""
        with self.lock:
            if self._stopping:
                return False
            self.poll()
            if not self.has_work():
                self.lock.wait(self.idle_wait_s())
                return True
            try:
                out = self.step()
            except Exception as exc:  # a bug must fail the step's requests, not hang them
                log.exception("%s: step failed; failing every request (%s)", self.name,
                              self.failure)
                if self.fatal(exc):
                    self.dead, self._stopping = f"{type(exc).__name__}: {exc}", True
                out = self.fail_all(self.failure)
            self.board.refresh()
        self.publish(out)
        if self.dead is not None:
            end_with_failure(f"{self.name}: {self.dead}")
            return False
        return True
