"""Load figures that never wait behind a step (:mod:`serving.figures`): ``GetLoad`` answers at
once while a step holds the engine's lock, with the figures as the last step left them, where
``Admin.GetStats`` (exact) waits for the step to end. A router polls ``GetLoad`` with a 5 s
deadline and takes a worker that misses it for a dead one; a float32 prefill chunk of 2,048
tokens holds the lock for about 7 s on 2 cores."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from decode_node.service import DecodeService
from prefill_node.service import PrefillService
from serving.engine_thread import EngineThread
from serving.figures import FigureBoard

STEP_S = 0.4


def hold(lock: threading.Condition, seconds: float) -> threading.Thread:
    """Hold ``lock`` for ``seconds`` on another thread (a step); returns once it is held."""
    held = threading.Event()

    def run() -> None:
        with lock:
            held.set()
            time.sleep(seconds)

    thread = threading.Thread(target=run)
    thread.start()
    held.wait()
    return thread


def test_now_answers_during_a_step_and_exact_waits_for_it() -> None:
    lock = threading.Condition()
    count = [0]

    def compute() -> dict[str, int]:
        count[0] += 1
        return {"running_requests": count[0]}

    board = FigureBoard(lock, compute)
    assert board.now() == {"running_requests": 1}  # free lock: fresh
    step = hold(lock, STEP_S)
    start = time.monotonic()
    assert board.now() == {"running_requests": 1}  # the last figures, at once
    assert time.monotonic() - start < STEP_S / 4
    assert board.exact() == {"running_requests": 2}  # after the step
    assert time.monotonic() - start >= STEP_S * 0.9
    step.join()


class _Busy(EngineThread[None]):
    """One long step, then idle; its figures count its steps."""

    def __init__(self) -> None:
        super().__init__("test-loop", "failure")
        self.steps = 0
        self.todo = 0

    def figures(self) -> dict[str, float]:
        return {"running_requests": self.todo, "steps": self.steps}

    def has_work(self) -> bool:
        return self.todo > 0

    def idle_wait_s(self) -> float | None:
        return None

    def step(self) -> None:
        time.sleep(STEP_S)
        self.steps += 1
        self.todo -= 1

    def fail_all(self, reason: str) -> None:
        return None


def test_the_engine_loop_refreshes_its_figures_every_step() -> None:
    loop = _Busy()
    loop.start()
    try:
        with loop.lock:
            loop.todo = 2
            loop.lock.notify()
        time.sleep(STEP_S * 1.5)  # inside the second step, the first one's figures kept
        start = time.monotonic()
        assert loop.load() == {"running_requests": 1, "steps": 1}
        assert time.monotonic() - start < STEP_S / 4
        assert loop.stats() == {"running_requests": 0, "steps": 2}  # waits for the step
    finally:
        loop.stop()


@pytest.mark.parametrize("service", [DecodeService, PrefillService])
def test_get_load_answers_while_a_step_holds_the_lock(service: Any) -> None:
    loop = _Busy()
    loop.engine = SimpleNamespace(config=SimpleNamespace(page_size=16))  # type: ignore[attr-defined]
    loop.scores_prompts = True  # type: ignore[attr-defined]
    svc = service()
    svc._loop = loop  # what bind() sets; the rest of the service is not used here
    svc.bootstrap_address = "127.0.0.1:1"
    loop.board.refresh()
    step = hold(loop.lock, STEP_S)
    start = time.monotonic()
    report = asyncio.run(svc.GetLoad(None, None))
    assert time.monotonic() - start < STEP_S / 4
    assert report.running_requests == 0 and report.page_size == 16
    step.join()
