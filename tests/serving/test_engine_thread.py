"""The engine-thread base (:mod:`serving.engine_thread`): hooks run in order under the lock,
``publish`` runs outside it, and a step that raises fails every request instead of hanging."""

from __future__ import annotations

import threading
import time

from serving.engine_thread import EngineThread


class _Counter(EngineThread[list[int]]):
    """Steps through queued numbers; a step fails on a negative one."""

    def __init__(self) -> None:
        super().__init__("test-loop", "test failure")
        self.queue: list[int] = []
        self.published: list[list[int]] = []
        self.failed: list[str] = []
        self.polls = 0
        self.done = threading.Event()

    def submit(self, n: int) -> None:
        with self.lock:
            self.queue.append(n)
            self.lock.notify()

    def poll(self) -> None:
        self.polls += 1

    def has_work(self) -> bool:
        return bool(self.queue)

    def idle_wait_s(self) -> float | None:
        return None

    def step(self) -> list[int]:
        n = self.queue.pop(0)
        if n < 0:
            raise RuntimeError("a bug")
        return [n]

    def fail_all(self, reason: str) -> list[int]:
        self.failed.append(reason)
        self.queue.clear()
        return []

    def publish(self, out: list[int]) -> None:
        assert self.lock.acquire(blocking=False), "publish runs with the lock released"
        self.lock.release()
        self.published.append(out)
        if out == [3]:
            self.done.set()


def test_steps_publish_outside_the_lock_and_a_failed_step_fails_all() -> None:
    loop = _Counter()
    loop.start()
    try:
        loop.submit(1)
        loop.submit(-1)  # raises: fail_all gets the failure reason, the thread lives on
        deadline = time.monotonic() + 10
        while not loop.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.submit(3)
        assert loop.done.wait(10)
    finally:
        loop.stop()
    assert loop.failed == ["test failure"]
    assert [1] in loop.published and loop.published[-1] == [3]
    assert loop.polls >= 3


def test_stop_wakes_an_idle_thread() -> None:
    loop = _Counter()
    loop.start()
    time.sleep(0.05)  # idle: waiting until notified
    loop.stop()  # returns once the thread ended
    assert "test-loop" not in {t.name for t in threading.enumerate()}
